#!/usr/bin/env bash
# The whole GPU session's work in one `device` call: install the carried wheels and the package, run the
# GPU tests, run the throughput benchmark (or, with `rollout`, benchmarks/rollout.py), leave everything
# under $OUT, print a short table last.
#   run(command="bash benchmarks/gpu_suite.sh [tests|bench|all|rollout|rl|rl_pipeline|public|serving|itl|mixed|sweep|profile|gemm|pdl|probe|probe_ws|probe_layer|probe_layer64|probe_step64|layers64|kv_prefetch|paged_decode|streamk|decode_attn|fold_o|fold_mlp|layers|layers_probe|mlp_probe|timeline|cold|startup|load|targets_a|targets_b|targets] [args...]", carry=[".whl"])
# GPU_TESTS: the test files of the tests mode (default tests/gpu); GPU_TESTS_PART=i/n: the i-th of n parts of them.
# Every mode ends in finish(): $OUT then holds only summary.md (the tables, stage results, the target table
# in the targets modes) and results.tgz (everything else, logs included), since the device returns at most
# 8 files. SUITE_SMOKE=1 runs a mode on the CPU (no install, no GPU; the targets stages at toy sizes):
# tests/test_gpu_suite.py.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORKDIR=${SUITE_WORKDIR:-/tmp/ourobatch-bench}  # the benchmarks' --workdir default: the random checkpoint
finish() {  # every mode ends here (trap EXIT): summary.md + results.tgz, nothing else left under $OUT
  local rc=$? sum="$OUT/.summary.md" tgz big f mds
  trap - EXIT
  [ "$rc" -eq 0 ] && rc=${status:-0}
  case $what in targets*) for f in "$WORKDIR"/$([ -n "${SUITE_SMOKE:-}" ] && echo tiny || echo ouro-1.4b-random); do
    [ -f "$f/config.json" ] && cp "$f/config.json" "$OUT/model_config.json"; done;; esac  # the bytes floor's shape
  { echo "# gpu_suite.sh $what: exit $rc after $SECONDS s"; echo
    [ -s "$OUT/gpu.txt" ] && { sed 's/^/    /' "$OUT/gpu.txt"; echo; }
    [ -s "$OUT/stages.md" ] && { printf '| stage | exit | seconds |\n|---|---|---|\n'; cat "$OUT/stages.md"; echo; }
    case $what in targets*) python3 benchmarks/targets_report.py "$OUT" 2>&1; echo;; esac
    [ -s "$OUT/gpu_tests.log" ] && { echo '```'; tail -15 "$OUT/gpu_tests.log"; echo '```'; echo; }
    mds=$(find "$OUT" -name '*.md' ! -name stages.md ! -name .summary.md | sort)
    for f in $mds; do echo "## ${f#"$OUT"/}"; echo; head -40 "$f"; echo; done
    [ -z "$mds" ] && for f in $(find "$OUT" -name '*.log' | sort); do
      echo "## ${f#"$OUT"/} (last lines)"; echo '```'; tail -20 "$f"; echo '```'; done
  } > "$sum" 2>&1
  tgz=$(mktemp /tmp/gpu_suite_results.XXXXXX)
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name .summary.md -print0 | tar --null -czf "$tgz" -T -)
  if [ "$(stat -c %s "$tgz")" -gt 15000000 ]; then  # the device returns files of at most 16 MiB: drop big ones
    big=$(cd "$OUT" && find . -type f -size +2M ! -name .summary.md | sort)
    (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name .summary.md -print0 \
      | tar --null -czf "$tgz" $(printf -- '--exclude=%s ' $big) -T -)
    printf 'Left out of results.tgz (over 2 MB each):\n%s\n' "$big" >> "$sum"
  fi
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name .summary.md -exec rm -rf {} +
  mv "$tgz" "$OUT/results.tgz" && chmod 644 "$OUT/results.tgz"
  mv "$sum" "$OUT/summary.md"
  echo; cat "$OUT/summary.md"
  exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM INT  # a stop still packs what is there
if [ -n "${SUITE_SMOKE:-}" ]; then
  echo "SUITE_SMOKE: CPU smoke run, no install" > "$OUT/gpu.txt"
else
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
fi
status=0
gpu_tests() {  # $1: a time limit (s), then pytest's files: -x, the log in gpu_tests.log, the exit in $status
  local limit=$1; shift
  timeout -k 10 "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" -x "$@" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
  status=${PIPESTATUS[0]}
}
if [ "$what" = startup ]; then  # the startup's GPU tests (warm-up, captures, graphed prefill), then `cold` below
  GPU_TESTS=${GPU_TESTS:-tests/gpu/test_gpu_warmup.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_prefill_graph.py}
fi
if [ -z "${GPU_TESTS:-}" ] && [ -n "${GPU_TESTS_PART:-}" ]; then  # i/n: every n-th file of tests/gpu from the i-th
  part=${GPU_TESTS_PART%/*}; parts=${GPU_TESTS_PART#*/}  # (the whole suite outgrew one 600 s device call)
  GPU_TESTS=$(ls tests/gpu/test_*.py | sort | awk -v i="$part" -v n="$parts" '(NR - i) % n == 0' | tr '\n' ' ')
  echo "GPU_TESTS_PART $GPU_TESTS_PART: $GPU_TESTS" >> "$OUT/gpu.txt"
fi
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = startup ]; then  # GPU_TESTS: files (default tests/gpu)
  # -o addopts: the H200's pytest has no pytest-asyncio, whose pyproject options --strict-config would refuse
  python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" --durations=20 ${GPU_TESTS:-tests/gpu} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/throughput.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -40
fi
if [ "$what" = rollout ]; then  # the RL rollout batch through the async Engine (benchmarks/rollout.py)
  python3 benchmarks/rollout.py --out "$OUT" "$@" 2>&1 | tee "$OUT/rollout.log" | grep -v '^{' | tail -40
fi
if [ "$what" = public ]; then  # SyncEngine vs async Engine, with the per-step profile (benchmarks/public_path.py)
  python3 benchmarks/public_path.py --out "$OUT/public" "$@" 2>&1 | tee "$OUT/public.log" | grep '^|' | tail -12
fi
if [ "$what" = serving ]; then  # latency under Poisson arrivals (benchmarks/serving.py)
  python3 benchmarks/serving.py --out "$OUT/serving" "$@" 2>&1 | tee "$OUT/serving.log" | tail -30
fi
if [ "$what" = sweep ]; then  # launch configs of the paged attention kernel (benchmarks/attention_sweep.py)
  python3 benchmarks/attention_sweep.py --out "$OUT/sweep" "$@" 2>&1 | tee "$OUT/sweep.log" | tail -30
fi
if [ "$what" = pdl ]; then  # the decode harness's floor scenarios with engine/pdl.py off and on, alternated
  # (OUROBATCH_PDL=0 / 1, PDL_ROUNDS pairs, default 2); each run its own process and folder
  for r in $(seq 1 "${PDL_ROUNDS:-2}"); do
    for p in 0 1; do
      OUROBATCH_PDL=$p python3 benchmarks/throughput.py --out "$OUT/pdl/pdl${p}_r$r" --configs interval1 \
        --scenarios 8x512x256,64x512x256 "$@" 2>&1 | tee "$OUT/pdl_${p}_r$r.log" | grep '^|' | tail -4
    done
  done
fi
if [ "$what" = layers64 ]; then  # the 64-row launches (engine/layers64.py, OUROBATCH_DECODE_LAYERS64): their GPU
  # tests, the decode harness at N = 64 with the switch off and on, alternated (L64_ROUNDS pairs, default 1;
  # L64_SCENARIOS; on only if the tests passed), each run its own process, then the loop-pass probe
  # (benchmarks/ws_step64_probe.py: last, when the 1.4B shape's kernels are in the compile cache); a hang exits
  # (the limits add up to ~9.5 minutes: one device call)
  if [ "${L64_TESTS:-1}" != 0 ]; then  # L64_TESTS=0: they passed in an earlier call
    gpu_tests 240 tests/gpu/test_gpu_gluon_layers64.py
  fi
  on=1; [ "$status" = 0 ] || on=""  # the launches failed their tests: the harness without them only
  for r in $(seq 1 "${L64_ROUNDS:-1}"); do
    for v in 0 $on; do
      OUROBATCH_DECODE_LAYERS64=$v timeout -k 10 120 python3 benchmarks/throughput.py \
        --out "$OUT/layers64/l64_${v}_r$r" --configs interval1 --scenarios "${L64_SCENARIOS:-64x512x256}" "$@" 2>&1 \
        | tee "$OUT/layers64_${v}_r$r.log" | grep '^|' | tail -3
    done
  done
  if [ "${L64_PROBE:-1}" != 0 ]; then
    timeout -k 10 "${PROBE_TIMEOUT_S:-150}" python3 benchmarks/ws_step64_probe.py --out "$OUT/probe_step64" 2>&1 \
      | tee "$OUT/probe_step64.log" | tail -14
  fi
fi
if [ "$what" = kv_prefetch ]; then  # keys and values asked into L2 ahead of the attention (engine/kv_prefetch.py):
  # its GPU tests (PF_TESTS=0: none), the loop-pass probe (benchmarks/kv_prefetch_probe.py, its args; PF_PROBE=0:
  # none), then the decode harness at N = 64 with OUROBATCH_KV_PREFETCH off and at each of PF_SETTINGS (default
  # auto: the probe's PF_BEST best settings, default 2), alternated, PF_ROUNDS rounds (default 1), each run its
  # own process; a hang exits
  if [ "${PF_TESTS:-1}" != 0 ]; then
    gpu_tests 180 tests/gpu/test_gpu_kv_prefetch.py
  fi
  if [ "${PF_PROBE:-1}" != 0 ]; then
    timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/kv_prefetch_probe.py --out "$OUT/kv_prefetch" "$@" \
      2>&1 | tee "$OUT/kv_prefetch.log" | tail -60
  fi
  PF_SETTINGS=${PF_SETTINGS:-auto}
  if [ "$PF_SETTINGS" = auto ]; then
    PF_SETTINGS=$(python3 benchmarks/kv_prefetch_probe.py --out "$OUT/kv_prefetch" --best "${PF_BEST:-2}" 2>/dev/null)
    echo "harness settings (the probe's best): ${PF_SETTINGS:-none}"
  fi
  for r in $(seq 1 "${PF_ROUNDS:-1}"); do
    for v in ${PF_SETTINGS:+0 $PF_SETTINGS}; do
      OUROBATCH_KV_PREFETCH=$v timeout -k 10 120 python3 benchmarks/throughput.py \
        --out "$OUT/pf/pf_${v//:/_}_r$r" --configs interval1 --scenarios "${PF_SCENARIOS:-64x512x256}" 2>&1 \
        | tee "$OUT/pf_${v//:/_}_r$r.log" | grep '^|' | tail -3
    done
  done
fi
if [ "$what" = streamk ]; then  # the stream-K GEMMs (engine/triton_streamk.py): their GPU tests (SK_TESTS=0: none),
  # the probe (gemm_scaling_probe.py --stream; SK_PROBE=0: none), then the decode harness at SK_SCENARIOS (default
  # 64x512x256) with OUROBATCH_STREAM_K at each of SK_VALUES (default none gate qkv gate,qkv) in turn, SK_ROUNDS rounds
  # (default 2), each its own process, only if the tests passed
  if [ "${SK_TESTS:-1}" != 0 ]; then
    gpu_tests 300 tests/gpu/test_gpu_streamk.py
  fi
  if [ "${SK_PROBE:-1}" != 0 ] && [ "$status" = 0 ]; then
    timeout -k 10 240 python3 benchmarks/gemm_scaling_probe.py --out "$OUT/streamk" --stream 2>&1 \
      | tee "$OUT/streamk_probe.log" | grep '^|' | tail -40
  fi
  for r in $( [ "$status" = 0 ] && seq 1 "${SK_ROUNDS:-2}"); do
    for v in ${SK_VALUES:-none gate qkv gate,qkv}; do
      OUROBATCH_STREAM_K=$v timeout -k 10 150 python3 benchmarks/throughput.py --out "$OUT/sk/sk_${v/,/_}_r$r" \
        --configs interval1 --scenarios "${SK_SCENARIOS:-64x512x256}" 2>&1 | tee "$OUT/sk_${v/,/_}_r$r.log" \
        | grep '^|' | tail -1 | sed "s|^|OUROBATCH_STREAM_K=$v r$r: |"
    done
  done
fi
if [ "$what" = paged_decode ]; then  # the paged kernel's launch for the decode calls it serves (N >= 17): the
  # attention kernels' GPU tests (PD_TESTS=0: none), the probe (benchmarks/decode_attention.py --triton-grid --ceilings
  # at PD_SHAPES, default 64x512,64x640,64x768; PD_GLUON=1: the Gluon rings too), then the decode harness at
  # PD_SCENARIOS (default 64x512x256) with OUROBATCH_PAGED_DECODE unset (0) and each of PD_SETTINGS (default auto: the
  # probe's PD_BEST best launches, default 2, that beat the table), alternated, PD_ROUNDS rounds (default 1), each run
  # its own process, only if the tests passed; a hang exits
  if [ "${PD_TESTS:-1}" != 0 ]; then
    gpu_tests 240 tests/gpu/test_gpu_attention_kernels.py
  fi
  gluon=--no-gluon; [ "${PD_GLUON:-0}" = 1 ] && gluon=""
  if [ "${PD_PROBE:-1}" != 0 ]; then  # PD_PROBE=0: no probe (give PD_SETTINGS)
    timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/decode_attention.py --out "$OUT/paged_decode" \
      --shapes "${PD_SHAPES:-64x512,64x640,64x768}" --triton-grid --ceilings $gluon 2>&1 \
      | tee "$OUT/paged_decode.log" | grep -v '^[0-9]' | tail -12
  fi
  PD_SETTINGS=${PD_SETTINGS:-auto}
  if [ "$PD_SETTINGS" = auto ]; then
    PD_SETTINGS=$(python3 benchmarks/decode_attention.py --out "$OUT/paged_decode" --best "${PD_BEST:-2}" 2>/dev/null)
    echo "harness launches (the probe's best): ${PD_SETTINGS:-none}"
  fi
  [ "$status" = 0 ] || PD_SETTINGS=""  # a wrong kernel: no timings
  for r in $(seq 1 "${PD_ROUNDS:-1}"); do
    for v in ${PD_SETTINGS:+0 $PD_SETTINGS}; do
      OUROBATCH_PAGED_DECODE=$v timeout -k 10 120 python3 benchmarks/throughput.py \
        --out "$OUT/pd/pd_${v//\//_}_r$r" --configs interval1 --scenarios "${PD_SCENARIOS:-64x512x256}" 2>&1 \
        | tee "$OUT/pd_${v//\//_}_r$r.log" | grep '^|' | tail -3 | sed "s|^|OUROBATCH_PAGED_DECODE=$v: |"
    done
  done
fi
if [ "$what" = decode_attn ]; then  # the Gluon decode attention kernel: its GPU tests, the kernel against the
  # Triton table (benchmarks/decode_attention.py), then the decode harness's floor scenarios with each kernel
  # (OUROBATCH_DECODE_ATTENTION=triton / gluon, DA_ROUNDS rounds, default 2; DA_SCENARIOS), each run its own
  # process; a hang exits
  gpu_tests 150 tests/gpu/test_gpu_gluon_attention.py
  if [ "${DA_BENCH:-1}" != 0 ]; then  # DA_BENCH=0: the harness only
    timeout -k 10 200 python3 benchmarks/decode_attention.py --out "$OUT/decode_attention" 2>&1 \
      | tee "$OUT/decode_attention.log" | grep '^|' | tail -12
  fi
  for r in $(seq 1 "${DA_ROUNDS:-2}"); do  # DA_RINGS: the Gluon rings (OUROBATCH_DECODE_RING), default 32x6
    for k in triton ${DA_RINGS:-32x6}; do
      name=$k; [ "$k" = triton ] || name=gluon_$k
      OUROBATCH_DECODE_ATTENTION=$([ "$k" = triton ] && echo triton || echo gluon) OUROBATCH_DECODE_RING=${k/triton/32x6} \
        timeout -k 10 150 python3 benchmarks/throughput.py --out "$OUT/da/${name}_r$r" --configs interval1 \
        --scenarios "${DA_SCENARIOS:-8x512x256,64x512x256}" "$@" 2>&1 | tee "$OUT/da_${name}_r$r.log" | grep '^|' | tail -4
    done
  done
fi
env_variants() {  # $1: an env variable, $2: its values, $3: a tag, then throughput.py's args: GPU tests first
  # (FV_TESTS), then the decode harness with each value, each run its own process, FV_ROUNDS rounds (default 2),
  # FV_SCENARIOS (default 8x512x256); FV_PROFILE=1: the step profile's kernel counts with the first and last value
  local var=$1 values=$2 tag=$3 r f; shift 3
  gpu_tests 420 $FV_TESTS
  [ "$status" -eq 0 ] || return  # a wrong or hung kernel: no timings
  for r in $(seq 1 "${FV_ROUNDS:-2}"); do
    for f in $values; do
      env "$var=$f" timeout -k 10 150 python3 benchmarks/throughput.py --out "$OUT/$tag/$tag${f/:/_}_r$r" \
        --configs interval1 --scenarios "${FV_SCENARIOS:-8x512x256}" "$@" 2>&1 | tee "$OUT/$tag${f/:/_}_r$r.log" \
        | grep '^|' | tail -1 | sed "s/^/$var=$f: /"
    done
  done
  if [ "${FV_PROFILE:-0}" = 1 ]; then
    for f in ${values%% *} ${values##* }; do
      env "$var=$f" timeout -k 10 200 python3 benchmarks/step_profile.py --out "$OUT/${tag}_profile${f/:/_}" \
        --ns 8 --configs interval1 2>&1 | tee "$OUT/${tag}_profile${f/:/_}.log" | tail -4
    done
  fi
}
if [ "$what" = fold_o ]; then  # o_proj (and its add + norm) folded into the Gluon decode kernel
  # (engine/gluon_attention_o.py): env_variants over OUROBATCH_DECODE_FOLD_O's FO_VARIANTS (default "0 1 1:cta 2:cta")
  FV_TESTS="${FO_TESTS:-tests/gpu/test_gpu_gluon_attention_o.py tests/gpu/test_gpu_warmup.py}" \
    env_variants OUROBATCH_DECODE_FOLD_O "${FO_VARIANTS:-0 1 1:cta 2:cta}" fo "$@"
fi
if [ "$what" = mlp_probe ]; then  # the MLP alone: the engine's kernels against the Gluon launch and its
  # diagnostics (benchmarks/mlp_probe.py; its --ways)
  timeout -k 10 300 python3 benchmarks/mlp_probe.py --out "$OUT/mlp_probe" "$@" 2>&1 | tee "$OUT/mlp_probe.log" | tail -12
fi
if [ "$what" = fold_mlp ]; then  # the MLP as one Gluon launch (engine/gluon_mlp.py): env_variants over
  # OUROBATCH_DECODE_FOLD_MLP's FM_VARIANTS (default "0 1")
  FV_TESTS="${FM_TESTS:-tests/gpu/test_gpu_gluon_mlp.py tests/gpu/test_gpu_warmup.py}" \
    env_variants OUROBATCH_DECODE_FOLD_MLP "${FM_VARIANTS:-0 1}" fm "$@"
fi
if [ "$what" = layers ]; then  # every layer of a decode loop pass as one Gluon launch (engine/gluon_layers.py):
  # env_variants over OUROBATCH_DECODE_LAYERS's LV_VARIANTS (default "0 1")
  FV_TESTS="${LV_TESTS:-tests/gpu/test_gpu_gluon_layers.py}" \
    env_variants OUROBATCH_DECODE_LAYERS "${LV_VARIANTS:-0 1}" layers "$@"
fi
if [ "$what" = layers_probe ]; then  # the loop-pass launch alone (benchmarks/layers_probe.py; --trace: where a
  # layer's time goes, from the measuring build's stamps); a hang exits
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/layers_probe.py --out "$OUT/layers_probe" "$@" 2>&1 \
    | tee "$OUT/layers_probe.log" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ "$what" = cold ] || [ "$what" = startup ]; then  # fresh processes: ready and first rounds, empty then warm
  # compile cache (cold_start.py)
  python3 benchmarks/cold_start.py --out "$OUT/cold" "$@" 2>&1 | tee "$OUT/cold.log" | grep -v '^{' | tail -20
fi
if [ "$what" = load ]; then  # the checkpoint load, the engine's reads vs the mapped copy, alone and beside GIL-
  # holding threads and forks (benchmarks/weight_load.py)
  python3 benchmarks/weight_load.py --out "$OUT/load" "$@" 2>&1 | tee "$OUT/load.log" | grep -v '^{' | tail -12
fi
if [ "$what" = itl ]; then  # the prefill budget sweep: p99 / p50 gap between deliveries per max_num_batched_tokens
  # (benchmarks/serving.py, full depth, rates 16 and 32, 80 requests; one engine per budget). ITL_BUDGETS overrides.
  for budget in ${ITL_BUDGETS:-8192 1024 2048 512}; do
    python3 benchmarks/serving.py --out "$OUT/itl/b$budget" --configs interval1 --rates 16,32 --num-requests 80 \
      --no-plots --max-num-batched-tokens "$budget" "$@" 2>&1 | tee "$OUT/itl_b$budget.log" | grep '^|' | tail -4
  done
fi
if [ "$what" = mixed ]; then  # a step that prefills k tokens beside N decode rows vs a decode step (mixed_step.py)
  python3 benchmarks/mixed_step.py --out "$OUT/mixed" "$@" 2>&1 | tee "$OUT/mixed.log" | grep -v '^{' | tail -150
fi
if [ "$what" = profile ]; then  # kernels per step, GEMM bandwidth, graph gaps (benchmarks/step_profile.py)
  python3 benchmarks/step_profile.py --out "$OUT/profile" "$@" 2>&1 | tee "$OUT/profile.log" | tail -120
fi
if [ "$what" = timeline ]; then  # what each kernel adds to the graphed step, overlap included
  # (benchmarks/graph_timeline.py): one process per value of the env switch TL_VAR in TL_VALUES ("-": unset)
  for v in ${TL_VALUES:--}; do
    envs=(); tag=default
    [ "$v" = - ] || { envs=("${TL_VAR:?TL_VAR names the switch TL_VALUES sets}=$v"); tag=${v//[:\/]/_}; }
    env "${envs[@]}" timeout -k 10 300 python3 benchmarks/graph_timeline.py --out "$OUT/timeline/$tag" "$@" 2>&1 \
      | tee "$OUT/timeline_$tag.log" | grep '^###\|^| _\|^| decode\|^| nvjet' | head -40
  done
fi
if [ "$what" = gemm ]; then  # fused skinny GEMMs vs cuBLAS per rows, then the decode step with them on and off
  # GEMM_SWEEP_ARGS: gemm_sweep.py's arguments (default --inductor); GEMM_PROFILE=0 skips the step profile
  python3 benchmarks/gemm_sweep.py --out "$OUT/gemm" ${GEMM_SWEEP_ARGS:---inductor} 2>&1 | tee "$OUT/gemm.log" | tail -60
  if [ "${GEMM_PROFILE:-1}" != 0 ]; then
    python3 benchmarks/step_profile.py --out "$OUT/profile" --gemm both "$@" 2>&1 | tee "$OUT/profile.log" \
      | grep -v "^    " | tail -20
  fi
fi
if [ "$what" = probe_ws ]; then  # the same chain as one warp-specialized Gluon kernel whose weight stream
  # never waits at a phase boundary (benchmarks/phase_probe_ws.py; results checked vs torch; a hang exits)
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/phase_probe_ws.py --out "$OUT/probe_ws" "$@" 2>&1 \
    | tee "$OUT/probe_ws.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = probe_layer ]; then  # Ouro-1.4B-shaped layers (norms, residual, SiLU x up, down's K) in one
  # warp-specialized Gluon kernel (benchmarks/ws_layer_probe.py; checked vs torch; a hang exits)
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/ws_layer_probe.py --out "$OUT/probe_layer" "$@" 2>&1 \
    | tee "$OUT/probe_layer.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = probe_layer64 ]; then  # the same layers at 64 rows in the split-K design of ws_chain64_wg.py
  # (benchmarks/ws_layer64_probe.py; every stage checked vs torch; a hang exits)
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/ws_layer64_probe.py --out "$OUT/probe_layer64" "$@" 2>&1 \
    | tee "$OUT/probe_layer64.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = probe_step64 ]; then  # the N = 64 loop pass: the engine's kernels against the decode attention +
  # ws_layer64's kernel a layer (benchmarks/ws_step64_probe.py; outputs checked finite, the chain way vs torch)
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/ws_step64_probe.py --out "$OUT/probe_step64" "$@" 2>&1 \
    | tee "$OUT/probe_step64.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = probe ]; then  # a phase boundary's cost: PDL-chained kernels vs a persistent kernel's grid
  # barriers, on the bytes of the decode step's GEMMs (benchmarks/phase_probe.py; results checked vs torch)
  timeout -k 10 "${PROBE_TIMEOUT_S:-300}" python3 benchmarks/phase_probe.py --out "$OUT/probe" "$@" 2>&1 \
    | tee "$OUT/probe.log" | tail -40
fi
if [ "$what" = rl_pipeline ]; then  # sync loop vs Collector under a simulated learner (benchmarks/rl_pipeline.py)
  # The issue's workload; the whole matrix takes ~65 min, so one call runs deferred8's sync loop and
  # collector at eta=1 / continue (~7 min), then eta=0 if --time-limit-s still allows it. Later arguments
  # win: e.g. `rl_pipeline --configs interval1`, `rl_pipeline --no-sync --etas 1 --policies recompute,abort`.
  python3 benchmarks/rl_pipeline.py --out "$OUT/rl_pipeline" --prompts 32 --n 8 --prompt-len 512 --max-tokens 2048 \
    --median 400 --train-s 10 --batches 5 --configs deferred8 --etas 1,0 --policies continue --time-limit-s 540 "$@" \
    2>&1 | tee "$OUT/rl_pipeline.log" | grep -v '^{' | grep -v 'batch/s\|s/batch' | tail -30
fi
if [ "$what" = rl ] || [ "$what" = all ]; then  # sleep / wake / load / update timings and memory
  python3 benchmarks/rl_ops.py --out "$OUT/rl_ops" 2>&1 | tee "$OUT/rl_ops.log" | grep -v '^{' | tail -12
fi
case $what in targets|targets_a|targets_b)  # issue 22's target table (targets_report.py, into summary.md)
  # targets_a: the public paths, N = 64 three runs in a row (async vs sync, GPU idle share, B=4/B=8 vs
  # interval 1), N = 8 interval 1 (vs HF generate), the decode harness at N = 8 / 64 (bytes floor).
  # targets_b: cold_start (fresh processes, 3 rounds of distinct prompts), the rollout batch at the issue's
  # settings (interval1, deferred8, lazy KV), public paths at N = 256 (GPU idle share), Poisson arrivals at
  # serve's step budget (p99 / p50 gap between deliveries: benchmarks/serving.py); TARGETS_HARNESS256=1
  # adds the decode harness at N = 256 (sync stepping: the host share the issue started from).
  # Each half was planned for one 10-minute call; on the H200 they took 157 s and 296 s (session 13), so `targets`
  # (both in one call) should fit its budget; not run as one call yet. No "$@" here.
  # TARGETS_BUDGET_S (570): a stage starts only with its minimum left, under a timeout of what is left.
  budget=${TARGETS_BUDGET_S:-570}
  stage() {  # stage NAME MIN_S CMD...: CMD's output in $OUT/NAME.log, its exit and seconds in stages.md
    local name=$1 min=$2 left t rc; shift 2
    left=$(( budget - SECONDS - 25 ))  # 25 s kept for the report and the packing
    if [ "$left" -lt "$min" ]; then echo "| $name | skipped ($left s left, needs $min) | 0 |" >> "$OUT/stages.md"; return; fi
    t=$SECONDS
    timeout -k 10 "$left" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    echo "| $name | $rc | $(( SECONDS - t )) |" >> "$OUT/stages.md"
    [ "$rc" -eq 0 ] || status=1
    echo "== $name: exit $rc, $(( SECONDS - t )) s"; grep '^|' "$OUT/$name.log" | tail -n 8
  }
  if [ -n "${SUITE_SMOKE:-}" ]; then  # toy sizes on the CPU, same stages and folders
    dev=(--device cpu --dtype float32 --tiny --workdir "$WORKDIR"); pp=(-P 8 -M 6); p256=(-P 8 -M 4)
    cold=(-N 4 -P 40 -M 4); floor=(--scenarios 8x16x8,64x16x8)
    roll=(--prompts 3 --n 2 --prompt-len 8 --max-tokens 24 --median 8)
    itl=(--rates 50 --num-requests 6 --prompt-median 8 --max-prompt-len 16 --output-median 6 --max-tokens 12)
  else
    # TARGETS_PUBLIC_ARGS (e.g. "-M 128"): extra public_path.py arguments of the N = 64 and N = 8 stages
    dev=(--workdir "$WORKDIR"); pp=(${TARGETS_PUBLIC_ARGS:-}); p256=(-M 512); cold=()
    floor=(--scenarios 8x512x256,64x512x256); roll=(); itl=(--rates 16,32 --num-requests 80)
  fi
  if [ "$what" != targets_b ]; then
    for r in 1 2 3; do  # three runs in a row; the first with the per-step profile
      prof=(); [ "$r" -gt 1 ] && prof=(--no-profile)
      stage "public_n64_r$r" 100 python3 benchmarks/public_path.py --out "$OUT/public_n64_r$r" -N 64 "${pp[@]}" \
        "${prof[@]}" "${dev[@]}"
    done
    stage public_n8 40 python3 benchmarks/public_path.py --out "$OUT/public_n8" -N 8 --configs interval1 --no-profile \
      "${pp[@]}" "${dev[@]}"
    stage harness_floor 45 python3 benchmarks/throughput.py --out "$OUT/harness_floor" --configs interval1 \
      "${floor[@]}" "${dev[@]}"
  fi
  if [ "$what" != targets_a ]; then
    stage cold 120 python3 benchmarks/cold_start.py --out "$OUT/cold" "${cold[@]}" "${dev[@]}"
    stage rollout 110 python3 benchmarks/rollout.py --out "$OUT/rollout" --configs interval1,deferred8 \
      --allocations lazy "${roll[@]}" "${dev[@]}"
    stage public_n256 120 python3 benchmarks/public_path.py --out "$OUT/public_n256" -N 256 \
      --configs interval1,deferred8 --no-profile "${p256[@]}" "${dev[@]}"
    stage itl_serve 50 python3 benchmarks/serving.py --out "$OUT/itl_serve" --configs interval1 --no-plots \
      --max-num-batched-tokens 512 --max-prefill-tokens-while-decoding 192 "${itl[@]}" "${dev[@]}"  # serve's defaults
    if [ -n "${TARGETS_HARNESS256:-}" ]; then
      stage harness_n256 70 python3 benchmarks/throughput.py --out "$OUT/harness_n256" --scenarios 256x512x512 \
        --configs interval1,deferred4,deferred8 "${dev[@]}"
    fi
  fi;;
esac
# (other helpers: new modes go above this line)
exit $status
