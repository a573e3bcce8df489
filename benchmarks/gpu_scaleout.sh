#!/usr/bin/env bash
# Scale-out on one GPU (the device machine): FSDP2 on NCCL at world size 1, a colocated engine,
# and --async vs sync step times. Run from the repo root with the wheels of ray (cp312) unpacked
# into .raypart/ and math-verify & co in .whl/; results under $OUT.
#   bash benchmarks/gpu_scaleout.sh
set -uo pipefail
cat .raypart/ray.whl.part-* > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .raypart/*.whl .whl/*.whl || exit 1
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
          > $OUT/$name.out 2>&1; echo "$name rc=$?"; cp /tmp/runs/$name/train.log $OUT/$name.train.log 2>/dev/null;
        cp /tmp/runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null; }
run fsdp1 --num-rollout 3 --actor-num-gpus-per-node 1
run colocate --num-rollout 3 --actor-num-gpus-per-node 1 --colocate --rollout-backend sglang --sglang-log-dir /tmp/srv
cp /tmp/srv/*.log $OUT/ 2>/dev/null
for i in 1 2 3; do
  run sync$i --num-rollout 5 --actor-num-gpus-per-node 1 --alignment-check off
  run async$i --num-rollout 5 --actor-num-gpus-per-node 1 --alignment-check off --async
done
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
for v in ("sync", "async"):
    means = []
    for i in (1, 2, 3):
        try:
            rows = [json.loads(l) for l in open(f"{out}/{v}{i}.metrics.jsonl")]
            means.append(statistics.mean(r["perf/step_time_s"] for r in rows[1:]))
        except OSError:
            pass
    print(v, " ".join(f"{m:.3f}" for m in means), "median", f"{statistics.median(means):.3f}" if means else "-")
PY
