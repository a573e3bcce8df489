#!/usr/bin/env bash
# The fast engine on the device machine: the GPU tests, then engine_decode.py. Run from the repo
# root with the carried wheels in .whl/ (pytest among them); output on stdout, copies under $OUT.
#   bash benchmarks/gpu_engine.sh [tests|bench|all] [engine_decode.py flags...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
part=${1:-all}; shift || true
if [ "$part" = all ] || [ "$part" = tests ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -25
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  timeout 420 python3 benchmarks/engine_decode.py "$@" 2>&1 | tee ${OUT:-/tmp}/engine_decode.txt | grep -v Warning
fi
