# session 47, call 3 (one command line on the warm H100): the GPU tests of the Gluon attention, then the ring on 120 / 128 / 132 CTAs
export PYTHONPATH=/tmp/site:$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" tests/gpu/test_gpu_gluon_attention.py 2>&1 | tail -4
timeout 250 python3 benchmarks/attention_in_pool.py --out $OUT/aip --kernels triton,32x12p1@120,32x12p1@128,32x12p1@132 --rounds 2 --workdir /tmp/wd > $OUT/aip.log 2>&1
