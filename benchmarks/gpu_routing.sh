#!/usr/bin/env bash
# Issue 15's routing figures on the GPU machine (the device tool): installs the carried wheels
# (math-verify and its parsers, bm25s; --no-deps) into /tmp/site, then runs
# benchmarks/routing_replay.py on CUDA for the tiny MoE of the CPU figures and a larger one.
# Run from the repo root with .whl/ carried: bash benchmarks/gpu_routing.sh
set -uo pipefail
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name())"
for shape in "--hidden-size 32 --layers 2 --experts 8 --top-k 2" "--hidden-size 256 --layers 4 --experts 16 --top-k 4"; do
  timeout -k 10 250 python3 benchmarks/routing_replay.py --device cuda $shape 2>/dev/null \
    | grep --line-buffered -E "^(device|family|qwen3_moe|mixtral) " | tee -a "${OUT:-/tmp}/routing.out"
done
echo "done in $((SECONDS - start)) s"
