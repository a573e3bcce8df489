"""Step time of a recipe on every device here, side by side (CPU fp32; CUDA fp32 and bf16).

    python benchmarks/step_time.py [--steps 4] [miles train flags...]

Defaults to the demo recipe. Where the demo model's weights cannot be had (the GPU machine),
pass `--hf-checkpoint` a same-shape random model from `scripts/make_random_model.py`.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from common import steady, train

KEYS = ("perf/step_time_s", "perf/rollout_tok_s", "perf/train_tok_s", "perf/weight_sync_s", "forward_logp_max_diff")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    known, extra = ap.parse_known_args()
    setups = [(d, p) for d in known.devices.split(",") for p in (("fp32",) if d == "cpu" else ("fp32", "bf16"))]
    results = {}
    for device, precision in setups:
        with tempfile.TemporaryDirectory() as out:
            rows = train(["--num-rollout", str(known.steps), "--device", device, "--precision", precision,
                          *extra, "--output-dir", out])
        results[f"{device} {precision}"] = {k: steady(rows, k) for k in KEYS}
    print(f"steady steps 2..{known.steps} (step 1 is warm-up); flags: {' '.join(extra) or '(demo recipe)'}")
    print(f"{'':28}" + "".join(f"{name:>14}" for name in results))
    for key in KEYS:
        print(f"{key:28}" + "".join(f"{r[key]:>14.4g}" for r in results.values()))
    base = results.get("cpu fp32")
    if base:
        for name, r in results.items():
            if name != "cpu fp32":
                print(f"{name}: {base['perf/step_time_s'] / r['perf/step_time_s']:.1f}x faster a step than cpu fp32")


if __name__ == "__main__":
    main()
