# session 47, call A: the sizing facts for the cluster layer kernel (any card), then on an H200 issue 22's targets_a
limit=${LIMIT:-585}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"; base=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 80 python3 benchmarks/cluster_occupancy.py --out $base/occ --sizes 1,2,4,8,16 --smem-kb 0,120,200 > $base/occ.log 2>&1
echo "occupancy rc=$?"; tail -18 $base/occ.log
timeout 200 python3 benchmarks/attention_in_pool.py --out $base/aip --kernels triton,32x12p1,32x12p1@128 --rounds 2 \
  --workdir /tmp/wd > $base/aip.log 2>&1; echo "in pool rc=$?"; grep -E "^\|" $base/aip.log | tail -8
left=$(( limit - SECONDS - 10 ))
case "$name" in
  *H200*) [ $left -gt 200 ] && { OUT=$base/ta TARGETS_BUDGET_S=$(( left - 10 )) timeout -s TERM $left bash \
            benchmarks/gpu_suite.sh targets_a > /dev/null 2>&1; echo "targets rc=$?"; grep '^| ' $base/ta/summary.md | head -30; };;
  *) for mb in 0 32 16; do [ $SECONDS -gt $(( limit - 75 )) ] && break
       timeout 70 python3 benchmarks/kv_prefetch_probe.py --out $base/sz$mb-$SECONDS --pages 0 --persist-mb $mb \
         > $base/sz.log 2>&1
       echo "persist $mb rc=$?: $(grep -E '^\| (kernels|attention) ' $base/sz.log | awk -F'|' '{print $2 $3}' | tr '\n' ';')"
     done;;
esac
