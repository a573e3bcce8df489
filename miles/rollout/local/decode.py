"""The batched KV-cache decode loop of miles' local engine, laid out for a static cache and CUDA graphs.

Everything a decode step touches is allocated once per call, on the device, at its final shape:
the (B, P + T) attention mask (a cache-position column is written per step), the (B, T) token and
log-prob buffers, the per-row stop state, and the (B, T) uniforms that drive sampling. The cache
comes from a factory (`dynamic`: transformers' DynamicCache, grown per step; `static`: a
StaticCache of length P + T, whose step shapes never change). The loop asks the device whether
every row is done only every `stop_check_every` steps (one host sync per check), so on a GPU the
steps in between queue without waiting.

Shapes: B prompts, P the longest prompt (left-padded), T = max new tokens, V the vocabulary.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache, StaticCache

from miles.bridge import routing
from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput
from miles.rollout.sampling import sample_tokens

CACHES = ("dynamic", "static")


def make_cache(kind: str, config, max_len: int):
    if kind == "static":
        return StaticCache(config=config, max_cache_len=max_len)
    return DynamicCache(config=config)


class CachedForward:
    """One forward of a causal LM through a KV cache, in whichever keywords this transformers
    version speaks: 5.2x renamed `past_key_values` to `cache` and dropped `cache_position` (the
    cache tracks its own length). Shared by this decode loop and `miles serve`'s scheduler."""

    def __init__(self, model):
        self.model = model
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._takes_cache_position = "cache_position" in inspect.signature(model.base_model.forward).parameters

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, cache, **kw) -> torch.Tensor:
        """Logits (B, K, V) of the positions the model keeps (all, or the last `logits_to_keep`)."""
        if self._takes_cache_position:
            kw["cache_position"] = cache_position
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kwarg: cache}, **kw)
        return out.logits


class Decoder:
    """Runs the loop for one engine's model; `cache` picks the cache factory (CACHES)."""

    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, cache: str = "dynamic",
                 stop_check_every: int = 1):
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}; one of {CACHES}")
        self.model = model
        self.cache = cache
        self.pad_token_id = pad_token_id
        self.stop_check_every = stop_check_every
        self.device = next(model.parameters()).device
        self.eos = torch.tensor(eos_token_ids, device=self.device)
        self.forward = CachedForward(model)
        self.moe = bool(routing.routers(model))  # an MoE model: every output carries its routes

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], sampling: SamplingParams, uniforms: torch.Tensor,
               progress: Callable[[int], None] | None = None, limits: list[int] | None = None,
               weight_version: int | None = None) -> list[GenerationOutput]:
        """uniforms (B, T) drive the sampling; row i makes at most limits[i] new tokens (default T).
        An MoE model's outputs carry `routed_experts`: the experts each layer chose for every token the
        model was fed (the prompt, then each response token but the last), (tokens, layers, k) int16."""
        if not self.moe:
            return self._decode(prompts, sampling, uniforms, progress, limits, weight_version)
        with routing.record_routes(self.model) as calls:
            outputs = self._decode(prompts, sampling, uniforms, progress, limits, weight_version)
        width = max(len(p) for p in prompts)
        prefill = [layer.view(len(prompts), width, -1) for layer in calls[0]]  # per layer (B, P, k)
        for i, (p, out) in enumerate(zip(prompts, outputs)):
            fed = [torch.stack([layer[i, width - len(p):] for layer in prefill], dim=1)]  # (len(p), layers, k)
            fed += [torch.stack([layer[i] for layer in calls[t + 1]], dim=0)[None]
                    for t in range(len(out.token_ids) - 1)]
            out.routed_experts = torch.cat(fed).to(torch.int16).cpu().numpy()
        return outputs

    def _decode(self, prompts: list[list[int]], sampling: SamplingParams, uniforms: torch.Tensor,
                progress: Callable[[int], None] | None, limits: list[int] | None,
                weight_version: int | None) -> list[GenerationOutput]:
        batch, steps = len(prompts), uniforms.shape[1]
        width = max(len(p) for p in prompts)
        total = width + steps
        mask = torch.zeros(batch, total, dtype=torch.long, device=self.device)  # (B, P + T)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):width] = 1
        input_ids = input_ids.to(self.device)
        tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=self.device)  # (B, T)
        log_probs = torch.zeros(batch, steps, dtype=torch.float32, device=self.device)  # (B, T)
        uniforms = uniforms.to(self.device)
        limit = torch.tensor(limits or [steps] * batch, device=self.device)  # (B,)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)  # (B,)
        stop_step = torch.full((batch,), -1, dtype=torch.long, device=self.device)  # (B,) EOS index, -1 none

        cache = make_cache(self.cache, self.model.config, total)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # (B, P)
        logits = self._forward(input_ids, mask, width, positions, torch.arange(width, device=self.device), cache,
                               logits_to_keep=1)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        made = steps
        for t in range(steps):
            tok, logp = sample_tokens(logits, sampling, uniforms[:, t])
            tok = tok.masked_fill(done, self.pad_token_id)
            tokens[:, t] = tok
            log_probs[:, t] = logp
            hit_eos = torch.isin(tok, self.eos) & ~done
            stop_step.masked_fill_(hit_eos, t)
            done |= hit_eos | (limit <= t + 1)
            if progress is not None:
                progress(t + 1)
            if t + 1 == steps or ((t + 1) % self.stop_check_every == 0 and bool(done.all())):
                made = t + 1
                break
            col = width + t  # the cache position of token t
            mask[:, col] = (~done).long()
            column = torch.arange(col, col + 1, device=self.device)
            logits = self._forward(tok[:, None], mask, col + 1, next_pos, column, cache)
            next_pos = next_pos + 1
        return self._collect(tokens[:, :made], log_probs[:, :made], stop_step, limit, weight_version)

    def _forward(self, input_ids, mask, seen: int, position_ids, cache_position, cache, **kw) -> torch.Tensor:
        """Logits (B, V) of the last position; a dynamic cache sees the mask's first `seen` columns,
        a static cache all of them (unwritten slots are 0)."""
        attention_mask = mask if self.cache == "static" else mask[:, :seen]
        return self.forward(input_ids, attention_mask, position_ids, cache_position, cache, **kw)[:, -1]

    @staticmethod
    def _collect(tokens, log_probs, stop_step, limit, weight_version) -> list[GenerationOutput]:
        """Cuts each row after its EOS token (kept: the model must learn to stop) or at its budget."""
        outputs = []
        for tok, logp, stop, lim in zip(tokens.tolist(), log_probs.tolist(), stop_step.tolist(), limit.tolist()):
            end = stop + 1 if stop >= 0 else min(len(tok), lim)
            outputs.append(GenerationOutput(tok[:end], logp[:end], "stop" if stop >= 0 else "length",
                                            weight_version=weight_version))
        return outputs
