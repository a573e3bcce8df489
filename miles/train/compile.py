"""--trainer-torch-compile: the trainer's decoder layers through torch.compile.

Each decoder layer is compiled on its own (regional compilation): the layers share one forward, so
one graph serves all of them, and a new packed token count recompiles once and then runs with a
dynamic length. Inductor fuses the elementwise work between the matmuls (RMSNorm, rotary, SiLU,
residual adds on fp32 hidden states under autocast), which is most of an uncompiled step on a GPU
(benchmarks/BENCHMARKS.md). The log-prob chunks are compiled where they run (train/logprobs.py,
`compiled=`). The Trainer applies this after activation checkpointing and before sharding, the
order torchtitan uses.
"""

from __future__ import annotations

import torch

from miles.errors import UsageError
from miles.train.logprobs import causal_lm


def compile_layers(model: torch.nn.Module) -> int:
    """Compiles each layer of the HF causal LM's decoder-layer list in place; returns how many."""
    layers = getattr(causal_lm(model).base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UsageError(f"--trainer-torch-compile: {type(causal_lm(model)).__name__} has no decoder-layer list "
                         "(base_model.layers) to compile; drop the flag")
    for layer in layers:
        layer.compile()
    return len(layers)
