"""The training side: one rollout of `Sample`s in, optimizer steps and metrics out.

Per rollout: score the samples with the current policy (the PPO "old" log-probs) and with the
reference model; turn rewards into advantages; then `num_steps_per_rollout` optimizer steps, each
over `global_batch_size` samples in micro-batches of `micro_batch_size` with accumulated grads.
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass

import torch

from miles.bridge.types import Sample
from miles.config import TrainConfig
from miles.debug.determinism import model_digest
from miles.utils.digest import digest, tensor_bytes
from miles.train.advantages import ADVANTAGE_ESTIMATORS
from miles.train.batch import TrainBatch, response_log_probs, score_rollout
from miles.train.losses import KL_ESTIMATORS, aggregate, masked_mean, policy_loss, tis_weights
from miles.utils.progress import Progress


@dataclass
class StepDiagnostics:
    """Per-token tensors (B, R) of the last rollout, kept for the step-1 alignment check."""

    old_log_probs: torch.Tensor  # the policy's, before any update
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None  # None when the samples carry no engine log-probs
    mask: torch.Tensor
    recompute_max_diff: float  # max |log-prob in the first training forward - old_log_probs|


def mixed_precision(precision: str, device_type: str):
    """The trainer's compute context: bf16 autocast over fp32 master weights, or plain fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


class Trainer:
    def __init__(self, cfg: TrainConfig, model, ref_model, *, pad_token_id: int, precision: str,
                 record_hashes: bool = False):
        self.cfg = cfg
        self.model = model.train()
        self.ref_model = ref_model.eval() if ref_model is not None else None
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.precision = precision
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.diagnostics: StepDiagnostics | None = None
        self.record_hashes = record_hashes  # --debug-determinism: digests of the step's training side
        self.step_hashes: dict[str, str] = {}

    def autocast(self):
        return mixed_precision(self.precision, self.device.type)

    def _score(self, model, batch: TrainBatch) -> torch.Tensor:
        return score_rollout(model, batch, self.cfg.micro_batch_size, self.cfg.rollout_temperature, self.autocast)[0]

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Scores the rollout, then takes `num_steps_per_rollout` optimizer steps on it."""
        batch = TrainBatch.from_samples(samples, self.pad_token_id, self.device)
        old_log_probs = self._score(self.model, batch)
        ref_log_probs = self._score(self.ref_model, batch) if self.ref_model is not None else None
        kl = KL_ESTIMATORS[self.cfg.kl_loss_type](old_log_probs, ref_log_probs) if ref_log_probs is not None else None
        metrics = score_metrics(batch, old_log_probs, ref_log_probs, kl)
        advantages = ADVANTAGE_ESTIMATORS[self.cfg.advantage_estimator](
            batch.rewards, kl, batch.mask, group_size=self.cfg.n_samples_per_prompt, kl_coef=self.cfg.kl_coef)
        metrics["rollout/advantages"] = masked_mean(advantages, batch.mask).item()

        step_metrics, grad_digests, recompute_gap = self._optimize(batch, advantages, old_log_probs, ref_log_probs)
        for key in step_metrics[0]:
            metrics[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
        metrics["train/recompute_logp_max_diff"] = recompute_gap
        if self.record_hashes:
            losses = [m["train/loss"] for m in step_metrics]
            self.step_hashes = {"trainer_log_probs": digest(tensor_bytes(old_log_probs * batch.mask)),
                                "loss": digest(struct.pack(f"<{len(losses)}d", *losses)),
                                "gradients": digest(*(d.encode() for d in grad_digests)),
                                "parameters": model_digest(self.model)}
        self.diagnostics = StepDiagnostics(old_log_probs, ref_log_probs,
                                           batch.rollout_log_probs if batch.has_rollout_log_probs else None,
                                           batch.mask, recompute_gap)
        return metrics

    def _optimize(self, batch: TrainBatch, advantages, old_log_probs, ref_log_probs):
        """The optimizer steps, each over a global batch accumulated from micro-batches.

        Returns each step's metrics, each step's gradient digest (with --debug-determinism), and
        the largest gap between the first step's training forward and the scoring forward, which
        must be 0 before any update has been made.
        """
        cfg = self.cfg
        step_metrics, grad_digests, recompute_gap = [], [], 0.0
        gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
        with Progress("training", total=batch.rewards.numel() // mbs) as bar:
            for step in range(cfg.num_steps_per_rollout):
                self.optimizer.zero_grad(set_to_none=True)
                sums: dict[str, float] = {}
                for start in range(step * gbs, (step + 1) * gbs, mbs):
                    rows = slice(start, start + mbs)
                    out = self._micro_step(batch.rows(start, start + mbs), advantages[rows], old_log_probs[rows],
                                           ref_log_probs[rows] if ref_log_probs is not None else None)
                    gap = out.pop("recompute_max_diff")
                    if step == 0:
                        recompute_gap = max(recompute_gap, gap)
                    for key, value in out.items():
                        sums[key] = sums.get(key, 0.0) + value
                    bar.advance()
                if self.record_hashes:
                    grad_digests.append(model_digest(self.model, grads=True))
                max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
                sums["train/grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
                self.optimizer.step()
                step_metrics.append(sums)
        return step_metrics, grad_digests, recompute_gap

    def _micro_step(self, mb: TrainBatch, advantages, old_log_probs, ref_log_probs) -> dict[str, float]:
        """Forward + backward of one micro-batch. Returns its share of the step's metrics."""
        cfg, gbs = self.cfg, self.cfg.global_batch_size
        with self.autocast():
            log_probs, entropy = response_log_probs(self.model, mb, cfg.rollout_temperature, with_entropy=True)
        out = {"recompute_max_diff": ((log_probs.detach() - old_log_probs).abs() * mb.mask).max().item()}
        pg, clipped, ppo_kl = policy_loss(log_probs, old_log_probs, advantages, mb.mask, eps_clip=cfg.eps_clip,
                                          eps_clip_high=cfg.eps_clip_high,
                                          sequence_level_ratio=cfg.advantage_estimator == "gspo")
        if cfg.use_tis:
            weights, tis_clipped = tis_weights(old_log_probs, mb.rollout_log_probs, cfg.tis_clip)
            pg = pg * weights
            out["train/tis_mean"] = aggregate(weights, mb.mask, gbs).item()
            out["train/tis_clipfrac"] = aggregate(tis_clipped, mb.mask, gbs).item()
        pg_loss = aggregate(pg, mb.mask, gbs)
        loss = pg_loss
        if cfg.use_kl_loss:
            kl_loss = aggregate(KL_ESTIMATORS[cfg.kl_loss_type](log_probs, ref_log_probs), mb.mask, gbs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            out["train/kl_loss"] = kl_loss.item()
        loss.backward()
        out.update({
            "train/loss": loss.item(),
            "train/pg_loss": pg_loss.item(),
            "train/pg_clipfrac": aggregate(clipped, mb.mask, gbs).item(),
            "train/ppo_kl": aggregate(ppo_kl, mb.mask, gbs).item(),
            "train/entropy": aggregate(entropy, mb.mask, gbs).item(),
        })
        return out

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


def score_metrics(batch: TrainBatch, old_log_probs, ref_log_probs, kl) -> dict[str, float]:
    """The rollout's log-prob metrics: trainer, reference, and the trainer/engine mismatch."""
    mask = batch.mask
    metrics = {"rollout/log_probs": masked_mean(old_log_probs, mask).item()}
    if batch.has_rollout_log_probs:  # how far the engine's log-probs are from the trainer's
        logp_diff = (old_log_probs - batch.rollout_log_probs).abs() * mask
        metrics["train/train_rollout_logprob_abs_diff"] = masked_mean(logp_diff, mask).item()
        metrics["forward_logp_max_diff"] = logp_diff.max().item()
    if ref_log_probs is not None:
        metrics["rollout/ref_log_probs"] = masked_mean(ref_log_probs, mask).item()
        metrics["rollout/kl"] = masked_mean(kl, mask).item()
    return metrics
