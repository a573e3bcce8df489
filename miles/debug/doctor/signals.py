"""Signal phrases: the lines the debugging guide says to grep for, found or missing, and what that means.

A missing phrase is only news where the run should have printed it: `weight_sync` in a miles run with
both a trainer and an engine, `Continuous async rollout worker started` in an async run. Those two
become findings; the rest are reported in the summary line.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.debug.doctor.findings import Evidence, Finding
from miles.debug.doctor.readers import Corpus
from miles.debug.doctor.rules import LOADED, NOT_OFF, covers_megatron_build, hint_ev, rule

# An async run of the two that print `Continuous async rollout worker started`: miles (`--async`, `async_rollout`) and
# slime (train_async.py, fully_async). Another framework's async mode ("OpenRLHF async training") does not print it.
# A config key that is off (miles' own `async_rollout=False`) says the run is *not* async.
_ASYNC = rf"(--async\b|train_async|fully_async|async[_-]rollout|rollout[_-]async){NOT_OFF}"
_DEBUG_ONE_SIDE = r"debug[_-]rollout[_-]only=(True|true)|debug[_-]train[_-]only=(True|true)|--debug-rollout-only|" \
                  r"--debug-train-only|load[_-]debug[_-]rollout[_-]data=[^N\s]"


@dataclass
class Signal:
    phrase: str
    pattern: str
    found_means: str
    missing_means: str
    expected: bool  # in the runs that were read
    absent_note: str  # why its absence is no news where it is not expected
    count: int = 0

    def to_dict(self) -> dict:
        return {"phrase": self.phrase, "count": self.count, "expected": self.expected,
                "means": self.found_means if self.count else self.missing_means}


def signals(c: Corpus) -> list[Signal]:
    miles = [log for log in c.logs if log.kind == "miles-train"]
    trained = any(log.kind == "miles-train" for log, _ in c.grep(r"\bstep \d+/\d+ \|"))
    one_side = bool(c.hints(_DEBUG_ONE_SIDE))
    megatron = bool(c.hints(r"megatron")) and covers_megatron_build(c)
    out = [
        Signal("Loaded checkpoint from", LOADED, "weights were loaded",
               "parameters did not load (or the log starts after loading): check --load / --ref-load / "
               "--hf-checkpoint", bool(miles) or megatron,
               "not a miles log, nor a Megatron log that covers model loading"),
        Signal("weight_sync", r"weight_sync", "trainer -> engine weight transfers happened",
               "no trainer -> engine weight transfer was logged: the engine may still sample from the initial "
               "weights", trained and not one_side,
               "no miles step ran with both a trainer and an engine"),
        Signal("Continuous async rollout worker started", r"Continuous async rollout worker started",
               "the async rollout worker is alive",
               "the async rollout worker never started", bool(c.hints(_ASYNC)), "not an async run"),
        Signal("WorkerCrashed", r"WorkerCrashed|RaySystemError", "a worker process died (see its finding)",
               "no worker died", False, "no worker died"),
        Signal("forward_logp_max_diff", r"forward_logp_max_diff",
               "train/inference log-prob alignment is measured each step",
               "train/inference log-prob alignment was not measured (the samples carry no engine log-probs, or "
               "no trainer ran)", trained and not one_side, "no miles training step in these logs"),
        Signal("Alignment check", r"Alignment check", "the step-1 alignment report was printed",
               "no step-1 alignment report: the run stopped before step 1 ended, or --alignment-check off",
               trained and not c.hints(r"alignment[_-]check[= ]+off"), "no miles training step in these logs"),
    ]
    for s in out:
        # A line that quotes the phrase (`Loaded checkpoint from` in a fix text) is not the phrase.
        s.count = sum(f"`{s.phrase}" not in log.lines[i] for log, i in c.grep(s.pattern))
        if s.phrase == "forward_logp_max_diff":  # metrics.jsonl carries it too
            s.count += sum(len(m.series.get("logp_diff", [])) for m in c.metrics if m.name.endswith(".jsonl"))
    return out


@rule
def missing_signals(c: Corpus) -> list[Finding]:
    out = []
    for s in signals(c):
        if s.count or not s.expected:
            continue
        if s.phrase == "weight_sync":
            log = next(log for log in c.logs if log.kind == "miles-train")
            out.append(Finding("no_weight_sync", "no `weight_sync` line although trainer and engine both ran", 0.55,
                               [Evidence(str(log.path), "0 lines matching `weight_sync`")],
                               "the engine never received the trained weights: rollouts come from the initial model",
                               "--debug-weight-sync 1 to log each transfer; --check-weight-update-equal"))
        elif s.phrase == "Continuous async rollout worker started":
            hint = c.hints(_ASYNC)[0]
            out.append(Finding("async_worker_missing", "async run, but no `Continuous async rollout worker started`",
                               0.5, [hint_ev(hint)], "the async rollout worker never started (or its log "
                               "went elsewhere: Ray worker logs)", "check the rollout worker's log under "
                               "~/.ray/session_latest/logs/; RAY_DEDUP_LOGS=0"))
    return out
