"""vLLM 0.32 reloads a tied `lm_head` wrong: its layerwise `reload_weights` gives `embed_tokens` a
new tensor while the tied `lm_head` keeps the old one, so every logit after a weight sync comes
from the initial output layer (found by the weight probe: 1e-2 log-prob gaps on the demo model
after one step; loading only `embed_tokens` reproduces it, every other tensor reloads exactly).

The workaround is to hand vLLM an untied model: a copy of the checkpoint with `lm_head.weight`
written out and `tie_word_embeddings: false`, and weight syncs that write both tensors
(`DiskTransport(untie=True)`). The values are the trainer's tied ones; only vLLM's bookkeeping
changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def is_tied(model_dir: str | Path) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_dir), "tie_word_embeddings", False))


def untied_copy(model_dir: str | Path, target: str | Path) -> Path:
    """`model_dir` with an explicit lm_head and an untied config, written once to `target`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(model_dir), Path(target)
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    tensors = {}
    for f in sorted(source.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    if HEAD not in tensors:
        tensors[HEAD] = tensors[EMBED].clone()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
