#!/usr/bin/env bash
# Issue 13's speed table on the GPU machine (the device tool): installs the carried wheels (TRL,
# datasets, dill, multiprocess, math-verify & co; all with --no-deps) into /tmp/site, then runs
# benchmarks/speed.py on CUDA under a time limit. Run from the repo root with .whl/ carried:
#   bash benchmarks/gpu_speed.sh [speed.py flags, e.g. --only engine,trainer]
# SPEED_LIMIT (default 440 s) is speed.py's --time-limit, shared over its sections; a hard
# `timeout` of SPEED_LIMIT + 45 s stops it regardless (< 9 min in all with the install). The
# output goes to $OUT/speed.out as it comes, so a cut run still leaves the table so far.
set -uo pipefail
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name())"
echo "wheels installed in $((SECONDS - start)) s"
limit=${SPEED_LIMIT:-440}
timeout -k 10 $((limit + 45)) python3 benchmarks/speed.py --device cuda --time-limit "$limit" "$@" 2>&1 \
  | grep --line-buffered -v "Writing model shards" | tee "${OUT:-/tmp}/speed.out"
rc=${PIPESTATUS[0]}
echo "speed.py rc=$rc, $((SECONDS - start)) s in all"
