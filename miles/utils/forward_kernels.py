"""Kernels under --deterministic-mode: the engine's forward without the mode's slow kernels it does
not need, and the trainer's forward/backward with FlashAttention's deterministic backward.

The mode (miles.debug.determinism) makes the whole process take deterministic kernels, for the
trainer's backward: `torch.use_deterministic_algorithms` turns every indexed write into a
sort-based kernel (so that writes to one element land in the same order each run) and SDPA runs
its math kernel (the flash and memory-efficient backwards accumulate with atomics). The engine's
decode needs neither, and `engine_forward()` lifts both while it runs:
  - its indexed writes never have two writes to one kept element: a KV-cache column per slot and
    position, a token per request and step; the finished rows' writes meet only in the absorbing
    row and column the decode loop never reads. So the plain kernel leaves the same kept values
    every run.
  - it runs no backward, and every fused SDPA forward (flash, memory-efficient, cuDNN; torch's
    `varlen_attn` runs flash or cuDNN) is deterministic: only their backwards accumulate with
    atomics (PyTorch's notes on randomness).

The switches are process-wide, so they are lifted only on the main thread: with --async the
engine decodes in a thread while the trainer's backward runs on the main one, and there the
engine keeps the mode's kernels.

The trainer needs a deterministic backward, which the mode's math SDPA kernel gives at a price
(it materialises every (L, L) score matrix). FlashAttention's backward is deterministic too when
torch's deterministic algorithms are strict (warn_only=False; it accumulates dQ with atomics
otherwise). The mode cannot be strict process-wide: the sampler's float cumsum on CUDA has no
deterministic kernel and would raise. `strict_backward()` makes it strict for the trainer's
forward and backward alone, and lets SDPA take flash there (math where flash cannot run: fp32,
masks); memory-efficient and cuDNN SDPA stay off (their backwards are never deterministic). Packed
sequences take torch's `varlen_attn` there (miles.utils.varlen, which reads `strict()`): its
FlashAttention backward is deterministic when strict too. The trainer enters it only where no engine
samples in the process at the same time (not with --async), for its forward/backward and for its
scoring forwards, which so compute what the training forward recomputes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


_strict = False  # inside strict_backward(): a module global, which compiled code reads without a graph break


def strict() -> bool:
    """Whether this is inside strict_backward() under the mode (the trainer's passes, strict). A plain
    global where torch.is_deterministic_algorithms_warn_only_enabled() would break a compiled graph."""
    return _strict


def lifted() -> bool:
    """Whether engine_forward() lifts the mode's switches here (the mode is on, on the main thread)."""
    return torch.are_deterministic_algorithms_enabled() and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def engine_forward() -> Iterator[None]:
    if not lifted():
        yield
        return
    with _switched(False, warn_only=False, backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                     SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
        yield


@contextlib.contextmanager
def strict_backward() -> Iterator[None]:
    """The trainer's passes under --deterministic-mode: strict deterministic algorithms and SDPA's flash
    kernel (its deterministic backward) or math; nothing changes outside the mode."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()):
        yield
        return
    global _strict
    with _switched(True, warn_only=False, backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        _strict = True
        try:
            yield
        finally:
            _strict = False


@contextlib.contextmanager
def _switched(enabled: bool, *, warn_only: bool, backends: list[SDPBackend]) -> Iterator[None]:
    """torch's deterministic algorithms set to (enabled, warn_only) and SDPA limited to `backends`
    for the duration; the mode's own setting (on, with its warn_only) is put back after."""
    mode_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        with sdpa_kernel(backends):
            yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=mode_warn_only)
