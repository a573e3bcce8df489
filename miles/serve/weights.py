"""`/update_weights_from_disk`: a safetensors checkpoint in HF layout, read and checked against the
engine's parameters before anything is copied, so a bad path or a mismatched tensor leaves the
served weights exactly as they were.

Checked: the path holds safetensors files (`model.safetensors`, or the shards an index names);
every tensor names a parameter of the model (or a tied alias such as `lm_head.weight` of a model
that ties it to the embeddings, or a buffer, which is skipped); every parameter is present, with
the model's shape, a floating dtype and finite values. The tensors come back by parameter name,
for `LocalEngine.update_weights` (which casts them to the engine's dtype).

A checkpoint in the model's original layout rather than its in-memory one (transformers 5 fuses
MoE experts in memory, `experts.gate_up_proj`, and `save_pretrained` writes them back per expert,
`experts.0.w1.weight`) is loaded through the model class's own `from_pretrained` on the CPU, which
converts it, and then checked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.utils.safetensors_files import safetensors_files

import torch


class WeightLoadError(ValueError):
    """The checkpoint cannot replace the served weights; the message says why."""


@dataclass(frozen=True)
class ParameterSpecs:
    """The names and shapes a checkpoint must match, taken from the model once at start-up."""

    shapes: dict[str, tuple[int, ...]]  # parameter name (as named_parameters gives it) -> shape
    aliases: dict[str, str]  # a tied parameter's other names -> its name in `shapes`
    buffers: frozenset[str]  # non-parameter state a checkpoint may carry; skipped
    model_class: type | None = None  # an MoE model's class: converts a checkpoint in its saved layout

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParameterSpecs:
        shapes, aliases, seen = {}, {}, {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                aliases[name] = seen[id(p)]
            else:
                seen[id(p)] = name
                shapes[name] = tuple(p.shape)
        from miles.bridge.routing import family_of

        # Only the MoE families are saved in another layout than they hold (their experts fused in memory).
        converter = type(model) if family_of(model) is not None else None
        return cls(shapes, aliases, frozenset(name for name, _ in model.named_buffers()), converter)


def checkpoint_files(model_path: str) -> list[Path]:
    """The safetensors files of a checkpoint dir (or a single file)."""
    try:
        return safetensors_files(model_path)
    except ValueError as e:
        raise WeightLoadError(f"model_path {e}") from None


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_checked(model_path: str, specs: ParameterSpecs) -> dict[str, torch.Tensor]:
    """Every parameter's new tensor, by parameter name; WeightLoadError if the checkpoint does not fit."""
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_path):
        try:
            loaded.update(load_file(str(f)))
        except Exception as e:  # a truncated or foreign file: say which, not a Rust traceback
            raise WeightLoadError(f"cannot read {f}: {e}") from None
    if specs.model_class is not None and _foreign_names(loaded, specs):
        loaded = _converted(model_path, specs.model_class)
    tensors: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in loaded.items():
        canonical = specs.aliases.get(name, name)
        if canonical not in specs.shapes:
            if name not in specs.buffers:
                unknown.append(name)
            continue
        if canonical in tensors and not torch.equal(tensors[canonical], t):
            raise WeightLoadError(f"{name} and {canonical} are tied in the model but differ in {model_path}")
        tensors[canonical] = t
    if unknown:
        raise WeightLoadError(f"{model_path} holds {len(unknown)} tensor(s) the model does not have: "
                              f"{_listed(unknown)}")
    missing = [n for n in specs.shapes if n not in tensors]
    if missing:
        raise WeightLoadError(f"{model_path} lacks {len(missing)} of the model's parameters: {_listed(missing)}")
    for name, t in tensors.items():
        if tuple(t.shape) != specs.shapes[name]:
            raise WeightLoadError(f"{name}: shape {list(t.shape)} in {model_path}, the model's is "
                                  f"{list(specs.shapes[name])}")
        if not t.is_floating_point():
            raise WeightLoadError(f"{name}: dtype {t.dtype} in {model_path} is not a floating dtype")
        if not bool(torch.isfinite(t).all()):
            raise WeightLoadError(f"{name} holds non-finite values (NaN or Inf) in {model_path}")
    return tensors


def _foreign_names(loaded: dict[str, torch.Tensor], specs: ParameterSpecs) -> bool:
    return any(specs.aliases.get(n, n) not in specs.shapes and n not in specs.buffers for n in loaded)


def _converted(model_path: str, model_class: type) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's in-memory names, as `from_pretrained` converts them."""
    import logging

    try:
        model, info = model_class.from_pretrained(model_path, dtype="auto", device_map="cpu", output_loading_info=True)
    except Exception as e:  # a checkpoint of another architecture: say so, as the name check would
        first = (str(e).strip().splitlines() or [""])[0][:200]  # transformers' conversion errors run for pages
        raise WeightLoadError(f"{model_path} does not load as {model_class.__name__}: {type(e).__name__}: {first}") \
            from None
    # from_pretrained fills a missing tensor with a fresh init: that is a checkpoint that does not fit
    for kind, what in (("missing_keys", "lacks"), ("unexpected_keys", "holds tensors the model does not have:")):
        if info.get(kind):
            raise WeightLoadError(f"{model_path} {what} {_listed(sorted(info[kind]))}")
    logging.getLogger("miles").info("%s: converted from its saved layout by %s.from_pretrained", model_path,
                                    model_class.__name__)
    return {name: p.detach() for name, p in model.named_parameters()}
