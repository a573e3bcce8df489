#!/usr/bin/env bash
# Scale-out on one GPU (the device machine): FSDP2 on NCCL at world size 1, a colocated engine,
# and --async vs sync step times. Run from the repo root with the wheels of ray (cp312) unpacked
# into .raypart/ and math-verify & co in .whl/; results under $OUT.
#   bash benchmarks/gpu_scaleout.sh
set -uo pipefail
# The ray wheel is over what one device call carries: RAY_PARTS names its pieces (default .raypart/).
ray=/tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
cat ${RAY_PARTS:-.raypart/ray.whl.part-*} > $ray 2>/dev/null
python3 -m zipfile -t $ray >/dev/null 2>&1 || { echo "no complete ray wheel: the Ray runs will fail"; ray=""; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $ray .raypart/*.whl .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled
python3 -c "import torch, ray; print(torch.__version__, ray.__version__, torch.cuda.get_device_name())"
python3 - <<'PY'
from pathlib import Path
from miles.testing.tiny import build_model_dir, write_prompts
build_model_dir(Path("/tmp/m"), hidden_size=1024, layers=8)   # ~60M parameters, the character tokenizer
write_prompts(Path("/tmp/p.jsonl"))
PY
common="--hf-checkpoint /tmp/m --prompt-data /tmp/p.jsonl --input-key prompt --label-key label --apply-chat-template
  --custom-rm-path miles.testing.rewards:digit_share --rollout-batch-size 8 --n-samples-per-prompt 8
  --rollout-max-response-len 64 --rollout-temperature 1.0 --micro-batch-size 16 --lr 1e-5 --device cuda
  --precision bf16 --check-weight-update-equal"
run() { local name=$1; shift; timeout 400 python3 -m miles train $common "$@" --output-dir /tmp/runs/$name \
          > /tmp/runs-$name.out 2>&1; local rc=$?; echo "$name rc=$rc"
        [ $rc = 0 ] || grep -v "^\s" /tmp/runs-$name.out | grep -i "error" | tail -3
        cp /tmp/runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null; }
part=${1:-all}
if [ "$part" = all ]; then
  run fsdp1 --num-rollout 3 --actor-num-gpus-per-node 1
fi
if [ "$part" = all ] || [ "$part" = colocate ]; then
  run colocate --num-rollout 3 --actor-num-gpus-per-node 1 --colocate --rollout-backend sglang --sglang-log-dir /tmp/srv
  grep -h "ERROR\|Error\|error" /tmp/runs/colocate/workers/*.log /tmp/srv/*.log 2>/dev/null | tail -8
  grep -h "offloaded\|loaded back\|Memory released\|Memory resumed\|step [0-9]/" /tmp/runs/colocate/train.log | head -12
fi
# --async vs sync: the trainer in Ray (local engine in the driver) or in the driver with a `miles serve` process.
variants=${VARIANTS:-"ray server"}
for i in 1 2 3; do
  for v in $variants; do
    if [ $v = ray ]; then flags="--actor-num-gpus-per-node 1"; else flags="--rollout-backend sglang --sglang-log-dir /tmp/srv2"; fi
    run ${v}_sync$i --num-rollout 5 --alignment-check off $flags
    run ${v}_async$i --num-rollout 5 --alignment-check off --async $flags
  done
done
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
for v in ("ray_sync", "ray_async", "server_sync", "server_async"):
    means, gen = [], []
    for i in (1, 2, 3):
        try:
            rows = [json.loads(l) for l in open(f"{out}/{v}{i}.metrics.jsonl")]
        except OSError:
            continue
        means.append(statistics.mean(r["perf/step_time_s"] for r in rows[1:]))
        gen.append(statistics.mean(r["perf/rollout_tok_s"] for r in rows[1:]))
    if means:
        print(f"{v:13s} s/step (steps 2-5) {' '.join(f'{m:.3f}' for m in means)} median {statistics.median(means):.3f}"
              f" | rollout tok/s {' '.join(f'{g:.0f}' for g in gen)}")
PY
