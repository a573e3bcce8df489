"""miles' embedded rollout engine: batched sampling with a KV cache over an HF model's modules.

The engine owns its own copy of the weights, as a real inference engine does; the trainer
reaches it only through `update_weights` (see miles/bridge/weight_sync.py).

Decoding is split into `_prefill` and `_decode_step` over a cache object so a static KV cache
and CUDA-graph capture of the decode step can replace them without touching the loop.

Log-probs: the engine reports, for each sampled token, its log-probability under the
temperature-scaled distribution before top-p truncation — the same quantity the trainer
computes (logits / temperature), as in SGLang and slime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import contextlib
import hashlib
import inspect

import torch
from transformers import DynamicCache

from miles.config import SamplingParams
from miles.utils.digest import tensor_digest


@dataclass
class GenerationOutput:
    token_ids: list[int]
    log_probs: list[float]  # one per token in token_ids
    finish_reason: str  # "stop" (sampled an EOS token) or "length" (hit max_new_tokens)


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None):
    """Samples one token per row of `logits` (B, V); returns (tokens (B,), log_probs (B,)).

    Sampling is by inverse CDF with one uniform number per row, drawn from that sample's own
    random stream: a sample's tokens depend on its seed and its logits only, never on which other
    samples share the batch (so a rollout-only capture equals the live run, and a bisect can
    trust that a changed batch size did not change the draws).
    """
    logits = logits.float()
    if sampling.temperature == 0:
        log_probs = torch.log_softmax(logits, dim=-1)
        tokens = log_probs.argmax(dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    log_probs = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = log_probs.exp()
    if sampling.top_p < 1.0:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    cdf = probs.cumsum(-1)  # (B, V), unnormalised after top-p
    # The first token whose cumulative mass exceeds u * total: token k with probability p_k / total.
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    """The random stream of one sample: a function of (run seed, rollout id, sample index) only."""
    digest = hashlib.sha256(f"miles:{seed}:{rollout_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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


class LocalEngine:
    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, autocast=contextlib.nullcontext):
        self.model = model.eval()
        self.autocast = autocast  # a context factory: the trainer's autocast in true on-policy mode
        self.verifier = None  # set by --true-on-policy-mode (miles/rollout/true_on_policy.py)
        # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this one has.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._fresh_buffers = fresh_buffers(model)
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.weight_dtype = next(model.parameters()).dtype

    # -- weights: the receiving end of the weight-sync interface --------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter named {name!r}")
            params[name].copy_(tensor)  # casts to the engine's dtype and device

    def weights_checksum(self) -> dict[str, str]:
        """Per-tensor digests of the engine's parameters (what `GET /weights_checksum` serves)."""
        return {name: tensor_digest(p) for name, p in self.model.named_parameters()}

    def check_buffers(self) -> list[str]:
        """Problems with the non-parameter buffers (rotary `inv_freq` and the like): each one
        dropped, or no longer equal to a freshly computed copy. Empty when all is well."""
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

    # -- generation ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        on_step: Callable[[int], None] | None = None,
    ) -> list[GenerationOutput]:
        """Generates one response per prompt (token ids), sample i drawing from the random stream
        seeded by seeds[i]. `on_step(n)` is told of each decode step."""
        # Sample i's k-th token uses the k-th number of its stream, whatever else is decoded.
        uniforms = torch.stack([torch.rand(sampling.max_new_tokens, generator=torch.Generator().manual_seed(s),
                                           dtype=torch.float64) for s in seeds])  # (B, T)
        with self.autocast():
            outputs = self.decode(prompts, sampling, uniforms, on_step)
            if self.verifier is not None:
                outputs = self.verifier.verify(self, prompts, outputs, sampling, uniforms)
        return outputs

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], sampling: SamplingParams, uniforms: torch.Tensor,
               on_step: Callable[[int], None] | None = None, limits: list[int] | None = None) -> list[GenerationOutput]:
        """The batched KV-cache decode loop; uniforms (B, T) drive the sampling; row i makes at most
        limits[i] new tokens (default T)."""
        batch = len(prompts)
        input_ids, attention_mask = self._left_pad(prompts)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._prefill(input_ids, attention_mask, position_ids, cache)

        eos = torch.tensor(self.eos_token_ids, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        tokens, log_probs, stopped = [], [], []
        next_pos = position_ids[:, -1:] + 1
        max_new_tokens = uniforms.shape[1]
        limits = limits or [max_new_tokens] * batch
        limit = torch.tensor(limits, device=self.device)
        for step in range(max_new_tokens):
            tok, logp = sample_tokens(logits, sampling, uniforms[:, step])
            tok = tok.masked_fill(done, self.pad_token_id)
            tokens.append(tok)
            log_probs.append(logp)
            hit_eos = torch.isin(tok, eos) & ~done
            stopped.append(hit_eos)
            done |= hit_eos | (limit <= step + 1)
            if on_step is not None:
                on_step(step + 1)
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            attention_mask = torch.cat([attention_mask, (~done)[:, None].long()], dim=-1)
            logits = self._decode_step(tok[:, None], attention_mask, next_pos, cache)
            next_pos = next_pos + 1
        return self._collect(torch.stack(tokens, 1), torch.stack(log_probs, 1), torch.stack(stopped, 1), limits)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _prefill(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1]  # (B, V)

    def _decode_step(self, last_tokens, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=last_tokens, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kwarg: cache})
        return out.logits[:, -1]  # (B, V)

    @staticmethod
    def _collect(tokens: torch.Tensor, log_probs: torch.Tensor, stopped: torch.Tensor,
                 limits: list[int]) -> list[GenerationOutput]:
        """Cuts each row (B, steps) after its EOS token (kept: the model must learn to stop)."""
        outputs = []
        for tok, logp, stop, limit in zip(tokens.tolist(), log_probs.tolist(), stopped.tolist(), limits):
            end = stop.index(True) + 1 if True in stop else min(len(tok), limit)
            outputs.append(GenerationOutput(tok[:end], logp[:end], "stop" if True in stop else "length"))
        return outputs
