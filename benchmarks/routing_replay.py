"""MoE routing replay (R3): the routing mismatch and the train/engine log-prob gap, replay off vs on.

A random MoE of each family (miles.testing.tiny.build_moe_model_dir: routers started small, so bf16
rounding flips choices between experts that both carry weight) trains with `miles train` in bf16,
on the tiny arithmetic prompts, replay off and replay on, each with --seeds seeds. Printed per
family and mode: `train/routing_mismatch_frac` (token-layer routes where the trainer's own top-k
differs from the engine's) and `train/train_rollout_logprob_abs_diff` at step 1 (the same rollout
for both modes of a seed) and over all steps, as median [min..max] over the seeds.

    python benchmarks/routing_replay.py [--device cpu|cuda] [--steps 4] [--seeds 3] [--families qwen3_moe,mixtral]
        [--hidden-size 32 --layers 2 --experts 8 --top-k 2] [--precision bf16|fp32] [--plant-router-fault 0.5]

`--plant-router-fault S`: a planted fault, the engine's copy of each router perturbed by S x its std
as the engine is built (the engine and the trainer then route many tokens differently).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import train

from miles.testing.tiny import build_moe_model_dir, write_prompts


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}..{max(values):.3g}]"


def plant_router_fault(scale: float) -> None:
    import torch

    from miles.bridge import routing
    from miles.rollout.local import engine as local_engine

    built = local_engine.LocalEngine.__init__

    def perturbed(self, model, **kw):
        with torch.no_grad():
            for r in routing.routers(model):
                r.weight.add_(scale * torch.randn_like(r.weight) * r.weight.std())
        built(self, model, **kw)

    local_engine.LocalEngine.__init__ = perturbed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--families", default="qwen3_moe,mixtral")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--plant-router-fault", type=float, default=0.0, metavar="S")
    a = p.parse_args()
    if a.plant_router_fault:
        plant_router_fault(a.plant_router_fault)
    work = Path(tempfile.mkdtemp(prefix="miles-r3-"))
    prompts = write_prompts(work / "prompts.jsonl")
    shape = dict(hidden_size=a.hidden_size, layers=a.layers, experts=a.experts, top_k=a.top_k)
    fault = f", engine routers perturbed x{a.plant_router_fault}" if a.plant_router_fault else ""
    print(f"device {a.device}, {a.precision}{fault}, {a.steps} steps x 16 samples, MoE {shape}, seeds 1..{a.seeds}")
    print(f"{'family':<10} {'replay':<6} {'mismatch step 1':<26} {'mismatch all steps':<26} "
          f"{'gap step 1':<28} {'gap all steps':<28}")
    for family in a.families.split(","):
        model = build_moe_model_dir(work / family, family, **shape)
        for replay in (False, True):
            first_mm, all_mm, first_gap, all_gap = [], [], [], []
            for seed in range(1, a.seeds + 1):
                out = work / f"{family}-{replay}-{seed}"
                rows = train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--input-key", "prompt",
                              "--label-key", "label", "--apply-chat-template", "--custom-rm-path",
                              "miles.testing.rewards:digit_share", "--rollout-batch-size", "4",
                              "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
                              "--micro-batch-size", "4", "--num-rollout", str(a.steps), "--lr", "1e-3",
                              "--precision", a.precision, "--device", a.device, "--seed", str(seed),
                              "--output-dir", str(out)] + (["--use-rollout-routing-replay"] if replay else []))
                mm = [r["train/routing_mismatch_frac"] for r in rows]
                gap = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
                first_mm.append(mm[0])
                first_gap.append(gap[0])
                all_mm.append(statistics.fmean(mm))
                all_gap.append(statistics.fmean(gap))
            print(f"{family:<10} {'on' if replay else 'off':<6} {spread(first_mm):<26} {spread(all_mm):<26} "
                  f"{spread(first_gap):<28} {spread(all_gap):<28}", flush=True)


if __name__ == "__main__":
    main()
