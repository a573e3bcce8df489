"""Mismatch attribution: when the trainer's and the engine's log-probs disagree, which factor moves the gap.

The step-1 alignment check says *that* the train/engine gap is high. This says *why*: it re-scores a
fixed probe (the first few samples of step 1, their tokens fixed) changing one factor at a time and
measures the gap again, mean |trainer - engine| over the response tokens:

| factor | as run | changed |
|---|---|---|
| weights | the trainer scores with its own weights | with the engine's weights (local engine) |
| precision | the trainer's autocast (bf16/fp16) | fp32 |
| temperature | log-probs of logits / T | of the raw logits (T = 1), as an engine that returns raw ones |
| decode path | the engine's log-probs from its decode loop | the engine's full forward over the same tokens |
| KV cache | the engine's model through a KV cache, token by token | the same model, one forward, no cache |

A factor "moves the gap" when changing it alone leaves at most half the gap; the verdict names, of
the factors leaving the least (within 2x of the best), the first in the table's order, which runs from
the most specific to the most general (the decode path holds the KV cache and every kernel of the loop).
`Mismatch attribution | ...` lines land in train.log for `miles doctor`.
With servers (`--rollout-backend sglang|vllm`) the engine's full forward is the server's prompt
log-probs (always at temperature 1, so that factor needs --rollout-temperature 1); the weights and
the KV cache factors need the engine's model in process and are reported as not measurable.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from miles.bridge.types import Sample

logger = logging.getLogger("miles")

PROBE_SAMPLES = 4
MOVES = 0.5  # a factor moves the gap when changing it leaves at most this share of it
# The knowledge base's culprit (kb/culprits.json) each factor points at.
CULPRITS = {"weights": "weight_sync_stale", "precision": "parallel_precision_config",
            "temperature": "logprob_semantics", "decode path": "engine_trainer_kernel_mismatch",
            "KV cache": "engine_trainer_kernel_mismatch"}


@dataclass
class Probe:
    sequences: list[list[int]]  # prompt + response tokens
    response_lengths: list[int]
    engine: list[list[float]]  # the engine's recorded log-probs of the response tokens

    @classmethod
    def from_samples(cls, samples: list[Sample], n: int = PROBE_SAMPLES) -> Probe | None:
        rows = [s for s in samples if s.response_length and len(s.rollout_log_probs) == s.response_length][:n]
        if not rows:
            return None
        return cls([list(s.tokens) for s in rows], [s.response_length for s in rows],
                    [list(s.rollout_log_probs) for s in rows])


@dataclass
class Factor:
    name: str
    as_run: str
    changed: str
    gap: float | None  # the gap with this factor changed; None: not measurable here
    why_not: str = ""
    before: float | None = None  # the gap with it as run, when that is not the baseline (KV cache: the
    # engine's model recomputed through a cache, teacher forced)

    def moves(self, baseline: float) -> bool:
        if self.gap is None:
            return False
        before = baseline if self.before is None else self.before
        return self.gap <= MOVES * before and before > MOVES * baseline  # and as run it reproduces the gap


@dataclass
class Attribution:
    baseline: float
    tokens: int
    factors: list[Factor] = field(default_factory=list)

    @property
    def culprit(self) -> Factor | None:
        """The first listed (most specific) of the factors that leave the least gap: within 2x of the best."""
        moving = [f for f in self.factors if f.moves(self.baseline)]
        if not moving:
            return None
        best = min(f.gap for f in moving)
        return next(f for f in moving if f.gap <= 2 * best + 1e-6)

    def lines(self) -> list[str]:
        head = (f"Mismatch attribution | baseline | gap {self.baseline:.4g} (mean |trainer - engine| log-prob over "
                f"{self.tokens} probe tokens)")
        out = [head]
        for f in self.factors:
            if f.gap is None:
                out.append(f"Mismatch attribution | {f.name} | {f.as_run} -> {f.changed} | not measured: {f.why_not}")
            else:
                before = self.baseline if f.before is None else f.before
                out.append(f"Mismatch attribution | {f.name} | {f.as_run} -> {f.changed} | gap {before:.4g} "
                           f"-> {f.gap:.4g}" + (" | moves it" if f.moves(self.baseline) else ""))
        top = self.culprit
        if top is None:
            out.append(f"Mismatch attribution | verdict | no single factor moves the gap (each leaves more than "
                       f"{MOVES:.0%}): look at several at once, or at the data (tokens, masks)")
        else:
            before = self.baseline if top.before is None else top.before
            out.append(f"Mismatch attribution | verdict | {top.name}: {top.as_run} -> {top.changed} moves the gap "
                       f"{before:.4g} -> {top.gap:.4g} | culprit id: {CULPRITS[top.name]}")
        return out


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs) if diffs else 0.0


def _rows(log_probs: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [log_probs[i, :n].float().tolist() for i, n in enumerate(lengths)]


def score(model, probe: Probe, *, temperature: float, autocast, pad_token_id: int) -> list[list[float]]:
    """The trainer's scoring function (full forward, packed as in training) on MODEL."""
    from miles.train.batch import score_sequences

    with torch.no_grad():
        lp, _ = score_sequences(model, probe.sequences, probe.response_lengths, micro_batch_size=len(probe.sequences),
                                temperature=temperature, pad_token_id=pad_token_id, autocast=autocast)
    return _rows(lp, probe.response_lengths)


@torch.no_grad()
def cached_decode(model, probe: Probe, *, temperature: float, autocast) -> list[list[float]]:
    """MODEL through transformers' KV cache, the response fed one token at a time (teacher forced)."""
    from miles.rollout.local.decode import CachedForward, make_cache

    forward, device, out = CachedForward(model), next(model.parameters()).device, []
    for seq, n in zip(probe.sequences, probe.response_lengths):
        cache, p = make_cache("dynamic", model.config, len(seq)), len(seq) - n
        ids = torch.tensor([seq], device=device)
        row = []
        with autocast():
            logits = forward(ids[:, :p], torch.ones(1, p, dtype=torch.long, device=device),
                             torch.arange(p, device=device)[None], torch.arange(p, device=device), cache)[:, -1]
            for k in range(n):
                lp = torch.log_softmax(logits.float() / temperature, dim=-1)[0, seq[p + k]]
                row.append(lp.item())
                if k + 1 < n:
                    pos = torch.tensor([[p + k]], device=device)
                    logits = forward(ids[:, p + k:p + k + 1], torch.ones(1, p + k + 1, dtype=torch.long, device=device),
                                     pos, pos[0], cache)[:, -1]
        out.append(row)
    return out


def attribute(probe: Probe, trainer, engine, *, temperature: float, precision: str,
              as_trained: list[list[float]] | None = None) -> Attribution:
    """Every factor this run allows, each changed alone against the run's own setting; `as_trained`: the
    trainer's scores of the probe as run, when the caller has them already."""
    from miles.train.trainer import mixed_precision

    model, pad = trainer.model, trainer.pad_token_id
    if as_trained is None:
        as_trained = score(model, probe, temperature=temperature, autocast=trainer.autocast, pad_token_id=pad)
    result = Attribution(gap(as_trained, probe.engine), sum(probe.response_lengths))
    engine_model = getattr(engine, "model", None)
    engine_autocast = getattr(engine, "autocast", trainer.autocast)

    if engine_model is not None:
        theirs = score(engine_model, probe, temperature=temperature, autocast=trainer.autocast, pad_token_id=pad)
        result.factors.append(Factor("weights", "the trainer's weights", "the engine's weights",
                                     gap(theirs, probe.engine)))
    else:
        result.factors.append(Factor("weights", "the trainer's weights", "the engine's weights", None,
                                     "no engine in this run" if engine is None else "the engine's weights are in a "
                                                                                    "server"))
    if precision != "fp32":
        fp32 = score(model, probe, temperature=temperature, autocast=lambda: mixed_precision("fp32", "cpu"),
                     pad_token_id=pad)
        result.factors.append(Factor("precision", f"trainer in {precision}", "trainer in fp32",
                                     gap(fp32, probe.engine)))
    else:
        result.factors.append(Factor("precision", "fp32", "fp32", None, "the run is fp32 already"))
    if temperature != 1.0:
        raw = score(model, probe, temperature=1.0, autocast=trainer.autocast, pad_token_id=pad)
        result.factors.append(Factor("temperature", f"log-probs at T={temperature:g}", "raw log-probs (T=1)",
                                     gap(raw, probe.engine)))
    else:
        result.factors.append(Factor("temperature", "T=1", "T=1", None, "at temperature 1 raw and processed "
                                     "log-probs are the same"))

    if engine_model is not None:  # KV cache first: when it reproduces the gap it is the narrower answer
        full = score(engine_model, probe, temperature=temperature, autocast=engine_autocast, pad_token_id=pad)
        kv = cached_decode(engine_model, probe, temperature=temperature, autocast=engine_autocast)
        result.factors.append(Factor("KV cache", "the engine's model through a KV cache", "one forward, no cache",
                                     gap(as_trained, full), before=gap(as_trained, kv)))
        result.factors.append(Factor("decode path", "the engine's decode loop", "the engine's full forward",
                                     gap(as_trained, full)))
    elif hasattr(engine, "prompt_log_probs") and temperature == 1.0:
        per_server = engine.prompt_log_probs(probe.sequences[0])
        first = next(iter(per_server.values())) if isinstance(per_server, dict) else per_server
        n = probe.response_lengths[0]
        one = Probe(probe.sequences[:1], [n], probe.engine[:1])
        mine = score(model, one, temperature=1.0, autocast=trainer.autocast, pad_token_id=pad)
        result.factors.append(Factor("decode path", "the server's decode", "the server's prompt log-probs (full "
                                     "forward)", gap(mine, [first[-n:]])))
    else:
        result.factors.append(Factor("decode path", "the engine's decode loop", "the engine's full forward", None,
                                     "no engine in this run (the log-probs come from a dump)" if engine is None else
                                     "a server scores prompts at temperature 1 only; rerun with "
                                     "--rollout-temperature 1"))
    return result


def measure_mismatch(samples: list[Sample], trainer, engine, *, temperature: float, precision: str,
                     bound: float) -> Attribution | str:
    """The attribution of this step's gap, run before the step trains (so both sides still hold the weights
    the samples were made and scored with); a string saying why not when it cannot run or is not needed."""
    probe = Probe.from_samples(samples)
    if probe is None:
        return "no sample carries engine log-probs"
    if not hasattr(trainer, "model"):
        return "the trainer runs on Ray ranks; the attribution needs it in this process"
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        as_trained = score(trainer.model, probe, temperature=temperature, autocast=trainer.autocast,
                           pad_token_id=trainer.pad_token_id)
        baseline = gap(as_trained, probe.engine)
        if not math.isfinite(baseline):
            return "the log-probs are not finite (see the NaN checks above)"
        if baseline <= bound:
            return f"the probe's gap {baseline:.3g} is within {precision} rounding ({bound:g})"
        return attribute(probe, trainer, engine, temperature=temperature, precision=precision, as_trained=as_trained)
    except Exception as e:  # a diagnosis must never stop the run it diagnoses (a server that cannot score, ...)
        logger.debug("mismatch attribution failed", exc_info=True)
        return f"it failed: {type(e).__name__}: {str(e)[:200]}"
    finally:
        trainer.model.train(was_training)


def log_attribution(result: Attribution | str) -> None:
    if isinstance(result, str):
        logger.info("Mismatch attribution | skipped | %s", result)
        return
    for line in result.lines():
        logger.warning(line) if "moves it" in line or "| verdict |" in line else logger.info(line)
