# session 48: o_proj / down_proj over whole-K programs (any card); on an H200 also its K sweep, cluster occupancy, timeline
limit=${LIMIT:-585}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"; base=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout 200 python3 benchmarks/gemm_scaling_probe.py --out $base/narrow --narrow > $base/narrow.log 2>&1
echo "narrow rc=$?"; grep -E "^\|" $base/narrow.log | tail -24; tail -3 $base/narrow.log | grep -v "^|"
case "$name" in
  *H200*)
    [ -z "$LEAN" ] && timeout 150 python3 benchmarks/gemm_scaling_probe.py --out $base/ksweep --k-sweep > $base/ksweep.log 2>&1
    echo "ksweep rc=$?"; grep -E "^\|" $base/ksweep.log | tail -16
    timeout 80 python3 benchmarks/cluster_occupancy.py --out $base/occ --sizes 1,2,4,8,16 --smem-kb 0,110,120,200 \
      > $base/occ.log 2>&1; echo "occ rc=$?"; grep -E "^\|" $base/occ.log | tail -8
    left=$(( limit - SECONDS - 15 )); [ -n "$LEAN" ] && left=0
    [ $left -gt 120 ] && { OUT=$base/tl timeout -s TERM $left bash benchmarks/gpu_suite.sh timeline --ns 64 --after 2 \
      > $base/tl.log 2>&1; echo "timeline rc=$?"; tail -30 $base/tl/summary.md 2>/dev/null; };;
esac
