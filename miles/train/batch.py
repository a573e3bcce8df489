"""Samples -> padded tensors for the trainer, and the trainer's log-probs of response tokens
(packed or padded, see `response_log_probs`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from miles.bridge.types import Sample
from miles.train import attention, micro_batches
from miles.train.logprobs import causal_lm, chunked_log_probs, output_head, run_to_hidden

LOG_PROBS_CHUNK_SIZE = 1024  # --log-probs-chunk-size: response tokens per lm_head chunk


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, L)
    response_positions: torch.Tensor  # (B, R) index into the (B, L-1) next-token grid
    mask: torch.Tensor  # (B, R) float, 1 on response tokens that are trained on
    rollout_log_probs: torch.Tensor  # (B, R) the engine's log-probs of the sampled tokens
    rewards: torch.Tensor  # (B,)
    response_lengths: torch.Tensor  # (B,) response tokens of each row (the rest of its R slots is padding)
    has_rollout_log_probs: bool = True  # False for dumps made without engine log-probs
    # MoE: (B, L, layers, k) the engine's expert ids for each token it fed, -1 where it recorded none
    # (padding, a sequence's last token, a sample without routes); None when no sample has routes.
    routes: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_token_id: int, device) -> TrainBatch:
        width = max(len(s.tokens) for s in samples)
        resp = max(max(s.response_length for s in samples), 1)
        b = len(samples)
        input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((b, width), dtype=torch.long)
        positions = torch.zeros((b, resp), dtype=torch.long)
        mask = torch.zeros((b, resp))
        rollout_log_probs = torch.zeros((b, resp))
        for i, s in enumerate(samples):
            n, r = len(s.tokens), s.response_length
            input_ids[i, :n] = torch.tensor(s.tokens)
            attention_mask[i, :n] = 1
            # The token at position p is predicted by the logits at position p - 1.
            positions[i, :r] = torch.arange(s.prompt_length - 1, n - 1)
            mask[i, :r] = torch.tensor(s.loss_mask[:r], dtype=torch.float32)
            if len(s.rollout_log_probs) == r:
                rollout_log_probs[i, :r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        lengths = torch.tensor([s.response_length for s in samples], dtype=torch.long)
        tensors = (input_ids, attention_mask, positions, mask, rollout_log_probs, rewards, lengths)
        has_log_probs = all(len(s.rollout_log_probs) == s.response_length for s in samples)
        return cls(*(t.to(device) for t in tensors), has_rollout_log_probs=has_log_probs,
                   routes=_routes(samples, width, device))

    def rows(self, start: int, end: int) -> TrainBatch:
        """Samples [start, end), trimmed to the longest sequence among them."""
        width = int(self.attention_mask[start:end].sum(-1).max())
        return TrainBatch(self.input_ids[start:end, :width], self.attention_mask[start:end, :width],
                          self.response_positions[start:end].clamp(max=width - 2), self.mask[start:end],
                          self.rollout_log_probs[start:end], self.rewards[start:end],
                          self.response_lengths[start:end], self.has_rollout_log_probs,
                          self.routes[start:end, :width] if self.routes is not None else None)

    def flat_routes(self, *, packed: bool) -> list[torch.Tensor]:
        """Per MoE layer, the (tokens, k) expert ids in the order a forward of this batch flattens its
        tokens for the routers: the real tokens row after row (packed) or the whole padded grid."""
        r = self.routes[self.attention_mask.bool()] if packed else self.routes.reshape(-1, *self.routes.shape[2:])
        return [r[:, i] for i in range(r.shape[1])]


def _routes(samples: list[Sample], width: int, device) -> torch.Tensor | None:
    """The samples' `rollout_routed_experts` on the padded token grid (checked beforehand by
    miles.bridge.routing.check_sample_routes)."""
    given = [s.rollout_routed_experts for s in samples if s.rollout_routed_experts is not None]
    if not given:
        return None
    layers, k = np.asarray(given[0]).shape[1:]
    routes = torch.full((len(samples), width, layers, k), -1, dtype=torch.int64)
    for i, s in enumerate(samples):
        if s.rollout_routed_experts is not None:
            r = torch.as_tensor(np.asarray(s.rollout_routed_experts, dtype=np.int64))
            routes[i, :len(r)] = r[:len(s.tokens)]
    return routes.to(device)


def response_log_probs(model, batch: TrainBatch, temperature: float, *, packed: bool = True,
                       chunk_size: int = LOG_PROBS_CHUNK_SIZE, compiled: bool = False, with_entropy: bool = False,
                       with_logits: bool = False):
    """Log-probs (B, R) of each response token under `model`, at the sampling temperature (0 past
    each row's response).

    `packed` (--qkv-format thd): the rows run as one row of their real tokens, each sequence with its
    own position_ids, attending only within itself (train/attention.py); no padding is computed.
    Otherwise (bshd) the right-padded (B, L) batch runs with its attention mask. Either way only the
    response positions' hidden states go through lm_head, `chunk_size` of them at a time
    (train/logprobs.py; each chunk through torch.compile when `compiled`). The second value is, when
    asked, the entropy (B, R) of the next-token distribution (no gradient), or the raw logits (B, R, V)
    at the response positions.
    """
    if packed:
        attention.use_packed_attention(model)  # idempotent; every packed scoring of a model uses the same kernel
    hidden, flat_ids, index = (_packed_forward if packed else _padded_forward)(model, batch)
    valid = torch.arange(index.shape[1], device=index.device) < batch.response_lengths[:, None]  # (B, R)
    rows = index[valid]  # (N,) positions in the flat token grid whose next token is scored
    log_probs, entropy, logits = chunked_log_probs(output_head(model), hidden[rows], flat_ids[rows + 1], temperature,
                                                   chunk_size=chunk_size, with_entropy=with_entropy,
                                                   with_logits=with_logits, compiled=compiled)
    zeros = torch.zeros(valid.shape, device=valid.device)
    log_probs = zeros.masked_scatter(valid, log_probs)
    if with_logits:
        full = logits.new_zeros((*valid.shape, logits.shape[-1]))
        full[valid] = logits
        return log_probs, full
    return log_probs, (zeros.masked_scatter(valid, entropy) if with_entropy else None)


def _padded_forward(model, batch: TrainBatch):
    """Hidden states (B * L, H) of the padded batch, its token ids (B * L,), and each response
    position's flat index (B, R)."""
    b, width = batch.input_ids.shape
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = run_to_hidden(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=position_ids)
    index = torch.arange(b, device=hidden.device)[:, None] * width + batch.response_positions
    return hidden.reshape(b * width, -1), batch.input_ids.reshape(-1), index


def _packed_forward(model, batch: TrainBatch):
    """Hidden states (T, H) of the rows' real tokens run as one packed row, their ids (T,), and each
    response position's index into them (B, R)."""
    real = batch.attention_mask.bool()
    lengths = batch.attention_mask.sum(-1)
    cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (B + 1,) where each sequence starts
    input_ids = batch.input_ids[real][None]  # (1, T)
    position_ids = (batch.attention_mask.cumsum(-1) - 1)[real][None]  # restarts at 0 for each sequence
    if causal_lm(model).config._attn_implementation == attention.NAME:
        # The varlen kernel keeps the sequences apart; an all-ones mask tells transformers not to build a
        # (T, T) block mask from the position_ids that nothing would read.
        max_len = int(lengths.max())
        inputs = dict(attention_mask=torch.ones_like(input_ids), cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens,
                      max_length_q=max_len, max_length_k=max_len)
    else:  # transformers finds the sequences from the position_ids (block mask for eager, varlen for flash)
        inputs = dict(attention_mask=None)
    hidden = run_to_hidden(model, input_ids=input_ids, position_ids=position_ids, **inputs)
    index = cu_seq_lens[:-1, None].long() + batch.response_positions
    return hidden[0], input_ids[0], index


# on_logits(start, stop, logits): one micro-batch's raw logits (stop - start, R, V) at the response positions
LogitsSink = Callable[[int, int, torch.Tensor], None]


@torch.no_grad()
def score_rollout(model, batch: TrainBatch, micro_batch_size: int, temperature: float, autocast,
                  with_logits: bool = False, *, packed: bool = True, chunk_size: int = LOG_PROBS_CHUNK_SIZE,
                  compiled: bool = False,
                  around: Callable[[TrainBatch], contextlib.AbstractContextManager] | None = None,
                  bounds: list[tuple[int, int]] | None = None, on_logits: LogitsSink | None = None):
    """The trainer's scoring pass: response log-probs (B, R), micro-batch by micro-batch (rows
    [start, stop) of `bounds`, or `micro_batch_size` rows each); each micro-batch's forward runs
    inside `around(micro_batch)` when given (MoE routes: the trainer's). The second value: the logits
    (B, R, V) with `with_logits`; with `on_logits` each micro-batch's go to it instead and are not kept
    (a rollout's B x R x V would not fit at scale), and it is None.

    `--true-on-policy-mode` runs this very function in the engine too (`score_sequences`), on the
    same batch layout, so that both sides compute the same numbers with the same kernels, shapes
    and order.
    """
    log_probs, logits = [], []
    for start, stop in bounds or micro_batches.fixed(0, batch.rewards.numel(), micro_batch_size):
        mb = batch.rows(start, stop)
        with autocast(), (around(mb) if around is not None else contextlib.nullcontext()):
            lp, rows = response_log_probs(model, mb, temperature, packed=packed, chunk_size=chunk_size,
                                          compiled=compiled, with_logits=with_logits or on_logits is not None)
        log_probs.append(lp)
        if on_logits is not None:
            on_logits(start, stop, rows)
        elif with_logits:
            logits.append(rows)
        del rows  # else a sink's micro-batch would stay alive through the next one's forward
    return torch.cat(log_probs), (torch.cat(logits) if logits else None)


def score_sequences(model, sequences: list[list[int]], response_lengths: list[int], *, micro_batch_size: int,
                    temperature: float, pad_token_id: int, autocast, packed: bool = True,
                    chunk_size: int = LOG_PROBS_CHUNK_SIZE, compiled: bool = False,
                    on_logits: LogitsSink | None = None):
    """`score_rollout` over token sequences whose last response_lengths[i] tokens are the response:
    (log-probs (B, R), logits (B, R, V), or None when `on_logits` takes them micro-batch by micro-batch),
    laid out exactly as in training."""
    samples = [Sample(group_index=0, index=i, prompt="", tokens=seq, response_length=n, loss_mask=[1] * n)
               for i, (seq, n) in enumerate(zip(sequences, response_lengths))]
    batch = TrainBatch.from_samples(samples, pad_token_id, next(model.parameters()).device)
    return score_rollout(model, batch, micro_batch_size, temperature, autocast, with_logits=on_logits is None,
                         packed=packed, chunk_size=chunk_size, compiled=compiled, on_logits=on_logits)
