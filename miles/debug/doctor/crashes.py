"""Rules whose signature is an error text: CUDA, SGLang, NCCL, Ray, torch inductor, and the errors that name their
culprit alone (an API missing between versioned packages, batch sizes that do not divide, a length limit, ...).

A crash prints many errors; the useful one is usually the first (a worker's OOM, reported later as
`RaySystemError` by the driver and as an NCCL abort by its peers). `first_error` finds it across files,
by timestamp where the logs have them.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from miles.debug.doctor.findings import Finding
from miles.debug.doctor.readers import Corpus, LogFile
from miles.debug.doctor.rules import NOT_OFF, TIMESTAMP, completed_steps, hint_ev, line_ev, rule

_SGLANG_CONTEXT = re.compile(r"sglang|Scheduler|TP\d+\]|tp_worker|model_runner|cuda_graph_runner", re.IGNORECASE)


def near(log: LogFile, i: int, pattern: str | re.Pattern, before: int = 60, after: int = 5) -> int | None:
    """Index of the closest line within the window around `i` matching `pattern` (the line itself first)."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    lo, hi = max(0, i - before), min(len(log.lines), i + after + 1)
    for j in sorted(range(lo, hi), key=lambda j: abs(j - i)):
        if rx.search(log.lines[j]):
            return j
    return None


@rule
def illegal_memory_access(c: Corpus) -> list[Finding]:
    hits = c.grep(r"illegal memory access|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS")
    if not hits:
        return []
    in_engine = [(log, i) for log, i in hits if log.kind == "sglang" or near(log, i, _SGLANG_CONTEXT, 80) is not None]
    shown = [line_ev(log, i) for log, i in (in_engine or hits)[:3]]
    shared = c.hints(rf"colocate{NOT_OFF}|mem[_-]fraction[_-]static")  # an engine on the GPU
    if not (in_engine or shared):  # the guide's out-of-memory in disguise is an engine's; this is any kernel's fault
        return [Finding("cuda_illegal_memory_access", "`illegal memory access` in CUDA code, no inference engine in "
                        "sight", 0.65, shown,
                        "a kernel read or wrote out of bounds: a kernel's bug at these shapes or dtypes (FP8, fused or "
                        "custom kernels), or a build of it for another torch/CUDA version",
                        "rerun with CUDA_LAUNCH_BLOCKING=1 (or under compute-sanitizer) to name the kernel; try "
                        "without the fused/FP8 kernel, and check its package was built for this torch and CUDA")]
    return [Finding("illegal_memory_access", "`illegal memory access` in the " + ("SGLang engine" if in_engine else
                    "CUDA code, an engine sharing the GPU"), 0.85 if in_engine else 0.65,
                    shown + ([] if in_engine else [hint_ev(shared[0])]),
                    "an out-of-memory in disguise: the engine's static KV-cache pool leaves too little room for "
                    "activations and CUDA graphs",
                    "lower --sglang-mem-fraction-static (e.g. 0.7, then 0.6); if it persists, rerun with "
                    "CUDA_LAUNCH_BLOCKING=1 to name the kernel")]


@rule
def out_of_memory(c: Corpus) -> list[Finding]:
    out = []
    for log, i in c.grep(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation"):
        if any(f.evidence[0].where.startswith(f"{log.path}:") for f in out):
            continue  # one finding per file: a traceback repeats the error
        steps = completed_steps(log, i)
        if not steps:  # the trainer log may be elsewhere: metrics rows are written at the end of each step
            rows = [m for m in c.metrics if m.name.endswith("metrics.jsonl")]
            steps = sorted({p.step for m in rows for s in m.series.values() for p in s})
        colocate = c.hints(rf"(colocate|offload[_-]train){NOT_OFF}|release_memory_occupation|"
                           r"resume_memory_occupation")
        evidence = [line_ev(log, i)] + ([hint_ev(colocate[0])] if colocate else [])
        if colocate and len(steps) == 1:
            out.append(Finding("oom_colocate_step2", "OOM at step 2 in colocate mode (step 1 completed)", 0.9, evidence,
                               "the trainer's offload -> reload cycle collides with the SGLang engine on the same "
                               "GPUs: the engine's memory fraction leaves the trainer too little",
                               "--sglang-mem-fraction-static 0.7 (or 0.6)"))
        else:
            where = f" after {len(steps)} completed step(s)" if steps else " before the first step completed"
            out.append(Finding("oom", "CUDA out of memory" + where + (" in colocate mode" if colocate else ""),
                               0.7 if colocate else 0.65, evidence,
                               "activations / optimizer state of the trainer, or the engine's KV cache, exceed GPU "
                               "memory",
                               "lower --micro-batch-size (Megatron: --max-tokens-per-gpu) or "
                               "--rollout-max-response-len" + ("; --sglang-mem-fraction-static 0.7 (or 0.6)" if
                                                               colocate else "")))
    for log, i in c.grep(r"Not enough memory\. Please try to increase --mem-fraction-static")[:1]:
        out.append(Finding("sglang_kv_too_small", "SGLang could not allocate its KV cache", 0.8, [line_ev(log, i)],
                           "--sglang-mem-fraction-static is too low for the model's weights plus the KV cache",
                           "raise --sglang-mem-fraction-static, or give the engine more GPUs (tensor parallel)"))
    return out


@rule
def inductor_cache(c: Corpus) -> list[Finding]:
    for log, i in c.grep(r"JSONDecodeError:"):  # the exception line, not the `raise` inside json
        j = near(log, i, r"_inductor|torchinductor", before=80)
        if j is not None:
            return [Finding("inductor_cache", "`JSONDecodeError` from torch inductor", 0.9,
                            [line_ev(log, i), line_ev(log, j)], "a corrupt inductor cache (a half-written entry from "
                            "a killed or concurrent process)",
                            "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (or delete the cache: "
                            "rm -rf /tmp/torchinductor_$USER)")]
    return []


# An API that is not there: a name one package imports from another, an attribute or keyword argument that
# one version has and another does not, a compiled extension built against another torch (`undefined symbol`).
# Not `No module named` (a package not installed: an install question, not a version pair).
_API_MISMATCH = (r"(?i:can ?not import) (?:name )?['\"`]?\w+|module ['\"][\w.]+['\"] has no attribute|"
                 r"object has no attribute ['\"]\w+|got an unexpected keyword argument|undefined symbol")


@rule
def api_mismatch(c: Corpus) -> list[Finding]:
    """An API missing between two packages, in a report that gives their versions: the maintainers' first answer
    is the version pair. Without versions the same errors are as often a user's own code (a keyword the class
    never took, a local directory shadowing the package), so the rule stays silent."""
    from miles.debug.doctor.facts import read_versions, versions_text

    hits = c.grep(_API_MISMATCH)
    if not hits:
        return []
    versions = read_versions("\n".join(log.text for log in c.logs))
    if not versions:
        return []
    return [Finding("api_mismatch", f"an API missing between installed packages ({versions_text(versions)})", 0.6,
                    [line_ev(log, i) for log, i in hits[:2]],
                    "incompatible library versions: one package calls a name, attribute or argument that the "
                    "installed version of another does not have",
                    "install the versions the framework lists as tested together (its requirements or docs); "
                    "compare `pip freeze` against them, and rebuild compiled extensions (flash-attn) for this torch",
                    kb="version_incompat")]


class Signature(NamedTuple):
    """An error text that names its culprit alone: a finding `id` for each input a line of which matches
    `pattern`."""
    id: str
    pattern: str
    symptom: str
    culprit: str
    fix: str
    kb: str  # the culprit's id


SIGNATURES = [
    Signature(
        id="batch_not_divisible",
        pattern=r"(?i)(?:batch|generations|micro|mini)[^.\n]{0,80}divisible|only support equal chunk",
        symptom="batch sizes that do not divide",
        culprit="the batch arithmetic: the global batch (processes x per-device batch x accumulation steps) is not a "
                "multiple of the group size (samples per prompt) or of the data-parallel chunks",
        fix="make the global batch a multiple of the samples per prompt and of the data-parallel size (and the "
            "mini-batch of the micro-batch); check what the per-rank normalisation leaves",
        kb="loss_aggregation_config"),
    Signature(
        id="no_chat_template",
        pattern=r"chat_template is not set|does not have a chat template|no chat template",
        symptom="the tokenizer has no chat template",
        culprit="a chat request or --apply-chat-template on a tokenizer without a template (a base model's, or one "
                "saved without it)",
        fix="use the instruct model's tokenizer, or give the tokenizer a template (the engine's chat-template "
            "option); `miles verify-chat-template --model DIR` checks it",
        kb="chat_template"),
    # vLLM's and SGLang's messages (miles serve returns SGLang's)
    Signature(
        id="over_max_length",
        pattern=r"maximum context length (?:is|of) \d+|longer than the model's context length|"
                r"is larger than (?:the )?max_length|exceeds? (?:the )?max_model_len|longer than the maximum",
        symptom="a sequence longer than a configured maximum length",
        culprit="the length limits do not fit the data: prompt + response longer than the engine's max model length "
                "or the trainer's max length (a prompt filter off, or measuring in other units)",
        fix="raise the limit to cover prompt + response (--rollout-max-prompt-len + --rollout-max-response-len), or "
            "filter or truncate the long prompts before they reach it",
        kb="max_length_truncation"),
    Signature(
        id="rope_config_mismatch",
        pattern=r"(?:rope_theta|rotary_base|rope_scaling)[^\n]{0,80}(?:not equal|mismatch|differ|!=)",
        symptom="RoPE settings that differ between two configs",
        culprit="the rotary base or scaling differ between the checkpoint's config and the trainer's or engine's "
                "arguments: the two sides compute different positions",
        fix="take rope_theta and rope_scaling from the checkpoint's config.json on both sides",
        kb="engine_trainer_kernel_mismatch"),
    Signature(
        id="param_name_missing",
        pattern=r"KeyError: '[\w.]+\.(?:weight|bias|\w*proj)'",
        symptom="a parameter name not found while mapping weights",
        culprit="the weight-name mapping between checkpoint, trainer and engine lacks this parameter (a new layer "
                "type such as MTP or fused experts, a renamed module)",
        fix="add the parameter to the converter's or bridge's name mapping, or use a version that knows this model",
        kb="param_mapping"),
    Signature(
        id="vocab_size_mismatch",
        pattern=r"size mismatch for [\w.]*(?:embed_tokens|lm_head|wte|word_embeddings)",
        symptom="the embedding's size differs between checkpoint and model",
        culprit="a vocabulary size mismatch: tokens added to the tokenizer (or another tokenizer) and the embeddings "
                "resized on one side only",
        fix="resize the token embeddings to len(tokenizer) on both sides; load the tokenizer saved with the checkpoint",
        kb="tokenizer_mismatch"),
    Signature(
        id="compile_cache_race",
        pattern=r"\.tmp\.pid_",
        symptom="a compile cache's temporary file gone mid-write",
        culprit="a Triton/inductor compile cache shared by concurrent processes: one removes or renames another's "
                "temporary file",
        fix="a cache directory per process or node (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR), or "
            "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1",
        kb="inductor_cache"),
    Signature(
        id="tokenizer_class_unknown",
        pattern=r"Tokenizer class \w+ does not exist or is not currently imported",
        symptom="the tokenizer's config names a class this transformers does not have",
        culprit="incompatible library versions: the tokenizer was saved by a newer transformers (its "
                "tokenizer_config.json names a class added since)",
        fix="upgrade transformers to the version the model card names (or the one that saved it), or set the config's "
            "tokenizer_class to one this version has",
        kb="version_incompat"),
]


@rule
def error_signatures(c: Corpus) -> list[Finding]:
    """A finding for each of SIGNATURES whose pattern a log line matches, its first two lines as evidence."""
    return [Finding(sig.id, sig.symptom, 0.6, [line_ev(log, i) for log, i in hits[:2]], sig.culprit, sig.fix, kb=sig.kb)
            for sig in SIGNATURES if (hits := c.grep(sig.pattern))]


_NCCL_TIMEOUT = (r"Watchdog caught collective operation timeout|NCCL [Tt]imeout|milliseconds before timing out|"
                 r"Some NCCL operations have failed or timed out|NCCL communicator was aborted|"
                 r"NCCL WARN .*(?:[Tt]imeout|timed out)")
_WEIGHT_SYNC = r"weight_sync|update_weights|update_weight|broadcast_bucket|init_weights_update_group|OpType=BROADCAST"


@rule
def nccl_timeout(c: Corpus) -> list[Finding]:
    hits = c.grep(_NCCL_TIMEOUT)
    if not hits:
        return []
    sync = c.grep(_WEIGHT_SYNC)
    evidence = [line_ev(log, i) for log, i in hits[:3]]
    if sync:  # the last weight-sync line before (or near) the hang
        evidence.append(line_ev(*sync[-1]))
    warn = c.grep(r"NCCL WARN")
    evidence += [line_ev(log, i) for log, i in warn[:1]]
    return [Finding("nccl_timeout", "NCCL hang / timeout" + (" during weight sync" if sync else ""),
                    0.85 if sync else 0.65, evidence,
                    "a collective never completed: a rank stuck or dead, a mismatched broadcast group, or a first "
                    "sync slower than the timeout",
                    "NCCL_TIMEOUT=900 (the guide's value); NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL,P2P "
                    "NCCL_DEBUG_FILE=/tmp/nccl_%h_%p.log to see where each rank stops; miles: --debug-weight-sync 1")]


# -- Ray: which worker died, and the first error before it ------------------------------------------

_CRASH = (r"WorkerCrashed|RaySystemError|RayActorError|ActorDiedError|The actor died unexpectedly|"
          r"A worker died or was killed")
_CONSEQUENCES = {"RaySystemError", "RayActorError", "ActorDiedError", "WorkerCrashedError", "RayTaskError",
                 "ActorUnavailableError"}
# An exception line ending a traceback (after Ray's `(Actor pid=N)` / `[rank0]:` prefixes), or a fatal signal.
ERROR_LINE = re.compile(r"^[ \t]*(?:\([^)\n]*\)[ \t]*)?(?:\[[^\]\n]*\][ \t]*)*(?:[\w.]+\.)?"
                        r"(?P<exc>[A-Z]\w*(?:Error|Exception))(?:\(\w+\))?(?::|$)|CUDA error:|Segmentation fault|"
                        r"Fatal Python error|killed due to memory pressure|Killed$", re.MULTILINE)


def _timestamp(log: LogFile, i: int) -> str | None:
    for j in range(i, max(-1, i - 50), -1):
        m = TIMESTAMP.search(log.lines[j])
        if m:
            return f"{m[1]} {m[2].replace(',', '.')}"
    return None


def error_lines(c: Corpus) -> list[tuple[LogFile, int]]:
    found = []
    for log, i in c.grep(ERROR_LINE.pattern):
        m = ERROR_LINE.search(log.lines[i])
        if m and m.group("exc") not in _CONSEQUENCES and not re.search(_CRASH, log.lines[i]):
            found.append((log, i))
    return found


def first_error(c: Corpus, crash: tuple[LogFile, int], pids: list[str]) -> tuple[LogFile, int] | None:
    errors = error_lines(c)
    for pid in pids:  # the dead worker's own log (Ray names it worker-<id>-<job>-<pid>.err)
        own = [(log, i) for log, i in errors if re.search(rf"-{pid}\.(?:err|out|log)$", log.path.name)]
        if own:
            return own[0]
    per_file: dict = {}
    for log, i in errors:
        per_file.setdefault(log.path, (log, i))
    stamped = [(ts, log, i) for log, i in per_file.values() if (ts := _timestamp(log, i))]
    if stamped:
        _, log, i = min(stamped, key=lambda t: t[0])
        return log, i
    log, k = crash
    before = [(lg, i) for lg, i in errors if lg is log and i < k]
    return before[0] if before else (errors[0] if errors else None)


@rule
def worker_crashed(c: Corpus) -> list[Finding]:
    hits = c.grep(_CRASH)
    if not hits:
        return []
    log, k = hits[0]
    # Ray's report under the crash line, up to the next log record (its own timestamp): another worker's story.
    end = next((j for j in range(k + 1, min(len(log.lines), k + 30)) if TIMESTAMP.match(log.lines[j])), k + 30)
    window = " ".join(log.lines[k:end])
    pids = list(dict.fromkeys(re.findall(r"\bpid[=: ]+(\d+)", window)))
    who = [f"pid {p}" for p in pids[:2]]
    who += [f"rank {r}" for r in dict.fromkeys(re.findall(r"\b[Rr]ank[=: ]*(\d+)", window))][:2]
    who += list(dict.fromkeys(re.findall(r"\b(\w+(?:Actor|Worker)\w*)(?=\.|\s|\()", window)))[:1]
    who += [f"ip {ip}" for ip in dict.fromkeys(re.findall(r"\bip[=: ]+([\d.]+)", window))][:1]
    first = first_error(c, (log, k), pids)
    evidence = [line_ev(log, k)] + ([line_ev(*first)] if first else [])
    culprit = (f"the first error before it: `{first[0].lines[first[1]].strip()[:200]}` ({first[0].where(first[1])})"
               if first else "no error line found before the crash: the process was killed (OOM killer? preempted?)")
    return [Finding("worker_crashed", "a Ray worker died" + (f" ({', '.join(who)})" if who else ""), 0.85, evidence,
                    culprit, f"read the first error{' at ' + first[0].where(first[1]) if first else ''}, not the "
                    "RaySystemError after it; RAY_DEDUP_LOGS=0 shows every worker's lines; worker logs: "
                    "~/.ray/session_latest/logs/worker-*" + (f"-{pids[0]}.err" if pids else ".err"))]


def unrecognised_error(c: Corpus) -> list[Finding]:
    """Not a rule: when no rule matched, an error line is still worth pointing at."""
    errors = error_lines(c)
    if not errors:
        return []
    log, i = errors[0]
    return [Finding("unrecognised_error", "an error the doctor does not recognise", 0.3, [line_ev(log, i)],
                    "unknown: read the traceback that ends here",
                    f"read {log.where(i)} and the lines above it; if it is a worker's, it is usually the cause")]
