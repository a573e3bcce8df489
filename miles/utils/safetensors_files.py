"""The safetensors files behind a weights argument: one file, a dir, or a sharded dir with its index."""

from __future__ import annotations

import json
from pathlib import Path


def safetensors_files(spec: str | Path) -> list[Path]:
    """The files, in a stable order; ValueError with a one-line reason (callers name the argument)."""
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{spec} is not a .safetensors file")
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():  # the index names the shards; stray *.safetensors next to them are not part of it
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e!r})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{spec} has no *.safetensors files")
    return files
