"""The run's outputs: `train.log` (also on stdout) and `metrics.jsonl` (+ TensorBoard, W&B)."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

from miles.utils.jsonl import JsonlAppender

logger = logging.getLogger("miles")


def setup_logging(output_dir: Path) -> None:
    """Sends the `miles` logger to OUTPUT_DIR/train.log and stdout, same lines in both."""
    output_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in (_LogFileHandler(output_dir / "train.log"), _StdoutHandler()):
        handler.setFormatter(fmt)
        logger.addHandler(handler)


class _LogFileHandler(logging.FileHandler):
    """train.log; a line that cannot be written (the disk is full) is dropped without a traceback:
    the error that stops the run reaches stderr anyway."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)


class _StdoutHandler(logging.StreamHandler):
    """stdout, until its reader goes away (`miles train | head`): then train.log alone, no tracebacks."""

    def __init__(self):
        super().__init__(sys.stdout)
        self.closed_pipe = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.closed_pipe:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            self.closed_pipe = True
            return
        super().handleError(record)


def close_logging() -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)


class MetricsWriter:
    """One JSON object per step in metrics.jsonl, flushed at once; optional TB / W&B sinks."""

    def __init__(self, output_dir: Path, *, tensorboard: bool, wandb_project: str | None,
                 wandb_group: str | None, config: dict):
        self._file = JsonlAppender(output_dir / "metrics.jsonl")
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(output_dir / "tensorboard"))
        if wandb_project is not None:
            self._wandb = _init_wandb(output_dir, project=wandb_project, group=wandb_group, config=config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(row)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _init_wandb(output_dir: Path, **kwargs):
    """A W&B run; without credentials (no `wandb login`, no WANDB_API_KEY) an offline one, said so in the log."""
    import wandb

    kwargs.update(dir=str(output_dir), name=output_dir.name)
    try:
        return wandb.init(**kwargs)
    except wandb.errors.UsageError as e:  # "No API key configured": the only error an offline run avoids
        reason = str(e).strip().splitlines()[0]
        logger.warning("--use-wandb: %s; logging offline to %s instead (upload later with `wandb sync %s`)",
                       reason, output_dir / "wandb", output_dir / "wandb")
        return wandb.init(mode="offline", **kwargs)


def _json_number(value: float):
    # JSON has no NaN/Inf; write them as strings users (and `miles doctor`) can still read.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
