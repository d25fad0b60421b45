#!/usr/bin/env bash
# guidellm (vLLM project's load generator) as a client of `python -m ourobatch serve` on the shipped
# pointer-chase model (127.0.0.1): its openai_http backend on /v1/completions and /v1/chat/completions,
# streamed, 16 concurrent streams. Results: docs/server.md, "Clients".
#
#   benchmarks/clients/guidellm_bench.sh [OUT_DIR]      # default OUT_DIR: /tmp/guidellm_bench
#
# Needs guidellm in its own venv (too heavy for CI: ~4 min here, it pulls a 4 GB CUDA torch and transformers):
# python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm (0.8.1 here).
# Environment: GUIDELLM (default /tmp/guidellm-venv/bin/guidellm), PYTHON (the one with ourobatch[server];
# default python), PORT (18201), NUM_PROMPTS (64), OUTPUT_LEN (32), STREAMS (16).
#
# Data: the held-out tasks' prompts as a json_file (tests/lm_eval_tasks/pointer_chase_data.py; chat gets
# the task without bos, the template writes it). guidellm's synthetic_text does not fit this model: it
# encodes Faker's English with the tokenizer, and the pointer-chase vocabulary has none of those words.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/guidellm_bench}; mkdir -p "$OUT"
GUIDELLM=${GUIDELLM:-/tmp/guidellm-venv/bin/guidellm}
PYTHON=${PYTHON:-python}
PORT=${PORT:-18201}
MODEL=$PWD/models/pointer-chase
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PYTHON" - "$OUT" "${NUM_PROMPTS:-64}" "${OUTPUT_LEN:-32}" <<'EOF'
import json, sys
from pathlib import Path
from tests.lm_eval_tasks.pointer_chase_data import build_documents
out, num, output_len = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for name, field in (("completions", "prompt"), ("chat", "task")):
    rows = [{"prompt": d[field], "output_tokens_count": output_len} for d in build_documents(limit=num)]
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
EOF

source benchmarks/clients/serve.sh  # the server, stopped on exit

for name in completions chat; do
  route=/v1/completions; [ "$name" = chat ] && route=/v1/chat/completions
  args=(run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=pointer-chase,request_format=$route"
        --tokenizer "kind=huggingface_auto,model=$MODEL" --data "kind=json_file,path=$OUT/$name.jsonl"
        --profile "kind=concurrent,streams=${STREAMS:-16}" --constraint "kind=max_requests,count=${NUM_PROMPTS:-64}"
        --output "kind=json,path=$OUT/$name.json" --disable-progress)
  echo "== guidellm ${args[*]}" | tee "$OUT/$name.log"
  "$GUIDELLM" "${args[@]}" >> "$OUT/$name.log" 2>&1 || { tail -30 "$OUT/$name.log"; echo "FAILED: $name"; continue; }
  grep -A7 -E "Run Summary Info|Server Throughput Statistics" "$OUT/$name.log"
done
