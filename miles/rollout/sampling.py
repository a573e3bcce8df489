"""Sampling one token per row from logits, and the per-sample random streams that drive it.

Sampling is by inverse CDF with one uniform number per row and token, drawn from that sample's
own random stream (seeded by (run seed, rollout id, sample index)): a sample's tokens depend on
its seed and its logits only, never on which other samples share the batch, so a rollout-only
capture equals the live run and a bisect can trust that a changed batch size did not change the
draws.

Without top-p or top-k (what `miles train` samples with) the inverse CDF is searched in two levels
(`_blocked_inverse_cdf`): the mass of each block of 128 tokens is summed in float64, the block
holding u * total is found, and only that block's CDF is built. So the one full-vocabulary copy is
the float32 log-probs; before, float32 and float64 copies of the whole vocabulary were made per
token. The masses are exp of the float32 log-probs, summed in float64: the distribution sampled is
exp(reported log-prob) normalised, to float32 rounding of each token's probability (total variation
~1e-8 at 151,936 tokens), and every token with positive float32 mass can be drawn. A float32 cumsum
over the whole vocabulary (what miles did first) is ~1e-4 off and rounds thousands of tail tokens
to zero-width intervals. With top-p or top-k the truncated distribution is built in float64
(`sampling_cdf`).

On a GPU with Triton the plain path is miles.utils.invariant's draw instead: two kernels, no copy of the
vocabulary (one pass over the logits: each block's max and its mass in fixed point, int64 units of 2^-44 at
151,936 tokens, rounded down, against that max; then per row the blocks brought to the row's max, the block and the
token the uniform falls on). The three-kernel draw before it (a pass for the maxes, another for the masses) took
53 us a call at 128 x 151,936 in a CUDA graph on the H200 against 495 us for the torch path and 138 us compiled. A
token whose probability is below one unit of its block's most likely token's is never drawn (at most ~1e-8 of the
mass at that vocabulary); the log-prob reported is the token's, from the same fixed-point sum.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from miles.config import SamplingParams
from miles.utils import invariant

DEVICE_DRAW = True  # the plain path on a GPU draws with miles.utils.invariant's kernels; False: torch (benchmarks)


def derived_seed(*parts) -> int:
    """A 63-bit seed that is a function of `parts` only (their text, joined): independent streams for
    independent purposes, the same on every machine."""
    digest = hashlib.sha256(":".join(["miles", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_seed(seed: int, rollout_id: int, index: int) -> int:
    """The random stream of one sample: a function of (run seed, rollout id, sample index) only."""
    return derived_seed(seed, rollout_id, index)


def stream_uniforms(seeds: list[int], n: int) -> torch.Tensor:
    """(B, n) float64 uniforms in [0, 1): row i is the first n numbers of the stream seeded by seeds[i]."""
    return torch.stack([torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                        for s in seeds])


def sampling_cdf(log_probs: torch.Tensor, top_p: float, top_k: int | None = None) -> torch.Tensor:
    """(B, V) float64 cumulative mass of the distribution sampled from: exp(log_probs), truncated to
    the top-p nucleus when top_p < 1 and to the k likeliest tokens when top_k is given
    (unnormalised: the last column is the total).

    With both, a token is kept when it is inside both cuts, each measured on the untruncated
    distribution (as SGLang's sampler does: top_p is not re-applied after top_k renormalises).
    """
    probs = log_probs.double().exp()
    truncate_k = top_k is not None and top_k < probs.shape[-1]
    if top_p < 1.0 or truncate_k:
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        if truncate_k:
            outside[..., top_k:] = True
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return probs.cumsum(-1)


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None, *,
                  top_k: int | None = None):
    """Samples one token per row of `logits` (B, V) with one uniform (B,) per row.

    Returns (tokens (B,), log_probs (B,)): the log-probs are float32 under the temperature-scaled
    distribution before top-p and top-k (what the trainer computes); temperature 0 is greedy.
    `top_k` (None: the whole vocabulary) is `miles serve`'s; `miles train` never sets it.
    """
    if sampling.temperature == 0 and invariant.enabled() and logits.is_cuda:  # as the trainer computes it
        tokens = logits.argmax(dim=-1)
        return tokens, invariant.token_log_probs(logits, tokens)[0]
    if sampling.temperature == 0:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        tokens = log_probs.argmax(dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    if _untruncated(sampling, top_k, logits.shape[-1]):
        return _plain_sample(logits, uniforms.to(logits.device, torch.float64), sampling.temperature)
    log_probs = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
    cdf = sampling_cdf(log_probs, sampling.top_p, top_k)
    # The first token whose cumulative mass exceeds u * total: token k with probability p_k / total.
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def compiled_sample_tokens(logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None, *,
                           top_k: int | None = None):
    """`sample_tokens` with the plain path (temperature > 0, no top-p or top-k: what `miles train`
    samples with) through torch.compile: the cast, temperature, logsumexp and the blocked inverse CDF
    run as a few fused kernels that read the logits instead of writing a float32 copy of the whole
    vocabulary and re-reading it pass by pass. The fast path's sampler under --enable-torch-compile.
    Both run `_torch_sample`; Inductor's kernels may round an exp or a sum differently in the last bit, so a draw
    within that of a CDF boundary can differ from the eager path's. On a GPU with Triton both take the device draw
    (`_plain_sample`), which is faster than the compiled one (BENCHMARKS.md)."""
    if sampling.temperature == 0 or not _untruncated(sampling, top_k, logits.shape[-1]) or invariant.enabled() \
            or _device_draw(logits):  # the device draw is faster still
        return sample_tokens(logits, sampling, uniforms, top_k=top_k)
    return _compiled_plain()(logits, uniforms.to(logits.device, torch.float64), sampling.temperature)


def _untruncated(sampling: SamplingParams, top_k: int | None, vocab: int) -> bool:
    """Neither top-p nor top-k cuts the distribution: the plain path samples it."""
    return sampling.top_p >= 1.0 and (top_k is None or top_k >= vocab)


def _plain_sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float):
    """The plain path (temperature > 0, untruncated): a token drawn by inverse CDF, and its log-prob. On a GPU
    with Triton, miles.utils.invariant's draw (also what --true-on-policy-mode needs: one row's draw never depends
    on the others); elsewhere `_torch_sample`."""
    if _device_draw(logits):
        return invariant.sample(logits, uniforms, temperature)
    return _torch_sample(logits, uniforms, temperature)


def _device_draw(logits: torch.Tensor) -> bool:
    """Whether the plain path draws with miles.utils.invariant's kernels: on a GPU under --true-on-policy-mode
    always, else where Triton is (unless DEVICE_DRAW is off)."""
    return logits.is_cuda and (invariant.enabled() or (DEVICE_DRAW and invariant.available()))


def _torch_sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float):
    """float32 log-probs at `temperature`, a token drawn by the blocked inverse CDF, and its log-prob."""
    log_probs = logits.to(torch.float32, copy=True)  # the one full-vocabulary copy (none once compiled)
    if temperature != 1.0:
        log_probs.div_(temperature)
    log_probs.sub_(log_probs.logsumexp(-1, keepdim=True))
    tokens = _blocked_inverse_cdf(log_probs, uniforms)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


@functools.cache
def _compiled_plain():
    return torch.compile(_torch_sample, dynamic=True)


BLOCK = 128


def _blocked_inverse_cdf(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens (B,) drawn from exp(log_probs) (B, V) by inverse CDF with uniforms (B,): the block of
    BLOCK tokens holding u * total, then the token within it. Masses are float32 exp summed in float64."""
    batch, vocab = log_probs.shape
    blocks = -(-vocab // BLOCK)
    if blocks * BLOCK != vocab:  # a padded copy only for vocabularies that are no multiple of BLOCK
        log_probs = torch.nn.functional.pad(log_probs, (0, blocks * BLOCK - vocab), value=float("-inf"))
    grid = log_probs.view(batch, blocks, BLOCK)
    block_cdf = grid.exp().sum(-1, dtype=torch.float64).cumsum(-1)  # (B, blocks)
    target = uniforms[:, None] * block_cdf[:, -1:]  # (B, 1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks - 1)  # (B, 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # mass of earlier blocks
    rows = torch.arange(batch, device=log_probs.device)
    within = grid[rows, block[:, 0]].exp().double().cumsum(-1) + before  # (B, BLOCK)
    offset = torch.searchsorted(within, target, right=True).clamp(max=BLOCK - 1)
    return (block * BLOCK + offset).squeeze(-1).clamp(max=vocab - 1)
