"""The `Engine` seam: what the rollout side asks of an inference engine, and what it gets back.

`miles.rollout.local.LocalEngine` (miles' own engine, in process) is the reference
implementation; engines behind HTTP servers (`miles.rollout.remote.RemoteEngine`) implement the
same methods.

Memory: an engine that shares its device with the trainer (colocated) gives the device memory
back while the trainer runs (`release_memory`) and takes it again before the next rollout
(`resume_memory`). Send weights after the resume: LocalEngine and `miles serve` also take them
while released (they are on the device after the resume), SGLang and vLLM servers do not.

Log-probs: an engine reports, for each sampled token, its log-probability under the
temperature-scaled distribution before top-p truncation — the same quantity the trainer
computes (logits / temperature), as in SGLang and slime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miles.bridge.weight_sync import TensorChecksum
from miles.config import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationOutput:
    token_ids: list[int]
    log_probs: list[float]  # one per token in token_ids
    finish_reason: str  # "stop" (sampled an EOS token) or "length" (hit its token budget)
    weight_version: int | None = None  # the engine's weight version when it generated this
    redrawn: int | None = None  # --true-on-policy-mode: tokens re-drawn from the trainer's computation
    routed_experts: Any = None  # MoE: numpy (prompt + response - 1 tokens, layers, k) expert ids; None for dense


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int], *,
                 progress: Callable[[int], None] | None = None) -> list[GenerationOutput]:
        """One response per prompt (token ids); sample i draws from the random stream seeded by
        seeds[i]. `progress(n)` is told the number of decode steps done so far."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int) -> None:
        """Loads these tensors (by parameter name) and tags later outputs with `weight_version`."""
        ...

    def weights_checksum(self) -> dict[str, TensorChecksum]:
        """Per-parameter digests of the weights the engine generates with."""
        ...

    def check_buffers(self) -> list[str]:
        """Problems with the engine's non-parameter buffers (dropped, zeroed, changed); empty when fine."""
        ...

    def release_memory(self) -> None:
        """Gives the engine's accelerator memory back: weights off the device, KV caches freed, the
        allocator's cache returned to the driver. Generation waits (servers) or refuses (LocalEngine)
        until resume_memory. Frees nothing on a CPU, where only that state changes (or, on a vLLM
        without sleep mode, nothing: a logged no-op)."""
        ...

    def resume_memory(self) -> None:
        """Takes the memory again: the weights back on the device, generation possible again."""
        ...
