"""Determinism for bisecting: `--deterministic-mode` and the per-step hashes of `--debug-determinism`.

`hashes.jsonl` holds, per step, one digest per component in data-flow order (COMPONENTS), so
`miles diff-runs` can say where two runs first part: the prompts, the sampled tokens, the engine's
log-probs, the rewards, the trainer's log-probs, the loss, the gradients, or the parameters.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.utils.deterministic

from miles.bridge.types import Sample
from miles.debug.diff_runs import COMPONENTS  # data-flow order: the first to differ is where runs part
from miles.utils.digest import bytes_digest16
from miles.utils.jsonl import JsonlAppender

logger = logging.getLogger("miles")


@dataclass(frozen=True)
class Part:
    """One switch of --deterministic-mode: `enable` sets it and says what it set (for the log)."""
    name: str
    enable: Callable[[], str]
    cuda_sdpa_only: bool = False  # only on CUDA with --attention-backend sdpa


def _cublas_workspace() -> str:
    """CUBLAS_WORKSPACE_CONFIG=:4096:8, which torch's strict deterministic algorithms (the trainer's
    forward/backward, miles.utils.forward_kernels.strict_backward) require before they run cuBLAS.

    torch checks the variable once, at its first GEMM. But while it is set, torch parses it again (a
    regular expression) for the workspace size at every GEMM: 45-160 us more host time a call, which on a
    launch-bound trainer was most of the mode's cost (benchmarks/cublas_env.py, BENCHMARKS.md). cuBLAS
    repeats bitwise on one stream; the variable is for streams that share cuBLAS' own workspace (cuBLAS
    documentation, "Results reproducibility"), and torch gives every (handle, stream) a workspace of its
    own. So on CUDA the mode sets the variable for torch's check, runs one GEMM, and removes it again:
    torch's workspaces keep their default size and its GEMMs their speed. A variable the user set is
    kept, and with it the size it gives."""
    if not torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}"
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        return (f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']} (yours, kept: torch parses it again "
                f"at every GEMM, 45-160 us of host time a call; unset it to let the mode set it for torch's "
                f"check only)")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    one = torch.ones(1, 1, device="cuda")
    torch.mm(one, one)  # torch's check of the variable, cached from here on
    torch.cuda.synchronize()
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    return "CUBLAS_WORKSPACE_CONFIG=:4096:8 for torch's check at its first GEMM, then removed (default workspaces)"


def _algorithms() -> str:
    torch.use_deterministic_algorithms(True, warn_only=True)
    # The mode's NaN fill of every torch.empty is a debugging aid (reads of uninitialised memory become
    # visible), not a source of determinism: a program that never reads such memory repeats without it,
    # and the fill costs a kernel and a full write per allocation.
    torch.utils.deterministic.fill_uninitialized_memory = False
    return "torch.use_deterministic_algorithms(True) (warn only; uninitialised memory not filled)"


def _cudnn() -> str:
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return "cudnn.deterministic=True, cudnn.benchmark=False"


def _sdpa_math() -> str:
    # Flash and memory-efficient SDPA backwards accumulate with atomics unless torch's deterministic
    # mode is strict (warn_only=False), which this mode cannot be process-wide: float cumsum on CUDA (the
    # sampler's CDF, REINFORCE++'s returns) has no deterministic kernel and would raise. cuDNN SDPA's
    # backward is never deterministic. The math kernel is, forward and backward. Two places leave it
    # (miles.utils.forward_kernels): the engine's decode, which runs forwards only, and the trainer's
    # forward/backward, which runs strict with the flash kernel.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return "SDPA math kernel (flash, memory-efficient and cuDNN SDPA off)"


def _inductor() -> str:
    # --trainer-torch-compile and --enable-torch-compile under the mode. Inductor already honours torch's
    # deterministic algorithms where it generates code (scatters and accumulating index_puts fall back to
    # ATen's deterministic kernels, one reduction configuration instead of several timed ones); its
    # `deterministic` setting also keeps it from choosing anything else by timing on the device, so that
    # every process compiles the same kernels for the same graph. Inductor reads the variable when it is
    # first imported (importing it here would cost every run of the mode a second and a half).
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].deterministic = True
    return "Inductor deterministic (compiled kernels chosen without timing them on the device)"


# In the order they are set (CUBLAS_WORKSPACE_CONFIG first: torch checks it at its first GEMM). Each is measured
# alone by benchmarks/determinism_parts.py.
PARTS = (Part("cublas_workspace", _cublas_workspace), Part("algorithms", _algorithms), Part("cudnn", _cudnn),
         Part("sdpa_math", _sdpa_math, cuda_sdpa_only=True), Part("inductor", _inductor))


def enable_deterministic_mode(seed: int, device: str, attention_backend: str) -> None:
    """Sets every switch that makes a run repeat bitwise, and logs each one."""
    settings = [f"seeds python/numpy/torch={seed}", "per-sample sampling streams from (seed, rollout id, sample index)"]
    settings += [part.enable() for part in PARTS
                 if not part.cuda_sdpa_only or (device == "cuda" and attention_backend == "sdpa")]
    logger.info("--deterministic-mode: %s", "; ".join(settings))
    caveats = []
    if attention_backend == "flash":
        caveats.append("--attention-backend flash: flash-attn's backward is not deterministic (use sdpa or eager)")
    if device == "cpu":
        caveats.append(f"CPU reductions depend on the thread count ({torch.get_num_threads()} now): compare runs "
                       f"made with the same OMP_NUM_THREADS")
    for caveat in caveats:
        logger.warning("--deterministic-mode cannot cover: %s", caveat)


def rollout_hashes(samples: list[Sample]) -> dict[str, str]:
    def pack(fmt: str, values) -> bytes:
        values = list(values)
        return struct.pack(f"<{len(values)}{fmt}", *values)

    hashes = {
        "prompts": bytes_digest16(*(pack("q", s.tokens[: s.prompt_length]) for s in samples)),
        "rollout_tokens": bytes_digest16(*(pack("q", s.response_tokens) for s in samples)),
        "rollout_log_probs": bytes_digest16(*(pack("d", s.rollout_log_probs) for s in samples)),
        "rewards": bytes_digest16(pack("d", (s.reward for s in samples))),
    }
    if any(s.rollout_routed_experts is not None for s in samples):  # MoE: each sample's routes as int16, in order
        hashes["rollout_routes"] = bytes_digest16(*(
            np.ascontiguousarray(s.rollout_routed_experts, dtype="<i2").tobytes()
            if s.rollout_routed_experts is not None else b"" for s in samples))
    return hashes


class HashWriter:
    """Appends one line per step to OUTPUT_DIR/hashes.jsonl and a short line to train.log."""

    def __init__(self, output_dir: Path):
        self._file = JsonlAppender(output_dir / "hashes.jsonl")

    def write(self, step: int, hashes: dict[str, str]) -> None:
        row = {"step": step, **{k: hashes[k] for k in COMPONENTS if k in hashes}}
        self._file.write(row)
        logger.info("determinism step=%d %s", step, " ".join(f"{k}={v[:8]}" for k, v in row.items() if k != "step"))

    def close(self) -> None:
        self._file.close()
