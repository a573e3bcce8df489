"""Samples -> padded tensors for the trainer, and the trainer's log-probs of response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.bridge.types import Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, L)
    response_positions: torch.Tensor  # (B, R) index into the (B, L-1) next-token grid
    mask: torch.Tensor  # (B, R) float, 1 on response tokens that are trained on
    rollout_log_probs: torch.Tensor  # (B, R) the engine's log-probs of the sampled tokens
    rewards: torch.Tensor  # (B,)
    has_rollout_log_probs: bool = True  # False for dumps made without engine log-probs

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
        tensors = (input_ids, attention_mask, positions, mask, rollout_log_probs, rewards)
        has_log_probs = all(len(s.rollout_log_probs) == s.response_length for s in samples)
        return cls(*(t.to(device) for t in tensors), has_rollout_log_probs=has_log_probs)

    def rows(self, start: int, end: int) -> TrainBatch:
        """Samples [start, end), trimmed to the longest sequence among them."""
        width = int(self.attention_mask[start:end].sum(-1).max())
        return TrainBatch(self.input_ids[start:end, :width], self.attention_mask[start:end, :width],
                          self.response_positions[start:end].clamp(max=width - 2), self.mask[start:end],
                          self.rollout_log_probs[start:end], self.rewards[start:end], self.has_rollout_log_probs)


def response_log_probs(model, batch: TrainBatch, temperature: float, *, with_entropy: bool = False,
                       with_logits: bool = False):
    """Log-probs (B, R) of each response token under `model`, at the sampling temperature.

    The second value is, when asked, the entropy (B, R) of the next-token distribution (no
    gradient), or the raw logits (B, R, V) at the response positions.
    """
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()  # (B, L-1, V)
    raw = logits
    if temperature > 0:
        logits = logits / temperature
    targets = batch.input_ids[:, 1:]
    log_z = logits.logsumexp(-1)  # (B, L-1)
    token_logp = logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    log_probs = token_logp.gather(1, batch.response_positions)
    if with_logits:
        index = batch.response_positions[..., None].expand(-1, -1, raw.shape[-1])
        return log_probs, raw.gather(1, index)
    if not with_entropy:
        return log_probs, None
    with torch.no_grad():
        probs = (logits - log_z[..., None]).exp()
        entropy = log_z - (probs * logits).sum(-1)
    return log_probs, entropy.gather(1, batch.response_positions)


@torch.no_grad()
def score_rollout(model, batch: TrainBatch, micro_batch_size: int, temperature: float, autocast,
                  with_logits: bool = False):
    """The trainer's scoring pass: response log-probs (B, R), micro-batch by micro-batch.

    `--true-on-policy-mode` runs this very function in the engine too (`score_sequences`), on the
    same batch layout, so that both sides compute the same numbers with the same kernels, shapes
    and order.
    """
    log_probs, logits = [], []
    for start in range(0, batch.rewards.numel(), micro_batch_size):
        with autocast():
            lp, rows = response_log_probs(model, batch.rows(start, start + micro_batch_size), temperature,
                                          with_logits=with_logits)
        log_probs.append(lp)
        logits.append(rows)
    return torch.cat(log_probs), (torch.cat(logits) if with_logits else None)


def score_sequences(model, sequences: list[list[int]], response_lengths: list[int], *, micro_batch_size: int,
                    temperature: float, pad_token_id: int, autocast):
    """`score_rollout` over token sequences whose last response_lengths[i] tokens are the response:
    (log-probs (B, R), logits (B, R, V)), laid out exactly as in training."""
    samples = [Sample(group_index=0, index=i, prompt="", tokens=seq, response_length=n, loss_mask=[1] * n)
               for i, (seq, n) in enumerate(zip(sequences, response_lengths))]
    batch = TrainBatch.from_samples(samples, pad_token_id, next(model.parameters()).device)
    return score_rollout(model, batch, micro_batch_size, temperature, autocast, with_logits=True)
