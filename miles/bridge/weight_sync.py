"""Trainer -> engine weight sync: the interface, the transfer, and its verification.

An engine is a `WeightReceiver`: anything with `update_weights(named_tensors)`. miles' local
engine copies the tensors in process; a remote engine (SGLang's `/update_weights_from_disk`, or
a broadcast group) implements the same method. Engines that can also report per-tensor digests
(`weights_checksum`, `GET /weights_checksum` over HTTP) and check their buffers (`check_buffers`)
can be verified after each sync (`--check-weight-update-equal`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from miles.utils.digest import tensor_digest

logger = logging.getLogger("miles")


class WeightReceiver(Protocol):
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@dataclass
class SyncStats:
    step: int
    tensors: int
    bytes: int
    seconds: float
    checksum: str | None = None  # digest over every tensor sent, as the engine stores it
    checksum_ok: bool | None = None  # None when not checked
    mismatched: list[str] = field(default_factory=list)  # engine tensors whose digest differs
    buffer_problems: list[str] = field(default_factory=list)  # engine buffers dropped or changed


def sync_weights(model: torch.nn.Module, receiver: WeightReceiver, step: int, *, verify: bool = False,
                 debug_level: int = 0) -> SyncStats:
    """Sends every parameter of `model` to `receiver` and logs one `weight_sync` line.

    With `verify`, the engine's per-tensor digests are compared with the trainer's (cast to the
    engine's dtype) and its buffers are checked. `debug_level` 1 adds a checksum of the whole
    set to the line; 2 also logs one line per tensor.
    """
    start = time.perf_counter()
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    receiver.update_weights(named)
    if named and named[0][1].is_cuda:
        torch.cuda.synchronize()
    stats = SyncStats(step, len(named), sum(t.numel() * t.element_size() for _, t in named),
                      time.perf_counter() - start)

    if verify or debug_level:
        dtype = getattr(receiver, "weight_dtype", None)
        expected = {name: tensor_digest(t.to(dtype) if dtype is not None else t) for name, t in named}
        stats.checksum = hashlib.sha256("".join(expected.values()).encode()).hexdigest()[:16]
        actual = receiver.weights_checksum() if verify else {}
        if verify:
            stats.mismatched = [name for name, digest in expected.items() if actual.get(name) != digest]
            stats.checksum_ok = not stats.mismatched
        if debug_level >= 2:
            for name, t in named:
                match = "" if not verify else f" match={str(actual.get(name) == expected[name]).lower()}"
                logger.info("weight_sync tensor %s shape=%s dtype=%s bytes=%d digest=%s%s", name, list(t.shape),
                            str(t.dtype).removeprefix("torch."), t.numel() * t.element_size(), expected[name][:16],
                            match)
    if hasattr(receiver, "check_buffers"):  # cheap, so always: a dropped rotary buffer garbles every rollout
        stats.buffer_problems = receiver.check_buffers()
    log_sync(stats)
    return stats


def log_sync(s: SyncStats) -> None:
    line = f"weight_sync step={s.step} tensors={s.tensors} bytes={s.bytes} time_ms={s.seconds * 1e3:.1f}"
    if s.checksum is not None:
        line += f" checksum={s.checksum}"
    if s.checksum_ok is not None:
        line += f" checksum_ok={str(s.checksum_ok).lower()}"
    logger.info(line)
    if s.mismatched:
        shown = ", ".join(s.mismatched[:8]) + (f" (+{len(s.mismatched) - 8} more)" if len(s.mismatched) > 8 else "")
        logger.error("weight_sync check FAIL at step %d: %d engine tensor(s) differ from the trainer's after sync: %s "
                     "| likely culprit: weight-sync or parameter-mapping bug | fix: compare with `miles check-weights`",
                     s.step, len(s.mismatched), shown)
    if s.buffer_problems:
        logger.error("weight_sync buffer check FAIL at step %d: %s | likely culprit: the engine dropped or "
                     "overwrote buffers while updating weights | fix: re-create the buffers after each weight "
                     "update", s.step, "; ".join(s.buffer_problems))
