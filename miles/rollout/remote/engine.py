"""`RemoteEngine`: the `Engine` seam over a fleet of inference servers of one backend.

A generation call splits its prompts into contiguous slices, one per server, and each server
works through its slice in chunks of `concurrency` prompts (one batched request for SGLang, that
many concurrent requests for vLLM), all servers at once: at most `concurrency` requests in flight
per server. Outputs come back in prompt order whatever order the servers finish in.

Weights reach the servers from disk (`load_weights_from_disk`, called by `DiskTransport`): every
server loads the same safetensors dir and tags its later outputs with the step.

Memory (colocated with the trainer): `release_memory` / `resume_memory` ask every server, in
URL order: SGLang's `/release_memory_occupation` and `/resume_memory_occupation` (`miles serve`
moves its weights to the CPU and empties the CUDA cache), vLLM's `/sleep?level=1` and
`/wake_up` (a logged no-op on a vLLM without sleep mode, such as its CPU backend). Send weights
after the resume: `miles serve` takes them while released too, SGLang and vLLM do not.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from miles.bridge.weight_sync import TensorChecksum
from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("miles")


class RemoteEngine:
    def __init__(self, servers: list, *, concurrency: int, weight_version: int = 0, untie: bool = False):
        self.servers = servers  # SGLangServer | VLLMServer, one per URL
        self.concurrency = concurrency
        self.weight_version = weight_version
        self.untie = untie  # the servers hold a tied lm_head as its own tensor (untie.py)

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self.servers]

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int], *,
                 progress: Callable[[int], None] | None = None) -> list[GenerationOutput]:
        return asyncio.run(self._generate(prompts, sampling, seeds, progress))

    async def _generate(self, prompts, sampling, seeds, progress) -> list[GenerationOutput]:
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        done = 0
        per = -(-len(prompts) // len(self.servers))  # ceil: server k answers prompts [k*per, (k+1)*per)

        async def work(server, start: int, stop: int) -> None:
            nonlocal done
            async with server.client.session(connections=self.concurrency) as session:
                for lo in range(start, stop, self.concurrency):
                    hi = min(lo + self.concurrency, stop)
                    outputs[lo:hi] = await server.generate(session, prompts[lo:hi], sampling, seeds[lo:hi])
                    done += hi - lo
                    if progress is not None:  # the bar counts decode steps; show the share of samples done
                        progress(sampling.max_new_tokens * done // len(prompts))

        await asyncio.gather(*(work(s, k * per, min((k + 1) * per, len(prompts)))
                               for k, s in enumerate(self.servers) if k * per < len(prompts)))
        return outputs

    def load_weights_from_disk(self, path: str, *, weight_version: int) -> None:
        for server in self.servers:
            server.load_weights(path, weight_version)
        self.weight_version = weight_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: int) -> None:
        """Tensors by name, through a temporary safetensors file the servers load."""
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="miles-weights-") as tmp:
            save_file({name: t.detach().contiguous().cpu() for name, t in named_tensors}, f"{tmp}/model.safetensors")
            self.load_weights_from_disk(tmp, weight_version=weight_version)

    def weights_checksum(self) -> dict[str, TensorChecksum] | None:
        """Server 0's per-tensor digests, a tensor marked as differing where another server's differ;
        None when a server has no meaningful digests (vLLM, SGLang): check behaviourally instead."""
        sums = [s.weights_checksum() for s in self.servers]
        if any(s is None for s in sums):
            return None
        first = sums[0]
        merged = {}
        for name, t in first.items():
            same = all(other.get(name) == t for other in sums[1:])
            merged[name] = TensorChecksum(t["dtype"], t["sha256"] if same else "servers-differ")
        return merged

    def prompt_log_probs(self, tokens: list[int]) -> dict[str, list[float]]:
        """Each server's log p(tokens[i] | tokens[:i]), i >= 1, at temperature 1: the weight probe."""
        return {s.client.url: s.prompt_log_probs(tokens) for s in self.servers}

    def check_buffers(self) -> list[str]:
        return []  # a server's buffers are not visible; the weight probe scores what they compute

    def memory_bytes(self) -> int:
        return 0  # the weights live in the servers' processes

    def release_memory(self) -> None:
        for server in self.servers:
            server.release_memory()
        logger.info("Memory released on %s", ", ".join(self.urls))

    def resume_memory(self) -> None:
        for server in self.servers:
            server.resume_memory()
        logger.info("Memory resumed on %s", ", ".join(self.urls))
