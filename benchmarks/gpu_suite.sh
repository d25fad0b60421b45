#!/usr/bin/env bash
# The whole GPU session's work in one `device` call: install the carried wheels and the package, run the
# GPU tests, run the throughput benchmark (or, with `rollout`, benchmarks/rollout.py), leave everything
# under $OUT, print a short table last.
#   run(command="bash benchmarks/gpu_suite.sh [tests|bench|all|rollout|rl|rl_pipeline|public|serving|itl|mixed|sweep|profile|gemm|cold] [args...]", carry=[".whl"])
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # -o addopts: the H200's pytest has no pytest-asyncio, whose pyproject options --strict-config would refuse
  python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
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
if [ "$what" = cold ]; then  # fresh processes: ready and first rounds, empty then warm compile cache (cold_start.py)
  python3 benchmarks/cold_start.py --out "$OUT/cold" "$@" 2>&1 | tee "$OUT/cold.log" | grep -v '^{' | tail -20
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
if [ "$what" = gemm ]; then  # fused skinny GEMMs vs cuBLAS per rows, then the decode step with them on and off
  python3 benchmarks/gemm_sweep.py --out "$OUT/gemm" --inductor 2>&1 | tee "$OUT/gemm.log" | tail -40
  python3 benchmarks/step_profile.py --out "$OUT/profile" --gemm both "$@" 2>&1 | tee "$OUT/profile.log" \
    | grep -v "^    " | tail -20
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
exit $status
