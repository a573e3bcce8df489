"""The training side: one rollout of `Sample`s in, optimizer steps and a `TrainResult` out.

Per rollout: score the samples with the current policy (the PPO "old" log-probs) and with the
reference model; turn rewards into advantages; then `num_steps_per_rollout` optimizer steps, each
over `global_batch_size` samples in micro-batches of `micro_batch_size` with accumulated grads.

The trainer owns its model and optimizer: the loop asks it to `train`, `save`, `send_weights`
and report digests, and never touches the model itself. A `parallelize(model)` hook is applied
before the optimizer is built (where sharding goes; single-process runs pass none).

One trainer runs on every rank of a data-parallel group (miles/cluster hosts the ranks); `ranks`
says which rows are this rank's and does the collectives (train/parallel.py says how the 1-rank
gradient and metrics are kept). A single process passes `SingleRank()`, where all of that is
the identity.

Non-finite guard: no NaN/Inf reaches the weights. A rollout with a non-finite reward or trainer
log-prob takes no optimizer step; an optimizer step whose loss or gradient is non-finite is not
taken (nor are the rollout's later ones), so parameters and optimizer state stay as they were.
The result names what was non-finite and where (`TrainResult.nonfinite`); the loop counts such
steps (`--max-nonfinite-steps`).
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from miles.bridge import routing
from miles.bridge.transports import WeightTransport
from miles.bridge.transports.disk import write_hf_weights
from miles.bridge.types import Sample, StepDiagnostics, TrainResult
from miles.bridge.weight_sync import SentTensor, SyncStats
from miles.config import TrainConfig
from miles.errors import UsageError
from miles.train import micro_batches
from miles.train.advantages import ADVANTAGE_ESTIMATORS
from miles.train.batch import TrainBatch, response_log_probs, score_rollout
from miles.train.checkpoint import save_checkpoint
from miles.train.compile import compile_layers
from miles.train.logprobs import check_output_head
from miles.train.losses import KL_ESTIMATORS, aggregate, masked_mean, policy_loss, tis_weights
from miles.train.meter import StepMeter, matmul_parameters
from miles.train.parallel import (SingleRank, full_named_parameters, local_numel, optimizer_state_by_name,
                                  optimizer_state_by_number)
from miles.utils.digest import bytes_digest16, named_tensors_digest16, tensor_bytes_sha256
from miles.utils.forward_kernels import strict_backward
from miles.utils.progress import Progress


def mixed_precision(precision: str, device_type: str, cache: bool = True):
    """The trainer's compute context: bf16 autocast over fp32 master weights, or plain fp32. `cache=False`:
    each cast of a weight is made where it is used (what a CUDA graph that replays the casts needs)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=cache)


def enable_activation_checkpointing(model) -> None:
    """--gradient-checkpointing: each HF decoder layer recomputes its forward in backward
    (non-reentrant torch.utils.checkpoint; inside the layer's FSDP2 unit once sharded)."""
    import warnings

    with warnings.catch_warnings():  # renamed activation_checkpointing_enable in 5.2x; 5.17 has only this name
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Trainer:
    def __init__(self, cfg: TrainConfig, model, ref_model, *, temperature: float, group_size: int, pad_token_id: int,
                 precision: str, record_hashes: bool = False,
                 parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 ranks: SingleRank | None = None, strict_deterministic_backward: bool = True):
        """`temperature` is the rollout's sampling temperature (tokens are scored at it);
        `group_size` its samples per prompt; `record_hashes` (--debug-determinism) adds digests;
        `parallelize` shards policy and reference alike. Under --deterministic-mode each forward/backward
        runs strict (miles.utils.forward_kernels.strict_backward) unless `strict_deterministic_backward`
        is False (where an engine samples in this process meanwhile, --async: kernels strict refuses) or the
        model is MoE."""
        self.cfg = cfg
        self.ranks = ranks or SingleRank()
        self.sharded = parallelize is not None
        shard = parallelize or (lambda m: m)
        check_output_head(model)
        # MoE: (layers, experts, k) of the routers whose choices are compared with the engine's (and
        # replayed with --use-rollout-routing-replay); None for a dense model.
        self.moe = routing.shape(model) if routing.routers(model) else None
        self._routed_model = model  # the HF model whose routers are hooked (sharding keeps its modules)
        if cfg.use_rollout_routing_replay and self.moe is None:
            raise UsageError(f"--use-rollout-routing-replay: the model ({model.config.model_type}) has no MoE routers "
                             f"miles can replay (families: {', '.join(routing.FAMILIES)}); drop the flag for a dense "
                             "model")
        if cfg.torch_compile and self.moe is not None:
            raise UsageError("--trainer-torch-compile: MoE routers are hooked per micro-batch (routing checks and "
                             "replay), which compiled layers do not follow yet; drop the flag for an MoE model")
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if cfg.torch_compile:
            compile_layers(model)
        self.matmul_params = matmul_parameters(model)
        self.model = shard(model).train()
        self.ref_model = shard(ref_model).eval() if ref_model is not None else None
        self.temperature = temperature
        self.group_size = group_size
        self.pad_token_id = pad_token_id
        self.device = next(self.model.parameters()).device
        self.precision = precision
        self.record_hashes = record_hashes
        # MoE layers count tokens per expert with torch.histc, which has no deterministic CUDA kernel:
        # strict mode would raise there, so MoE models keep the mode's warn-only kernels (math SDPA).
        strict = strict_deterministic_backward and self.moe is None
        self.strict_backward = strict_backward if strict else contextlib.nullcontext
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def autocast(self):
        return mixed_precision(self.precision, self.device.type)

    @torch.no_grad()
    def prompt_log_probs(self, tokens: list[int]) -> list[float]:
        """log p(tokens[i] | tokens[:i]) for i >= 1 at temperature 1, under the trainer's autocast: the
        trainer's side of the weight probe an engine without comparable digests is checked with."""
        samples = [Sample(group_index=0, index=0, prompt="", tokens=tokens, response_length=len(tokens) - 1,
                          loss_mask=[1] * (len(tokens) - 1))]
        batch = TrainBatch.from_samples(samples, self.pad_token_id, self.device)
        return score_rollout(self.model, batch, len(tokens), 1.0, self.autocast,
                             **self.cfg.scoring_layout)[0][0].tolist()

    def _score(self, model, batch: TrainBatch, counts: list[int] | None = None) -> torch.Tensor:
        """Log-probs of every row: this rank scores its share, the others' are gathered. `counts`
        (the policy's scoring of an MoE rollout with routes): gets this rank's routing mismatch."""
        lo, hi = self.ranks.rows(0, batch.rewards.numel())
        around = (lambda mb: self._routed(mb, counts)) if counts is not None else None
        bounds = [(a - lo, b - lo) for a, b in self._micro_batches(batch, lo, hi, training=False)]
        # Under --deterministic-mode the scoring forward takes the training forward's kernels (strict, flash
        # SDPA) rather than the mode's math SDPA: faster, and the log-probs it scores are the ones the
        # training forward recomputes from the same weights.
        with self.strict_backward():
            mine = score_rollout(model, batch.rows(lo, hi), self.cfg.micro_batch_size, self.temperature,
                                 self.autocast, around=around, bounds=bounds, **self.cfg.scoring_layout)[0]
        return self.ranks.gather_rows(mine)

    def _micro_batches(self, batch: TrainBatch, start: int, stop: int, *, training: bool) -> list[tuple[int, int]]:
        """This rank's rows [start, stop) cut into micro-batches: --micro-batch-size samples each, or as
        many as fit the token budget of training or scoring (--use-dynamic-batch-size), as many
        micro-batches on every rank."""
        cfg = self.cfg
        own = not training and cfg.log_probs_max_tokens_per_gpu is not None  # scoring's own budget was given
        max_tokens = cfg.log_probs_max_tokens_per_gpu if own else cfg.max_tokens_per_gpu
        if max_tokens is None:
            return micro_batches.fixed(start, stop, cfg.micro_batch_size)
        lengths = batch.attention_mask.sum(-1).tolist()
        if max(lengths) > max_tokens:  # every rank holds the whole batch: all of them stop here
            flag = "--log-probs-max-tokens-per-gpu" if own else "--max-tokens-per-gpu"
            raise UsageError(f"{flag} {max_tokens} is below the longest sample's {max(lengths)} tokens (prompt + "
                             f"response): raise it to at least {max(lengths)}")
        parts = micro_batches.by_tokens(lengths, start, stop, max_tokens, packed=cfg.qkv_format == "thd")
        return micro_batches.split_to(parts, int(self.ranks.max(len(parts))))

    @contextlib.contextmanager
    def _routed(self, mb: TrainBatch, counts: list[int] | None = None):
        """A policy forward of micro-batch `mb`: with --use-rollout-routing-replay its routers take the
        engine's experts (bridge/routing.py: the weights of those experts recomputed from the router's
        own logits, so the router still gets gradients); `counts` += [differing, compared] token-layer
        routes between the router's own choice and the engine's."""
        if mb.routes is None or (counts is None and not self.cfg.use_rollout_routing_replay):
            yield
            return
        flat = mb.flat_routes(packed=self.cfg.qkv_format == "thd")
        model = self._routed_model
        replay = routing.replay_routes(model, flat) if self.cfg.use_rollout_routing_replay else None
        # Recording first: its hooks run before the replay's, so they see the router's own choice.
        recording = routing.record_routes(model) if counts is not None else contextlib.nullcontext([])
        with recording as own, (replay or contextlib.nullcontext()):
            yield
        if counts is not None and own:
            differ, total = routing.mismatch_counts(flat, own[0])
            counts[0] += differ
            counts[1] += total

    def _check_routes(self, samples: list[Sample]) -> None:
        if self.moe is None:
            return
        try:
            routing.check_sample_routes(samples, *self.moe, required=self.cfg.use_rollout_routing_replay)
        except routing.RoutingError as e:
            fix = ("the engine must return them: miles' local engine and `miles serve` do; start SGLang with "
                   "--enable-return-routed-experts, vLLM with --enable-return-routed-experts"
                   if "has no rollout_routed_experts" in str(e) else "the dump or engine gave routes of another model")
            raise UsageError(f"--use-rollout-routing-replay: {e} ({fix})" if self.cfg.use_rollout_routing_replay
                             else f"MoE routes: {e} ({fix})") from None

    def train(self, samples: list[Sample], *, rollout_log_probs: bool = False) -> TrainResult:
        """Scores the rollout, then takes `num_steps_per_rollout` optimizer steps on it. `rollout_log_probs`
        (--use-rollout-logprobs): the ratio's old log-probs are the engine's, when every sample has them, and the
        policy's scoring pass is skipped; the trainer/engine gap metrics are then the first optimizer step's training
        forward's against them."""
        self._check_routes(samples)
        batch = TrainBatch.from_samples(samples, self.pad_token_id, self.device)
        meter = StepMeter(self.device)
        reused = rollout_log_probs and batch.has_rollout_log_probs
        counts = [0, 0] if self.moe is not None and batch.routes is not None and not reused else None
        old_log_probs = batch.rollout_log_probs if reused else self._score(self.model, batch, counts)
        # The reference model routes on its own: R3 fixes the policy's routes to the data's, not the reference's.
        ref_log_probs = self._score(self.ref_model, batch) if self.ref_model is not None else None
        kl = KL_ESTIMATORS[self.cfg.kl_loss_type](old_log_probs, ref_log_probs) if ref_log_probs is not None else None
        metrics = score_metrics(batch, old_log_probs, ref_log_probs, kl, reused)
        routing_mismatch = None
        if counts is not None:
            total = self.ranks.sum({"differ": float(counts[0]), "total": float(counts[1])})
            routing_mismatch = total["differ"] / total["total"] if total["total"] else 0.0
            metrics["train/routing_mismatch_frac"] = routing_mismatch
        diagnostics = StepDiagnostics(old_log_probs, ref_log_probs,
                                      batch.rollout_log_probs if batch.has_rollout_log_probs and not reused else None,
                                      batch.mask, 0.0, routing_mismatch=routing_mismatch,
                                      routing_replay=self.cfg.use_rollout_routing_replay,
                                      moe_without_routes=self.moe is not None and batch.routes is None)
        if nonfinite := nonfinite_inputs(batch, old_log_probs, ref_log_probs, "engine" if reused else "trainer"):
            metrics["train/skipped_nonfinite"] = 1.0
            return TrainResult(metrics, diagnostics, nonfinite=nonfinite)
        advantages = ADVANTAGE_ESTIMATORS[self.cfg.advantage_estimator](
            batch.rewards, kl, batch.mask, group_size=self.group_size, kl_coef=self.cfg.kl_coef)
        metrics["rollout/advantages"] = masked_mean(advantages, batch.mask).item()

        step_metrics, grad_digests, (recompute_gap, recompute_mean), nonfinite = self._optimize(
            batch, advantages, old_log_probs, ref_log_probs, meter)
        for key in step_metrics[0]:
            metrics[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
        metrics["train/recompute_logp_max_diff"] = diagnostics.recompute_max_diff = recompute_gap
        if reused:  # the trainer's side of the trainer/engine gap: its training forward (the first optimizer step)
            metrics["train/train_rollout_logprob_abs_diff"] = recompute_mean
            metrics["forward_logp_max_diff"] = recompute_gap
        if nonfinite:
            metrics["train/skipped_nonfinite"] = 1.0
        hashes = {}
        if self.record_hashes:
            losses = [m["train/loss"] for m in step_metrics]
            with meter.hashing():
                if not reused:  # the engine's log-probs: the rollout's own hash covers them
                    hashes["trainer_log_probs"] = named_tensors_digest16([("trainer_log_probs",
                                                                           old_log_probs * batch.mask)])
                hashes.update(loss=bytes_digest16(struct.pack(f"<{len(losses)}d", *losses)),
                              gradients=bytes_digest16(*(d.encode() for d in grad_digests)),
                              parameters=named_tensors_digest16(full_named_parameters(self.model, self.ranks)))
        lo, hi = self.ranks.rows(0, batch.rewards.numel())
        passes = (0 if reused else 2) + (2 if self.ref_model is not None else 0) + 6  # scorings, fwd + bwd
        metrics.update(meter.metrics(flops=passes * self.matmul_params * int(batch.attention_mask[lo:hi].sum())))
        return TrainResult(metrics, diagnostics, hashes, nonfinite)

    def _optimize(self, batch: TrainBatch, advantages, old_log_probs, ref_log_probs, meter: StepMeter):
        """The optimizer steps, each over a global batch accumulated from micro-batches.

        Returns each step's metrics, each step's gradient digest (with --debug-determinism), the largest and
        the mean gap between the first step's training forward and the old log-probs (the scoring forward's: 0
        before any update has been made; or the engine's), and what was non-finite when a step was not taken
        (None if none).
        """
        cfg, ranks = self.cfg, self.ranks
        step_metrics, grad_digests, recompute = [], [], (0.0, 0.0)
        gbs = cfg.global_batch_size
        # Each step's micro-batches: this rank's share of the step's rows, cut by samples or tokens.
        plan = [self._micro_batches(batch, *ranks.rows(step * gbs, (step + 1) * gbs), training=True)
                for step in range(cfg.num_steps_per_rollout)]
        with Progress("training", total=sum(map(len, plan)), unit="micro-batches") as bar:
            for step, parts in enumerate(plan):
                rows = slice(step * gbs, (step + 1) * gbs)
                tokens = int(batch.mask[rows].sum()) if cfg.calculate_per_token_loss else None
                self.optimizer.zero_grad(set_to_none=True)
                sums: dict[str, float] = {}
                bad_start = -1  # the first micro-batch (its first row) with a non-finite loss
                gap, gap_sum, gap_tokens = 0.0, 0.0, 0.0
                for lo, hi in parts:
                    out = self._micro_step(batch.rows(lo, hi), advantages[lo:hi], old_log_probs[lo:hi],
                                           ref_log_probs[lo:hi] if ref_log_probs is not None else None, tokens)
                    mb_max, mb_sum, mb_tokens = out.pop("recompute")
                    gap, gap_sum, gap_tokens = max(gap, mb_max), gap_sum + mb_sum, gap_tokens + mb_tokens
                    for key, value in out.items():
                        sums[key] = sums.get(key, 0.0) + value
                    if bad_start < 0 and not math.isfinite(out["train/loss"]):
                        bad_start = lo
                    bar.advance()
                sums = ranks.sum(sums)  # each micro-batch's share of the global mean, summed over ranks
                if step == 0:
                    total = ranks.sum({"sum": gap_sum, "tokens": gap_tokens})
                    recompute = (ranks.max(gap), total["sum"] / max(total["tokens"], 1.0))
                bad_start = int(ranks.max(bad_start))
                if self.record_hashes:
                    with meter.hashing():
                        grad_digests.append(named_tensors_digest16(
                            (n, ranks.full(p.grad)) for n, p in self.model.named_parameters()))
                max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                sums["train/grad_norm"] = ranks.full(norm).item()
                step_metrics.append(sums)
                if bad_start >= 0 or not math.isfinite(sums["train/grad_norm"]):
                    bad_micro_batch = f"the micro-batch starting at sample {bad_start}"
                    where = f"loss of {bad_micro_batch}" if bad_start >= 0 else f"gradient of {self._nonfinite_grad()}"
                    self.optimizer.zero_grad(set_to_none=True)
                    return step_metrics, grad_digests, recompute, (
                        f"{where}, optimizer step {step + 1} of {cfg.num_steps_per_rollout}"
                        + (f" (steps 1..{step} of this rollout were taken)" if step else ""))
                self.optimizer.step()
        return step_metrics, grad_digests, recompute, None

    def _nonfinite_grad(self) -> str:
        """The first parameter whose gradient holds NaN/Inf on any rank (every rank calls this)."""
        from torch.distributed.tensor import DTensor

        for name, p in self.model.named_parameters():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.ranks.any(grad is not None and not bool(torch.isfinite(grad).all())):
                return name
        return "an unnamed tensor"

    def _micro_step(self, mb: TrainBatch, advantages, old_log_probs, ref_log_probs,
                    tokens_in_batch: int | None) -> dict[str, float]:
        """Forward + backward of one micro-batch. Returns its share of the step's metrics."""
        cfg = self.cfg

        def agg(per_token):  # this micro-batch's share of the global batch's mean
            return aggregate(per_token, mb.mask, samples_in_batch=cfg.global_batch_size,
                             tokens_in_batch=tokens_in_batch)

        # The whole micro-step inside the replay: a checkpointed layer re-runs its router in backward.
        with self._routed(mb), self.strict_backward():
            return self._forward_backward(mb, advantages, old_log_probs, ref_log_probs, agg)

    def _forward_backward(self, mb: TrainBatch, advantages, old_log_probs, ref_log_probs, agg) -> dict[str, float]:
        cfg = self.cfg
        with self.autocast():
            log_probs, entropy = response_log_probs(self.model, mb, self.temperature, with_entropy=True,
                                                    **self.cfg.scoring_layout)
        gap = (log_probs.detach() - old_log_probs).abs() * mb.mask
        out = {"recompute": torch.stack([gap.max(), gap.sum(), mb.mask.sum().to(gap.dtype)]).tolist()}  # one sync
        pg, clipped, ppo_kl = policy_loss(log_probs, old_log_probs, advantages, mb.mask, eps_clip=cfg.eps_clip,
                                          eps_clip_high=cfg.eps_clip_high,
                                          sequence_level_ratio=cfg.advantage_estimator == "gspo")
        if cfg.use_tis:
            weights, tis_clipped = tis_weights(old_log_probs, mb.rollout_log_probs, cfg.tis_clip)
            pg = pg * weights
            out["train/tis_mean"] = agg(weights).item()
            out["train/tis_clipfrac"] = agg(tis_clipped).item()
        pg_loss = agg(pg)
        loss = pg_loss
        if cfg.use_kl_loss:
            kl_loss = agg(KL_ESTIMATORS[cfg.kl_loss_type](log_probs, ref_log_probs))
            loss = loss + cfg.kl_loss_coef * kl_loss
            out["train/kl_loss"] = kl_loss.item()
        loss.backward()
        out.update({
            "train/loss": loss.item(),
            "train/pg_loss": pg_loss.item(),
            "train/pg_clipfrac": agg(clipped).item(),
            "train/ppo_kl": agg(ppo_kl).item(),
            "train/entropy": agg(entropy).item(),
        })
        return out

    # -- what the loop asks of the trainer besides training ----------------------------------------

    def send_weights(self, transport: WeightTransport, step: int) -> SyncStats:
        return transport.send(self, step)

    # The `WeightSource` a transport reads (bridge/transports/base.py): whole tensors, whatever the sharding.

    @torch.no_grad()
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter whole; on rank 0 only when sharded (the others gather and get [])."""
        named = list(full_named_parameters(self.model, self.ranks))
        return named if self.ranks.rank == 0 else []

    @torch.no_grad()
    def write_hf(self, directory: Path, *, untie: bool = False) -> tuple[int, int]:
        """The policy in HF layout (safetensors + config.json) into `directory`, by rank 0; returns
        (tensors, bytes) written ((0, 0) on the other ranks)."""
        state = self.full_state_dict()
        return write_hf_weights(self.model, state, directory, untie=untie) if self.ranks.rank == 0 else (0, 0)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole state dict on CPU (gathered when sharded; None on ranks other than 0)."""
        if not self.sharded:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.ranks.rank == 0 else None

    @torch.no_grad()
    def weight_digests(self, dtypes: dict[str, str]) -> dict[str, SentTensor]:
        """Each parameter as an engine holding it in dtypes[name] should hold it (default: as is);
        whole tensors (sharded ones gathered)."""
        out = {}
        for name, p in full_named_parameters(self.model, self.ranks):
            dtype = getattr(torch, dtypes[name]) if name in dtypes else p.dtype
            out[name] = SentTensor(list(p.shape), str(p.dtype).removeprefix("torch."), p.numel() * p.element_size(),
                                   tensor_bytes_sha256(p.to(dtype)))
        return out

    def save(self, root: str | Path, step: int, tokenizer, extra_state: dict) -> Path | None:
        """checkpoints/step_N: the policy in HF format, the tokenizer, and trainer_state.pt (the
        optimizer state plus `extra_state`). Sharded: gathered, and written by rank 0 (others get None)."""
        weights, state = self.full_state_dict(), self.state_dict()
        if self.ranks.rank != 0:
            return None
        return save_checkpoint(root, step, self.model, tokenizer, {**state, **extra_state}, state_dict=weights)

    def save_fn(self, tokenizer):
        """`save` with the tokenizer bound: what a Checkpointer calls."""
        return lambda root, step, extra_state: self.save(root, step, tokenizer, extra_state)

    def state_dict(self) -> dict:
        """The optimizer state, numbered as a 1-process optimizer numbers it (gathered when sharded)."""
        if not self.sharded:
            return {"optimizer": self.optimizer.state_dict()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        named = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ranks.rank != 0:  # gathered to rank 0 only
            return {}
        return {"optimizer": optimizer_state_by_number(named, self._param_names())}

    def load_state_dict(self, state: dict) -> None:
        """The optimizer state of a checkpoint (of any rank count), under this run's --lr and
        --weight-decay (the saved param groups carry the old run's; a resume with new ones must
        train with the new ones)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer,
                                     optimizer_state_by_name(state["optimizer"], self._param_names()),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay

    def _param_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of each model's parameters held by this rank (its shards, when sharded)."""
        models = {"policy": self.model, "reference": self.ref_model}
        return {name: sum(local_numel(p) * p.element_size() for p in m.parameters())
                for name, m in models.items() if m is not None}


def nonfinite_inputs(batch: TrainBatch, old_log_probs, ref_log_probs, old_from: str = "trainer") -> str | None:
    """What of a rollout's inputs to the loss is NaN/Inf, naming the samples; None if all is finite. `old_from`:
    whose the old log-probs are ("trainer", or "engine" under --use-rollout-logprobs)."""
    def samples(bad: torch.Tensor) -> str:
        rows = bad.nonzero().flatten().tolist()
        return ", ".join(map(str, rows[:8])) + (f" (+{len(rows) - 8} more)" if len(rows) > 8 else "")

    rewards = batch.rewards
    if not bool(torch.isfinite(rewards).all()):
        bad = ~torch.isfinite(rewards)
        return f"reward of sample(s) {samples(bad)} ({rewards[bad][0].item()})"
    for name, log_probs in ((f"{old_from} log-prob", old_log_probs), ("reference log-prob", ref_log_probs)):
        if log_probs is not None:
            bad = (~torch.isfinite(log_probs) & (batch.mask > 0)).any(-1)
            if bool(bad.any()):
                return f"{name}s of sample(s) {samples(bad)} (a NaN/Inf weight, or an overflow in low precision)"
    return None


def score_metrics(batch: TrainBatch, old_log_probs, ref_log_probs, kl, reused: bool = False) -> dict[str, float]:
    """The rollout's log-prob metrics: trainer, reference, and the trainer/engine mismatch (when the old log-probs
    are the engine's, `train/rollout_logprobs_used` 1, the mismatch comes from the training forward instead)."""
    mask = batch.mask
    metrics = {"rollout/log_probs": masked_mean(old_log_probs, mask).item(),
               "train/rollout_logprobs_used": float(reused)}
    if batch.has_rollout_log_probs and not reused:  # how far the engine's log-probs are from the trainer's
        logp_diff = (old_log_probs - batch.rollout_log_probs).abs() * mask
        metrics["train/train_rollout_logprob_abs_diff"] = masked_mean(logp_diff, mask).item()
        metrics["forward_logp_max_diff"] = logp_diff.max().item()
    if ref_log_probs is not None:
        metrics["rollout/ref_log_probs"] = masked_mean(ref_log_probs, mask).item()
        metrics["rollout/kl"] = masked_mean(kl, mask).item()
    return metrics
