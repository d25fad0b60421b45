nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 benchmarks/cluster_occupancy.py --out $OUT/occ --sizes 2,4,8,16 --smem-kb 48,64,80,96,110,114 --warps 4,8 > $OUT/occ.log 2>&1; echo "occ rc=$?"; grep -E "^\| (4|8|16) " $OUT/occ.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gluon_attention.py -x 2>&1 | tail -3
for mb in 24 8 28; do timeout 70 python3 benchmarks/kv_prefetch_probe.py --out $OUT/sz$mb --pages 0 --persist-mb $mb > $OUT/sz$mb.log 2>&1
  echo "persist $mb rc=$?: $(grep -E '^\| (kernels|attention) ' $OUT/sz$mb.log | awk -F'|' '{print $2 $3}' | tr '\n' ';')"; done
