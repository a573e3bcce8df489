"""The doctor's knowledge: one rule per symptom of the debugging guide, each from its real signature.

A rule is a function `Corpus -> list[Finding]`, registered with `@rule`. Signatures are the texts that
the failing component really prints (CUDA, SGLang, NCCL, Ray, Megatron, torch inductor), the metric
values miles / Miles / slime / verl / TRL log, and miles' own verdict lines (`Alignment check`,
`weight_sync check FAIL`). Confidence: 0.85-0.95 when the signature names the problem outright, ~0.6
when it needs context the logs may not hold, below 0.5 for "worth a look". How a miles run ended
(crashed, stopped, killed) is `run_state`'s, and ranks above all of these.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from itertools import accumulate

from miles.debug.doctor.findings import Evidence, Finding
from miles.debug.doctor.readers import Corpus, LogFile, MetricSource, Point

RULES: list[Callable[[Corpus], list[Finding]]] = []


def rule(fn):
    RULES.append(fn)
    return fn


def line_ev(log: LogFile, i: int) -> Evidence:
    return Evidence(log.where(i), log.lines[i].strip()[:300])


def point_ev(p: Point) -> Evidence:
    return Evidence(p.where, p.text)


def hint_ev(hint: str) -> Evidence:
    """A `Corpus.hints` entry (`file:line: text` or `config.json: key=value`) as evidence."""
    where, _, text = hint.partition(": ")
    return Evidence(where, text)


LOADED = r"[Ll]oaded checkpoint from (?!`)\S"  # not a line that only quotes the phrase
# After a setting in a hint (`Corpus.hints`): not set off (`colocate=False`, `=None`, `=0`); a flag has no `=`.
NOT_OFF = r"(?!=(False|false|None|0)\b)"
# Per-step summary lines: miles `step 3/10 |`, slime/Miles `step 3: {`, verl `step:3 -`, Megatron `iteration 3/`.
MILES_STEP = re.compile(r"\bstep (\d+)/\d+ \||^\s*(?:\(.*?\)\s*)?.*?\bstep (\d+): \{|\bstep:(\d+) - |"
                        r"\biteration\s+(\d+)/")
TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d(?:[.,]\d+)?)")


def completed_steps(log: LogFile, before: int) -> list[int]:
    """Step ids of the per-step summary lines (miles, slime, verl, Megatron) above line `before`."""
    steps = []
    for line in log.lines[:before]:
        m = MILES_STEP.search(line)
        if m:
            steps.append(int(next(g for g in m.groups() if g is not None)))
    return sorted(set(steps))


def first_step(source: MetricSource, *names: str) -> tuple[int, dict[str, list[Point]]] | None:
    """The run's first step (0 or 1; a resumed run has none) and its finite values for `names`."""
    points = [p for n in names for p in source.series.get(n, []) if not p.counted]
    if not points:
        return None
    step = min(p.step for p in points)
    if step > 1:
        return None
    return step, {n: [p for p in source.series.get(n, []) if p.step == step and math.isfinite(p.value)]
                  for n in names}


def covers_megatron_build(c: Corpus) -> bool:
    """Whether the logs include Megatron building its model, where a checkpoint load would be printed
    (a Ray crash dir, or a log cut with `tail`, often starts later)."""
    return bool(c.grep(r"building \S+ model|using world size|> number of parameters on"))


# -- miles' own verdicts ---------------------------------------------------------------------------

_ALIGN = re.compile(r"Alignment check \| (?P<name>[^|]+?)\s*\| (?P<verdict>WARN|FAIL) \| (?P<value>.*?)"
                    r"(?: \| likely culprit: (?P<culprit>.*?) \| fix: (?P<fix>.*))?$")
_ALIGN_IDS = {"rollout coherence": "garbled_rollout", "log_probs vs ref": "kl_step1",
              "trainer vs engine": "train_engine_mismatch", "response NLL": "instruct_logp",
              "reward signal": "reward_constant", "grad_norm": "grad_norm_high", "MoE routing": "moe_routing_mismatch"}


@rule
def alignment_checks(c: Corpus) -> list[Finding]:
    """miles' step-1 report already names culprit and fix; surface its WARN/FAIL lines."""
    out = []
    for log, i in c.grep(r"Alignment check \| .*\| (?:WARN|FAIL) \|"):
        m = _ALIGN.search(log.lines[i].rstrip())
        if not m:
            continue
        name, verdict, value = m["name"].strip(), m["verdict"], m["value"].strip()
        fid = _ALIGN_IDS.get(name, "alignment_" + re.sub(r"\W+", "_", name))
        if name == "grad_norm" and re.match(r"-?(nan|inf)", value, re.IGNORECASE):
            fid = "nan_grad"
        elif name == "grad_norm" and value == "0":  # no gradient because no reward signal
            fid = "reward_constant"
        elif name == "MoE routing" and verdict == "FAIL":  # most routes differ: the routers' weights differ
            fid = "weight_sync_mismatch"
        out.append(Finding(fid, f"Alignment check {verdict}: {name} ({value})", 0.85 if verdict == "FAIL" else 0.6,
                           [line_ev(log, i)], m["culprit"] or "see the line", m["fix"] or "see the line"))
    return out


@rule
def mismatch_attribution(c: Corpus) -> list[Finding]:
    """miles' mismatch attribution (miles.debug.attribution) re-scored a probe one factor at a time and
    named the factor that moves the train/engine gap: that factor is the culprit."""
    from miles.debug.doctor.knowledge import culprits

    out = []
    for log, i in c.grep(r"Mismatch attribution \| verdict \| .* culprit id: \w+"):
        line = log.lines[i]
        m = re.search(r"verdict \| (?P<factor>[^:]+): (?P<what>.*?) moves the gap (?P<gap>.*?) "
                      r"\| culprit id: (?P<id>\w+)", line)
        if not m or m["id"] not in culprits():
            continue
        moving = [j for j in range(max(0, i - 8), i) if "Mismatch attribution |" in log.lines[j]
                  and ("| baseline |" in log.lines[j] or "moves it" in log.lines[j])]
        known = culprits()[m["id"]]
        out.append(Finding("mismatch_attribution", f"the train/engine log-prob gap is moved by the {m['factor']} "
                           f"({m['what']}: {m['gap']})", 0.9, [line_ev(log, i), *(line_ev(log, j) for j in moving)],
                           f"{known.name} (the {m['factor']} alone moves the gap)", known.fix, kb=m["id"]))
    return out


@rule
def weight_sync_checks(c: Corpus) -> list[Finding]:
    out = []
    for log, i in c.grep(r"weight_sync (?:buffer )?check FAIL|checksum_ok=false"):
        line = log.lines[i]
        parts = re.search(r"likely culprit: (.*?) \| fix: (.*)$", line)
        if "buffer check FAIL" in line:
            out.append(Finding("engine_buffers_dropped", "the engine dropped or changed buffers during weight sync "
                               "(rollouts turn garbled although parameters loaded)", 0.9, [line_ev(log, i)],
                               parts[1] if parts else "the engine released buffers while updating weights",
                               parts[2] if parts else "re-create the buffers after each weight update"))
        else:
            out.append(Finding("weight_sync_mismatch", "engine weights differ from the trainer's after weight sync",
                               0.9, [line_ev(log, i)],
                               parts[1] if parts else "weight-sync or parameter-mapping bug (e.g. a layer-offset "
                                                      "bug with pipeline stages)",
                               parts[2] if parts else "`miles check-weights CKPT ENGINE_URL`; `--debug-weight-sync 2` "
                                                      "names the tensors"))
    return out


# -- the first step: did the weights load, is the rollout coherent, is KL 0 -------------------------

@rule
def checkpoint_not_loaded(c: Corpus) -> list[Finding]:
    out = []
    for log, i in c.grep(r"will not load any checkpoints and will start from random|could not find the metadata file"):
        out.append(Finding("no_checkpoint_loaded", "the trainer started from random weights: no checkpoint found",
                           0.9, [line_ev(log, i)], "--load / --ref-load name a dir with no checkpoint in it "
                           "(Megatron reads latest_checkpointed_iteration.txt)",
                           "point --load / --ref-load at the converted checkpoint dir (and --hf-checkpoint at the HF "
                           "model); check the path exists on every node"))
    loaded = c.grep(LOADED)
    for log in (log for log in c.logs if log.kind == "miles-train"):
        built = [i for i, line in enumerate(log.lines) if "Models in memory:" in line]
        if not built:
            continue  # the run stopped before its models were built: a crash rule has the story
        i = built[-1]
        start = max([j for j, line in enumerate(log.lines[:i]) if re.search(r" miles \d+\.\S+ \| device=", line)],
                    default=0)
        n_loaded = sum(1 for lg, j in loaded if lg is log and start <= j < i)
        n_models = log.lines[i].split("Models in memory:", 1)[1].count("MiB")
        if n_loaded < n_models:
            out.append(Finding("no_checkpoint_loaded", f"{n_models} model(s) built but {n_loaded} `Loaded checkpoint "
                               "from` line(s): parameters did not load", 0.9 if n_loaded == 0 else 0.6,
                               [line_ev(log, i)], "a model was built without loading its weights",
                               "check --hf-checkpoint / --load / --ref-load point at real checkpoints"))
    if not loaded and not out:
        steps = c.grep(r"\bstep \d+: \{|\biteration\s+\d+/")
        megatron = c.hints(r"megatron")
        if steps and megatron and covers_megatron_build(c):
            log, i = steps[0]
            out.append(Finding("no_checkpoint_loaded", "no `loaded checkpoint from` line in a Megatron-based run "
                               "that trained", 0.5, [line_ev(log, i), hint_ev(megatron[0])],
                               "parameters did not load (or the log starts after loading)",
                               "check --load / --ref-load; Megatron prints `successfully loaded checkpoint from`"))
    return out


@rule
def garbled_rollout(c: Corpus) -> list[Finding]:
    out = []
    loaded = bool(c.grep(LOADED))
    for d in c.dumps:
        signs = []
        if d.replacement_frac > 0.05:
            signs.append(f"{d.replacement_frac:.0%} of responses hold U+FFFD (broken bytes)")
        if d.repetition > 0.5:
            signs.append(f"{d.repetition:.0%} of 4-grams repeat (degenerate loops)")
        if d.logp_mean is not None and d.logp_mean < -5:
            signs.append(f"engine log-prob {d.logp_mean:.2f}/token (near-uniform predictions)")
        if not signs:
            continue
        shown = Evidence(str(d.path), f"rollout {d.rollout_id}: {'; '.join(signs)}; e.g. {d.responses[0][:120]!r}")
        if loaded:
            culprit = ("parameters loaded, so: a chat-template mismatch (a pretrained model behind a chat template, "
                       "or the wrong template), or the engine dropped buffers during weight sync")
            fix = ("`miles verify-chat-template --model DIR`; try the instruct model; `--check-weight-update-equal` "
                   "(checks engine buffers); `miles inspect-rollout " + str(d.path) + "`")
        else:
            culprit = "no `Loaded checkpoint from` line: the parameters probably did not load"
            fix = "check --hf-checkpoint / --load / --ref-load; `miles check-weights` against the checkpoint"
        out.append(Finding("garbled_rollout", "garbled rollout" + (" although parameters loaded" if loaded else ""),
                           0.8 if len(signs) > 1 or d.replacement_frac > 0.2 else 0.65, [shown], culprit, fix,
                           kb="chat_template" if loaded else "params_not_loaded"))
    return out


@rule
def kl_at_step_one(c: Corpus) -> list[Finding]:
    """At step 1 actor and reference are the same weights: log_probs == ref_log_probs, KL == 0."""
    out = []
    for src in c.metrics:
        first = first_step(src, "kl", "logp", "ref_logp", "kl_loss")
        if first is None:
            continue
        step, pts = first
        measures = [(abs(p.value), p, 1.0) for p in pts["kl"]]
        for lp in pts["logp"][:1]:
            for ref in pts["ref_logp"][:1]:
                measures.append((abs(lp.value - ref.value), lp, 1.0))
                measures.append((abs(lp.value - ref.value), ref, 1.0))
        if not measures:  # only a training-time KL loss: small values are updates within the step, not bugs
            measures = [(abs(p.value), p, 0.7) for p in pts["kl_loss"] if abs(p.value) > 1]
        if not measures:
            continue
        value, _, weight = max(measures, key=lambda m: m[0])
        evidence = [point_ev(p) for v, p, _ in measures if v == value or v > 1e-4][:4]
        if value > 1:
            out.append(Finding("kl_step1", f"KL > 1 at step {step} (KL / |log_probs - ref_log_probs| {value:.3g}): "
                               "the actor and the reference differ", 0.85 * weight, evidence,
                               "configuration: --ref-load is another checkpoint than the initial policy, or the two "
                               "models run with different precision / parallelism",
                               "point --ref-load at the initial policy (miles: leave it unset); same --precision; "
                               "re-check TP/PP/CP sizes of actor and reference", kb="parallel_precision_config"))
        elif value > 1e-4:
            out.append(Finding("kl_step1", f"KL != 0 at step {step} (KL / |log_probs - ref_log_probs| {value:.3g}, "
                               "above kernel jitter 1e-4)", 0.75 * weight, evidence,
                               "non-deterministic fused attention (Transformer Engine under context parallel) or "
                               "another non-deterministic kernel in one of the two forwards",
                               "--attention-backend flash (forces deterministic Flash Attention in Megatron/TE); in "
                               "miles --attention-backend eager or --deterministic-mode"))
    return out


_INSTRUCT = re.compile(r"instruct|[-_]chat\b|[-_]it$|[-_]sft\b", re.IGNORECASE)
_MODEL = re.compile(r"(?:hf[_-]checkpoint|model[_.]path|model_name_or_path|pretrain|--model)['\"]?\s*[=: ]\s*"
                    r"['\"]?([^\s'\",]+)")


def instruct_models(c: Corpus) -> list[str]:
    """Model paths named in configs / launch lines that look like instruct (chat) models."""
    found = []
    for hint in c.hints(_MODEL.pattern):
        for m in _MODEL.finditer(hint):
            name = m.group(1).rstrip("/").split("/")[-1]
            if _INSTRUCT.search(name):
                found.append(hint)
    return found


@rule
def instruct_logp(c: Corpus) -> list[Finding]:
    """~0.8 nats/token on an instruct model sampling its own answers: its prompts are not in its format."""
    models = instruct_models(c)
    if not models:
        return []
    no_template = c.hints(r"apply_chat_template=(False|false|0)\b")
    out = []
    for src in c.metrics:
        first = first_step(src, "logp", "engine_logp")
        if first is None:
            continue
        step, pts = first
        p = (pts["logp"] or pts["engine_logp"] or [None])[0]
        if p is None or not 0.6 <= -p.value <= 3.0:
            continue
        evidence = [point_ev(p), hint_ev(models[0])]
        if no_template:
            evidence.append(hint_ev(no_template[0]))
        out.append(Finding("instruct_logp", f"log-prob {p.value:.2f}/token at step {step} on an instruct model "
                           "(normal is ~0.1-0.4)", 0.75 if no_template else 0.6, evidence,
                           "chat-template mismatch: the prompts are not in the format the model was trained on"
                           + (" (the chat template is not applied)" if no_template else ""),
                           "--apply-chat-template; `miles verify-chat-template --model DIR`; check --input-key holds "
                           "the user turn"))
    return out


# -- over many steps ------------------------------------------------------------------------------

def find_collapse(values: list[float]) -> tuple[int, int, float, float] | None:
    """(peak index, drop index, peak, final) when a series rose and then fell back to where it started.

    Window means over an eighth of the run smooth out per-step noise; the fall must exceed 4x the
    noise of such a mean and 30% of the peak, so a noisy flat series is no collapse."""
    n = len(values)
    if n < 30:
        return None
    w = max(5, n // 8)
    sums = [0.0, *accumulate(values)]
    rolling = [(sums[k + 1] - sums[max(0, k + 1 - w)]) / min(k + 1, w) for k in range(n)]
    base, final = rolling[w - 1], rolling[-1]
    k_peak = max(range(w - 1, n), key=rolling.__getitem__)
    peak = rolling[k_peak]
    noise = statistics.pstdev(values) / math.sqrt(w)
    if peak - final <= max(4 * noise, 0.3 * abs(peak)) or final > base + 0.25 * (peak - base):
        return None
    k_drop = next(k for k in range(k_peak, n) if rolling[k] < (peak + final) / 2)
    return k_peak, k_drop, peak, final


_MOE = r"\bmoe\b|moe[_-]|num_experts|num_local_experts|n_routed_experts|expert[_-]model[_-]parallel|mixtral|-a\d+b\b"


@rule
def moe_collapse(c: Corpus) -> list[Finding]:
    out = []
    for src in c.metrics:
        pts = list({p.step: p for p in reversed(src.series.get("reward", [])) if math.isfinite(p.value)}.values())
        pts.sort(key=lambda p: p.step)  # one value per step (verl logs the score twice)
        collapse = find_collapse([p.value for p in pts])
        if collapse is None or pts[collapse[1]].step < 20:
            continue
        k_peak, k_drop, peak, final = collapse
        evidence = [point_ev(pts[k_peak]), point_ev(pts[k_drop]), point_ev(pts[-1])]
        moe = c.hints(_MOE)
        replay = c.hints(r"routing[_-]replay")
        what = f"reward collapses after step ~{pts[k_drop].step} (peak {peak:.3g}, now {final:.3g})"
        if moe:
            out.append(Finding("moe_collapse", "MoE training collapse: " + what, 0.55 if replay else 0.8,
                               evidence + [hint_ev(moe[0])],
                               "expert routing differs between the engine (rollout) and the trainer: routing not "
                               "replayed" + (" although routing replay is on (check it reaches the trainer)"
                                             if replay else " (R3 off)"),
                               "--use-rollout-routing-replay (R3: replay the engine's expert choices in training) or "
                               "--use-routing-replay; MoE in Megatron also needs --moe-permute-fusion"))
        else:
            out.append(Finding("reward_collapse", what, 0.45, evidence,
                               "the policy drifted: learning rate too high, or an off-policy gap between engine "
                               "and trainer growing over steps",
                               "lower --lr; --use-tis; watch train/train_rollout_logprob_abs_diff over steps"))
    return out


@rule
def routing_mismatch(c: Corpus) -> list[Finding]:
    """miles' `train/routing_mismatch_frac` above 0 with routing replay off: the trainer's MoE routers
    pick other experts than the engine's did for some tokens."""
    points = [p for src in c.metrics for p in src.series.get("routing_mismatch", []) if math.isfinite(p.value)]
    worst = max(points, key=lambda p: p.value, default=None)
    if worst is None or worst.value <= 0 or c.hints(r"use[_-]rollout[_-]routing[_-]replay['\"]?\s*[:=]\s*true|"
                                                     r"--use-rollout-routing-replay"):
        return []
    return [Finding("moe_routing_mismatch", f"MoE routes differ between engine and trainer (routing_mismatch_frac up "
                    f"to {worst.value:.3g})", 0.7, [point_ev(worst)],
                    "MoE routing not preserved: the trainer routes some tokens to other experts than the engine "
                    "chose, so it optimises a policy that did not generate the data (MoE collapse after ~50 steps)",
                    "--use-rollout-routing-replay (R3: replay the engine's expert choices in training)")]


# transformers' warning when a checkpoint lacks weights the model has.
_NEWLY_INITIALIZED = r"were not initialized from the model checkpoint|newly initialized: \["


@rule
def nan_gradients(c: Corpus) -> list[Finding]:
    evidence = []
    for src in c.metrics:
        bad = [p for p in src.series.get("grad_norm", []) if not math.isfinite(p.value)]
        evidence += [point_ev(p) for p in bad[:2]]
    for log, i in c.grep(r"found (?:NaN|Inf|nan|inf) in local grad norm|(?:NaN|nan) or (?:Inf|inf) found in input "
                         r"tensor|[Ll]oss is (?:nan|inf|NaN|Inf)\b|[Dd]etected (?:NaN|Inf|nan|inf) (?:in|gradient)|"
                         r"\| grad_norm -?(?:nan|inf) \|")[:3]:
        evidence.append(line_ev(log, i))
    if not evidence:
        return []
    upstream = nonfinite_reward_evidence(c)
    if upstream:  # non-finite rewards or advantages make the loss and its gradients non-finite: they are the cause
        return [Finding("nan_grad", "NaN/Inf gradients after non-finite rewards or advantages", 0.9,
                        upstream[:2] + evidence[:1], NONFINITE_REWARD_CULPRIT, NONFINITE_REWARD_FIX, kb="reward_bug")]
    fresh = c.grep(_NEWLY_INITIALIZED)
    if fresh:  # weights the checkpoint did not hold: what they start from, not the template, makes the NaN
        return [Finding("nan_grad", "NaN/Inf gradients after weights were newly initialized at load", 0.9,
                        [line_ev(*fresh[0])] + evidence[:1],
                        "parameters not loaded: the checkpoint did not hold these weights (a merge or save that "
                        "dropped or renamed them, a model class that does not match it), so they start from fresh, "
                        "on some loading paths uninitialized, memory",
                        "check the checkpoint's keys against the model's (the load warning lists them); re-save or "
                        "re-merge the checkpoint, or load it with the model class it was saved from",
                        kb="params_not_loaded")]
    fp8 = c.hints(r"fp8")
    culprit = ("activation overflow in FP8, or a bad chat template" if fp8 else
               "a bad chat template (garbage prompts give extreme log-probs), or activation overflow in low precision")
    if fp8:
        evidence.append(hint_ev(fp8[0]))
    return [Finding("nan_grad", "NaN/Inf gradients", 0.9, evidence, culprit,
                    ("turn FP8 off (drop --fp8-format) to confirm; " if fp8 else "--precision fp32 to confirm; ")
                    + "`miles verify-chat-template --model DIR`; keep --clip-grad 1.0",
                    kb="fp8_overflow" if fp8 else "chat_template")]


@rule
def nonfinite_rewards(c: Corpus) -> list[Finding]:
    """NaN/Inf in the reward series: every other metric of that step is computed from it. Without a series, a
    log or report line giving a reward or advantage the value NaN/Inf ("critic/rewards/mean:nan", "the advantages
    are NaN")."""
    bad = _nonfinite_rewards(c)
    if bad:
        steps = sorted({p.step for p in bad})
        where = ", ".join(map(str, steps[:3])) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
        symptom, evidence = f"non-finite rewards (NaN/Inf) at step {where}", [point_ev(p) for p in bad[:2]]
    elif evidence := _nonfinite_reward_lines(c):
        symptom = "non-finite rewards or advantages (NaN/Inf)"
    else:
        return []
    return [Finding("reward_nonfinite", symptom, 0.85, evidence[:2], NONFINITE_REWARD_CULPRIT, NONFINITE_REWARD_FIX,
                    kb="reward_bug")]


NONFINITE_REWARD_CULPRIT = ("the reward function returned NaN/Inf for some samples (a division by zero or an unparsed "
                            "answer turned into float('nan'), a reward model's overflow), or a reward of None averaged "
                            "in; the group's advantages, the loss and its gradients follow it")
NONFINITE_REWARD_FIX = ("read the samples of that step (`miles inspect-rollout DUMP`, "
                        "`--debug-rollout-print-every 1`); make the reward return a finite number for every response, "
                        "0.0 for one it cannot score")
# A reward or advantage given the value NaN/Inf: as a logged metric (`critic/rewards/mean:nan`, `reward=nan`), or in
# a sentence ("the advantages are NaN", "NaN rewards"), within one line. Not a NaN elsewhere on a reward's line
# ("reward 0.000 | loss nan"): that is the loss's.
_NONFINITE_REWARD = (r"(?i)\b(?:rewards?|advantages?)(?:[/_.][\w/.]*)?[ \t]*[:=][ \t]*-?(?:nan|inf)\b|"
                     r"\b(?:rewards?|advantages?)[ \t]+(?:are|is|was|were|become|becomes|became|turns?|turned|goes|"
                     r"go|went)[ \t]+(?:all[ \t]+)?-?(?:nan|inf)\b|"
                     r"\b(?:nan|non-finite)[ \t]+(?:rewards?|advantages?)\b")


def _nonfinite_rewards(c: Corpus) -> list[Point]:
    return [p for src in c.metrics for p in src.series.get("reward", []) if not math.isfinite(p.value)]


def _nonfinite_reward_lines(c: Corpus) -> list[Evidence]:
    return [line_ev(log, i) for log, i in c.grep(_NONFINITE_REWARD)[:2]]


def nonfinite_reward_evidence(c: Corpus) -> list[Evidence]:
    """The reward series' non-finite points, else the log lines giving a reward or advantage the value NaN/Inf."""
    return [point_ev(p) for p in _nonfinite_rewards(c)] or _nonfinite_reward_lines(c)


@rule
def rewards_constant(c: Corpus) -> list[Finding]:
    culprit = ("the reward never fires: labels read from the wrong key (a --label-key typo leaves them empty), "
               "or the responses' answer format is not what the reward parses")
    fix = ("check --label-key against the data's keys; read samples (`--debug-rollout-print-every 1`, "
           "`miles inspect-rollout DUMP`); make the prompt ask for the format --rm-type parses (e.g. \\boxed{})")
    out = []
    for log, i in c.grep(r"rows of .* have no .* label: their reward is 0"):
        out.append(Finding("reward_constant", "prompts without labels: their reward is 0", 0.9, [line_ev(log, i)],
                           "--label-key names a key the data rows lack (typo?)", fix))
    for src in c.metrics:
        pts = [p for p in src.series.get("reward", []) if math.isfinite(p.value)]
        if len(pts) < 2 or len({p.value for p in pts}) > 1:
            continue
        value = pts[0].value
        what = "all zero" if value == 0 else f"constant at {value:.3g}"
        out.append(Finding("reward_constant", f"rewards {what} over {len(pts)} steps: no learning signal",
                           (0.8 if value == 0 else 0.6) if len(pts) >= 3 else 0.55,
                           [point_ev(pts[0]), point_ev(pts[-1])], culprit, fix))
    dumps = [d for d in c.dumps if d.samples > 1]
    if dumps and all(d.labels_missing == d.samples for d in dumps):
        out.append(Finding("reward_constant", "no sample in the rollout dumps has a label", 0.85,
                           [Evidence(str(d.path), f"labels missing {d.labels_missing}/{d.samples}") for d in dumps],
                           "--label-key names a key the data rows lack (typo?)", fix))
    elif dumps and len({r for d in dumps for r in d.rewards}) == 1:
        r = dumps[0].rewards[0]
        out.append(Finding("reward_constant", f"every sample in the rollout dumps has reward {r:g}", 0.7,
                           [Evidence(str(d.path), f"{d.samples} samples, rewards all {r:g}") for d in dumps],
                           culprit, fix))
    return out
