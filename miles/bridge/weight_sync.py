"""Weight sync, verified: what a sync reports (`SyncStats`), and the comparison of engine and trainer.

A `WeightTransport` (bridge/transports/) moves the tensors and returns `SyncStats`. With
`--check-weight-update-equal`, every engine tensor's digest (`Engine.weights_checksum`) is then
compared with the trainer's tensor cast to the engine's dtype (`verify_digests`); the engine's
buffers are checked after every sync (a dropped rotary buffer garbles every rollout, and the
check is cheap). `log_sync` writes the one `weight_sync` line per sync that users grep for.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("miles")


@dataclass(frozen=True)
class TensorChecksum:
    """One tensor as a side holds it: its dtype and the sha256 of its raw bytes in that dtype."""

    dtype: str  # torch dtype name without the `torch.` prefix, e.g. "bfloat16"
    sha256: str


@dataclass(frozen=True)
class SentTensor:
    """One trainer tensor as the engine should hold it (for the comparison and --debug-weight-sync 2)."""

    shape: list[int]
    dtype: str  # the trainer's dtype
    bytes: int
    sha256: str  # of the tensor cast to the engine's dtype


@dataclass
class SyncStats:
    step: int
    tensors: int
    bytes: int
    seconds: float
    checksum: str | None = None  # digest over every tensor sent, as the engine should store it
    checksum_ok: bool | None = None  # None when not checked
    mismatched: list[str] = field(default_factory=list)  # engine tensors whose digest differs
    buffer_problems: list[str] = field(default_factory=list)  # engine buffers dropped or changed
    per_tensor: list[str] = field(default_factory=list)  # --debug-weight-sync 2: one line per tensor
    probe_max_diff: float | None = None  # the behavioural check (weight_probe.py), where digests are not comparable
    engines: int = 1  # servers (or in-process engines) that loaded the weights

    @property
    def failed(self) -> bool:
        return bool(self.mismatched or self.buffer_problems)


def verify_digests(stats: SyncStats, expected: dict[str, SentTensor], engine: dict[str, TensorChecksum] | None,
                   debug_level: int) -> None:
    """Fills in the checksum (always), the comparison with the engine's digests (when `engine` is
    given) and, at debug level 2, one line per tensor."""
    stats.checksum = hashlib.sha256("".join(t.sha256 for t in expected.values()).encode()).hexdigest()[:16]
    if engine is not None:
        stats.mismatched = [name for name, t in expected.items()
                            if name not in engine or engine[name].sha256 != t.sha256]
        stats.checksum_ok = not stats.mismatched
    if debug_level >= 2:
        for name, t in expected.items():
            match = "" if engine is None else f" match={str(name not in stats.mismatched).lower()}"
            stats.per_tensor.append(f"weight_sync tensor {name} shape={t.shape} dtype={t.dtype} bytes={t.bytes} "
                                    f"digest={t.sha256[:16]}{match}")


def log_sync(s: SyncStats) -> None:
    line = (f"weight_sync step={s.step} tensors={s.tensors} bytes={s.bytes} time_ms={s.seconds * 1e3:.1f} "
            f"engines={s.engines}")
    if s.checksum is not None:
        line += f" checksum={s.checksum}"
    if s.probe_max_diff is not None:
        line += f" probe_max_diff={s.probe_max_diff:.2e}"
    if s.checksum_ok is not None:
        line += f" checksum_ok={str(s.checksum_ok).lower()}"
    logger.info(line)
    for tensor_line in s.per_tensor:
        logger.info(tensor_line)
    if s.mismatched:
        shown = ", ".join(s.mismatched[:8]) + (f" (+{len(s.mismatched) - 8} more)" if len(s.mismatched) > 8 else "")
        logger.error("weight_sync check FAIL at step %d: %d engine tensor(s) differ from the trainer's after sync: %s "
                     "| likely culprit: weight-sync or parameter-mapping bug | fix: compare with `miles check-weights`",
                     s.step, len(s.mismatched), shown)
    if s.buffer_problems:
        logger.error("weight_sync buffer check FAIL at step %d: %s | likely culprit: the engine dropped or "
                     "overwrote buffers while updating weights | fix: re-create the buffers after each weight "
                     "update", s.step, "; ".join(s.buffer_problems))
