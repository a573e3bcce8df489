"""Plant the pipeline-stage numbering bug in a copy of an HF checkpoint dir, for `miles check-weights`.

The copy's layers FIRST..LAST are written one index too high (B's layer k+1 holds A's layer k), as a
second pipeline stage that numbers its layers from the wrong start would write them: layer FIRST
keeps its old tensors (nobody overwrote it) and the old layer LAST+1 is lost. Every other file
(config, tokenizer) is copied as it is; the weights go into one `model.safetensors`.

    python scripts/make_stage_bug.py ~/.cache/miles/models/SmolLM2-135M-Instruct stage_bug  # layers 15..28
    python scripts/make_stage_bug.py SRC_DIR OUT_DIR --first 2 --last 5
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

LAYER_RE = re.compile(r"^(.*?\.layers)\.(\d+)\.(.+)$")


def shifted(tensors: dict, first: int, last: int) -> dict:
    """The tensors with layers first..last stored one index higher, over what was there."""
    out = dict(tensors)
    for name, t in tensors.items():
        m = LAYER_RE.match(name)
        if m and first <= int(m[2]) <= last:
            out[f"{m[1]}.{int(m[2]) + 1}.{m[3]}"] = t.clone()  # layer FIRST keeps its own copy
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--first", type=int, default=15, help="first layer written one too high (default 15)")
    ap.add_argument("--last", type=int, default=28, help="last layer written one too high (default 28)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(args.src.iterdir()):
        if f.name.endswith(".safetensors"):
            tensors.update(load_file(str(f)))
        elif f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy(f, args.out / f.name)
    save_file(shifted(tensors, args.first, args.last), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {args.out}: layers {args.first}..{args.last} of {args.src} one index too high")


if __name__ == "__main__":
    main()
