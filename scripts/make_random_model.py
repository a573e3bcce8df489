"""Make a randomly initialised copy of an HF model dir: same config and tokenizer, new weights.

Used where the real weights cannot travel (the GPU benchmark machine takes 64 MiB per call; the
demo model is 270 MB in bf16): the shapes, and so the step time, are the real model's.

    python scripts/make_random_model.py SRC_DIR OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="copy config + tokenizer, write no weights")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (args.src / name).is_file():
            shutil.copy(args.src / name, args.out / name)
    if args.config_only:
        return
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.out))
    model.save_pretrained(args.out)
    print(f"wrote a random {model.config.model_type} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters) to {args.out}")


if __name__ == "__main__":
    main()
