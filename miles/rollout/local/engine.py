"""miles' own engine, in process: the reference implementation of the `Engine` seam.

The engine owns its own copy of the weights, as a real inference engine does; the trainer
reaches it only through `update_weights` (a `WeightTransport` calls it). Two decode paths:
`fast` (the default: continuous batching over a slot KV cache, packed prefill, CUDA graphs on a
GPU; batching.py and runner.py) for the decoder families the runner knows, and `hf` (the HF
model's forward through its own KV cache, decode.py), the reference, used for other models;
`--true-on-policy-mode` passes a `verifier` (true_on_policy.py) that checks each rollout against the
trainer's own computation. Only this engine takes one: the mode needs the
trainer's kernels in the engine's process.

The fast path's KV cache is sized to the call (slots for every request, as many as fit in
`mem_fraction` of the GPU, less what the process holds already) and kept for the next call.

Colocated with the trainer on one device, the engine gives its memory back between rollouts:
`release_memory` drops the KV cache and CUDA graphs, moves the weights to the CPU and returns the
allocator's cached blocks to the driver; `generate` then refuses until `resume_memory` moves them back.
Weights updated meanwhile are copied into the CPU copy and so reach the device at resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable

import torch

from miles.config import SamplingParams
from miles.bridge.weight_sync import TensorChecksum
from miles.rollout.engine import GenerationOutput
from miles.rollout.local.batching import ContinuousBatcher
from miles.rollout.local.decode import Decoder
from miles.rollout.local.runner import ModelRunner, unsupported_reason
from miles.rollout.sampling import stream_uniforms
from miles.utils import device_memory
from miles.utils.digest import tensor_bytes_sha256
from miles.utils.forward_kernels import engine_forward

logger = logging.getLogger("miles")


def fresh_buffers(model) -> dict[str, torch.Tensor]:
    """The model's buffers as a freshly built module computes them.

    Modules built from the config alone (rotary embeddings) are rebuilt, so a buffer already wrong
    at load time is caught too; other buffers are snapshotted as loaded.
    """
    fresh = {}
    for prefix, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        rebuilt = None
        try:
            rebuilt = dict(type(module)(model.config).named_buffers(recurse=False))
        except Exception:  # not constructible from the config alone: keep the loaded values
            pass
        for name, buf in own.items():
            source = rebuilt.get(name) if rebuilt is not None and name in rebuilt else buf
            fresh[f"{prefix}.{name}" if prefix else name] = source.detach().clone().cpu()
    return fresh


DECODERS = ("fast", "hf")
DEFAULT_MEM_FRACTION = 0.9  # of the GPU, for the weights and the KV cache (SGLang's static share)
CPU_KV_SHARE = 0.25  # of the host's memory, for the KV cache on a CPU
PREFILL_TOKENS = {"cuda": 16384, "cpu": 4096}  # packed prompt tokens per prefill forward


class LocalEngine:
    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, autocast=contextlib.nullcontext,
                 verifier=None, decoder: str = "fast", cache: str = "dynamic", cuda_graphs: bool = True,
                 compile: bool = False, mem_fraction: float | None = None, weight_version: int = 0):
        """`decoder`: fast | hf (DECODERS; fast falls back to hf for a model it cannot run);
        `cache`: the hf path's cache (decode.CACHES); `cuda_graphs`: the fast path's capture on a GPU
        (an `autocast` context must then not cache its casts: the graphs replay them); `compile`: the
        fast path's layer functions and its sampler through torch.compile; `mem_fraction`: the GPU share
        for weights and KV cache (default DEFAULT_MEM_FRACTION)."""
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r}; one of {DECODERS}")
        self.model = model.eval()
        self.autocast = autocast  # a context factory: the trainer's autocast in true on-policy mode
        self.verifier = verifier  # --true-on-policy-mode: a TrainerComputationVerifier
        self.weight_version = weight_version  # optimizer steps behind the weights held now
        self.eos_token_ids = eos_token_ids
        self.device = next(model.parameters()).device
        self.mem_fraction = DEFAULT_MEM_FRACTION if mem_fraction is None else mem_fraction
        # On a GPU, check for finished rows every 16 steps (a host sync each); on the CPU a check is free.
        check_every = 16 if self.device.type == "cuda" else 1
        reason = unsupported_reason(model) if decoder == "fast" else None
        if reason is not None:
            logger.info("Engine: the fast decode path cannot run this model (%s); decoding with the HF model's "
                        "own KV cache", reason)
        self.runner = None
        if decoder == "fast" and reason is None:
            self.runner = ModelRunner(model, cuda_graphs=cuda_graphs, compile=compile)
            self.decoder = ContinuousBatcher(self.runner, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                             check_every=check_every, max_slots=self._max_slots,
                                             prefill_tokens=PREFILL_TOKENS.get(self.device.type, 4096),
                                             compile_sampler=compile)
        else:
            self.decoder = Decoder(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, cache=cache,
                                   stop_check_every=check_every)
        self._fresh_buffers = fresh_buffers(model)
        self.released = False  # the weights wait on the CPU (release_memory)

    # -- weights: the receiving end of a WeightTransport -------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter named {name!r}")
            params[name].copy_(tensor)  # casts to the engine's dtype and device
        self.weight_version = weight_version

    def weights_checksum(self) -> dict[str, TensorChecksum]:
        return {name: TensorChecksum(str(p.dtype).removeprefix("torch."), tensor_bytes_sha256(p))
                for name, p in self.model.named_parameters()}

    def check_buffers(self) -> list[str]:
        """Each non-parameter buffer (rotary `inv_freq` and the like) dropped, or no longer equal to
        a freshly computed copy."""
        current = dict(self.model.named_buffers())
        problems = []
        for name, fresh in self._fresh_buffers.items():
            buf = current.get(name)
            if buf is None:
                problems.append(f"{name} dropped")
            elif not torch.equal(buf, fresh.to(buf.device, buf.dtype)):
                zeroed = not bool(buf.count_nonzero())
                problems.append(f"{name} {'zeroed' if zeroed else 'changed'} "
                                f"(max |diff| {(buf.float() - fresh.to(buf.device).float()).abs().max().item():.3g})")
        return problems

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _max_slots(self, length: int) -> int:
        """The slots of `length` tokens the KV budget holds: on a GPU mem_fraction of it less what
        the process holds besides the current cache, on a CPU CPU_KV_SHARE of the host's memory."""
        held = self.runner.cache.nbytes() if self.runner.cache is not None else 0
        if self.device.type == "cuda":
            self.runner.prepare_weights()  # its weight copies first: they come out of the same budget
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = self.mem_fraction * total - (torch.cuda.memory_allocated(self.device) - held)
        else:
            budget = CPU_KV_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        slots = int(budget // self.runner.slot_bytes(length))
        if slots < 1:
            raise RuntimeError(f"the engine's KV cache has no room for one sequence of {length} tokens "
                               f"({budget / (1 << 30):.2f} GiB left under mem_fraction {self.mem_fraction:g}); "
                               "raise --sglang-mem-fraction-static or shorten --rollout-max-response-len")
        return slots

    # -- device memory: given back between rollouts when the trainer shares the device --------------

    @torch.no_grad()
    def release_memory(self) -> None:
        """Parameters and buffers to the CPU (the same Parameter objects, so names and ties hold),
        the KV cache and CUDA graphs dropped, the allocator's cached blocks back to the driver; a
        no-op when already released."""
        if self.released:
            return
        before = device_memory.snapshot(self.device)
        if self.runner is not None:
            self.runner.release(weights=True)  # the KV cache, graphs and weight copies; made again at the next rollout
        self.model.to("cpu")
        device_memory.give_back(self.device)
        self.released = True
        logger.info("Engine memory released (weights on the CPU until resume): %s",
                    device_memory.describe(before, device_memory.snapshot(self.device)))

    @torch.no_grad()
    def resume_memory(self) -> None:
        """The weights (as last updated) back on the engine's device; a no-op when not released."""
        if not self.released:
            return
        before = device_memory.snapshot(self.device)
        self.model.to(self.device)
        self.released = False
        logger.info("Engine memory resumed on %s: %s", self.device,
                    device_memory.describe(before, device_memory.snapshot(self.device)))

    # -- generation --------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int], *,
                 progress: Callable[[int], None] | None = None) -> list[GenerationOutput]:
        # Sample i's k-th token uses the k-th number of its stream, whatever else is decoded.
        uniforms = stream_uniforms(seeds, sampling.max_new_tokens)  # (B, T)
        with self.autocast():
            outputs = self.decode(prompts, sampling, uniforms, progress)
            if self.verifier is not None:
                outputs = self.verifier.verify(self, prompts, outputs, sampling, uniforms)
        return outputs

    def decode(self, prompts: list[list[int]], sampling: SamplingParams, uniforms: torch.Tensor,
               progress: Callable[[int], None] | None = None,
               limits: list[int] | None = None) -> list[GenerationOutput]:
        """The KV-cache decode of `prompts` driven by `uniforms` (B, T); row i makes at most limits[i] tokens."""
        if self.released:
            raise RuntimeError("the engine's memory is released (release_memory): call resume_memory first")
        with engine_forward():  # under --deterministic-mode: the kernels a forward needs, not the backward's
            return self.decoder.decode(prompts, sampling, uniforms, progress, limits, self.weight_version)
