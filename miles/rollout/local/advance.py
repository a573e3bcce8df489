"""The decode loop's per-step bookkeeping on a GPU: one Triton kernel for what batching._Call._advance does after a
step's draw.

In torch ops that is about twenty kernels a step, each over a handful of slots in one block (the masks, two `where`s,
the two result scatters, `isin` against the EOS ids, the state updates, the budget gather): on an H100 under Nsight
Compute, 24 kernels of 2-9 us around the draw of a batch-512 step (all but the uniforms' gather before it are these
updates), each with its launch gap, beside the ~200 of the layers (BENCHMARKS.md). Here the same updates, one program
per BLOCK slots, with the same results: the tokens and log-probs written at (request, column) (free slots and finished
rows at the absorbing row and column), and each slot's made, pos, last, stopped and done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # slots a program


@triton.jit
def _advance(slot_ids, tok, logp, done, req, made, pos, last, stopped, limit, eos, tokens, log_probs, n, n_eos,
             s_tokens, s_log_probs, steps, pad, INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = j < n
    s = tl.load(slot_ids + j, mask=inside, other=0) if INDEXED else j  # the slot of the j-th sampled row
    live = tl.load(done + s, mask=inside, other=1) == 0
    r = tl.load(req + s, mask=inside, other=0)
    m = tl.load(made + s, mask=inside, other=0)
    t = tl.where(live, tl.load(tok + j, mask=inside, other=0), pad)
    col = tl.where(live, m, steps)
    tl.store(tokens + r * s_tokens + col, t, mask=inside)
    tl.store(log_probs + r * s_log_probs + col, tl.load(logp + j, mask=inside, other=0.0), mask=inside)
    hit = j < 0  # all false
    for e in range(n_eos):
        hit = hit | (t == tl.load(eos + e))
    hit = hit & live
    m = m + live.to(m.dtype)
    tl.store(made + s, m, mask=inside)
    tl.store(pos + s, tl.load(pos + s, mask=inside, other=0) + live.to(m.dtype), mask=inside)
    tl.store(last + s, t, mask=inside)
    tl.store(stopped + s, (tl.load(stopped + s, mask=inside, other=0) != 0) | hit, mask=inside)
    tl.store(done + s, (~live) | hit | (m >= tl.load(limit + r, mask=inside, other=0)), mask=inside)


def advance(slots: torch.Tensor | slice, tok: torch.Tensor, logp: torch.Tensor, *, done: torch.Tensor,
            req: torch.Tensor, made: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, stopped: torch.Tensor,
            limit: torch.Tensor, eos: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor, pad: int) -> None:
    """The state updates of `_advance` for the rows drawn as tok, logp (k,): row j is slot slots[j] (an index
    tensor) or j (the slice of the lowest k slots a decode step runs). Per slot (live: not done before): a live row
    writes its token and log-prob at (req, made) of `tokens` / `log_probs` (R + 1, T + 1), the others the pad token at
    (req, T); made and pos grow by one where live; last takes the token; stopped where it is an EOS id; done where
    stopped or made reaches limit[req]. The state tensors are updated in place."""
    k = tok.shape[0]
    if not k:
        return
    indexed = not isinstance(slots, slice)
    ids = slots if indexed else tok  # a pointer the kernel does not read without INDEXED
    eos_ids = eos if eos.numel() else tok  # an empty tensor has no address to pass; n_eos 0 reads none
    _advance[(triton.cdiv(k, BLOCK),)](ids, tok.contiguous(), logp.contiguous(), done, req, made, pos, last, stopped,
                                       limit, eos_ids, tokens, log_probs, k, eos.numel(), tokens.stride(0),
                                       log_probs.stride(0), tokens.shape[1] - 1, pad, INDEXED=indexed, BLOCK=BLOCK)
