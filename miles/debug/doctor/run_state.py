"""How each miles run ended, read from the end of its `train.log` and from its lock file.

`miles train` ends every run it can with one line in train.log (exact text, after the timestamp):
    INFO Done: N steps; metrics in <dir>/metrics.jsonl                     finished
    ERROR Crashed: <Type>: <message>, then the traceback, line by line     crashed (exit 1)
    ERROR error: <message>                                                 a usage error (2) or failed check (3)
    WARNING Stopped by SIGTERM during step 3 of 10; ...; resume with --load <dir>   a signal (143; SIGINT 130)
    ERROR Stopping: 3 consecutive steps with non-finite values (...)       the non-finite guard (3), after
                                                                           `Skipped step N: non-finite ...` lines
A run killed hard (kill -9, the OOM killer, a lost node) writes nothing: its log just stops. While a
run lives it holds `<run dir>/.miles.lock` ({"pid", "host", "started", "command_line"}), removed at
a clean exit. So a log with no ending line is
  - a run in progress when the lock's pid is alive on this host: no finding (it is no death), only a
    line in the report's run list;
  - a killed run otherwise: the lock's pid is dead (0.9), there is no usable lock (0.7: also what an
    older miles leaves after an error it did not log), or the lock is another host's, whose processes
    the doctor cannot see (0.5; the finding says so).
A resumed run appends to the same train.log: only the last invocation counts, so an ending followed by
a new start line (`miles X | device=...`) is an earlier invocation's.

These findings are `fate`s: listed before every symptom (findings.py). Confidence 0.95 where a line
names the end; 0.6 for a signal (resumable, and maybe stopped on purpose). Logs of other frameworks
(not `miles-train`) get none of this.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from miles.debug.doctor.files import LOCK_NAME
from miles.debug.doctor.findings import Evidence, Finding
from miles.debug.doctor.readers import Corpus, LogFile
from miles.debug.doctor.rules import line_ev, rule

_PREFIX = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? [A-Z]+ "  # miles' `%(asctime)s %(levelname)s `
_LOG_PREFIX = re.compile(_PREFIX)
_KINDS = ("finished", "crashed", "error", "signal", "nonfinite")
_END = re.compile(_PREFIX + r"(?:(?P<finished>Done: \d+ steps?\b)|(?P<crashed>Crashed: )|(?P<error>error: )|"
                  r"(?P<signal>Stopped by SIG[A-Z]+)|(?P<nonfinite>Stopping: .*non-finite))", re.MULTILINE)
_START = re.compile(_PREFIX + r"miles \d+\.\S+ \| device=", re.MULTILINE)
_STEP = re.compile(_PREFIX + r"step (\d+)/(\d+) \|", re.MULTILINE)
_SKIPPED = re.compile(_PREFIX + r"Skipped step (\d+): non-finite (.*?)(?: \(|;|$)", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?')
# Frames of installed packages and the standard library, except miles itself wherever it is installed.
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]|^<")
_MILES_CODE = re.compile(r"[/\\]miles[/\\](?:(?:cli|rollout|train|bridge|debug|data|utils|testing)[/\\]|"
                         r"(?:loop|config|errors|__main__)\.py$)")
MAX_TRACEBACK = 400  # lines after `Crashed:`
PID_REUSE_SLACK_S = 120  # a process that started this long after the lock was written is another one


@dataclass
class RunState:
    dir: Path
    log: LogFile
    state: str  # finished | crashed | error | signal | nonfinite | killed | running
    end: int | None  # index in log.lines of the ending line; None when the log has none
    detail: str  # one line for the report's run list

    def to_dict(self) -> dict:
        return {"dir": str(self.dir), "state": self.state, "detail": self.detail}


def run_states(c: Corpus) -> list[RunState]:
    """One state per miles train.log read (the log's dir is the run dir)."""
    out = []
    for log in (log for log in c.logs if log.kind == "miles-train"):
        lock, lock_text = _lock_state(c.locks.get(log.path.parent))
        end = _ending(log)
        if lock == "alive":
            out.append(RunState(log.path.parent, log, "running", None, f"in progress: {lock_text}; "
                                f"{_steps_text(log)} (no `Done:` line yet, which is no death)"))
        elif end is None:
            out.append(RunState(log.path.parent, log, "killed", None, f"killed: no `Done:` line, no error; "
                                f"{_steps_text(log)}; {lock_text}"))
        else:
            i, kind = end
            out.append(RunState(log.path.parent, log, kind, i, f"{kind}: {log.where(i)}: {_body(log.lines[i])[:160]}"))
    return out


@rule
def run_fate(c: Corpus) -> list[Finding]:
    out = []
    for run in run_states(c):
        make = {"crashed": _crashed, "error": _error, "signal": _signal, "nonfinite": _nonfinite,
                "killed": _killed}.get(run.state)
        if make:
            f = make(c, run)
            f.fate, f.scope = True, str(run.dir)
            out.append(f)
    return out


# -- reading the log ------------------------------------------------------------------------------

def _body(line: str) -> str:
    """A log line without its timestamp and level."""
    return _LOG_PREFIX.sub("", line, count=1).strip()


def _ending(log: LogFile) -> tuple[int, str] | None:
    """(line index, kind) of the last invocation's ending line, or None when it has none."""
    starts = [log.line_index(m.start()) for m in _START.finditer(log.text)]
    ends = [(log.line_index(m.start()), next(k for k in _KINDS if m.group(k))) for m in _END.finditer(log.text)]
    ends = [(i, kind) for i, kind in ends if not starts or i > starts[-1]]
    if not ends:
        return None
    # The `error:` line that may follow a stop (the exit's own message) belongs to that stop.
    if len(ends) > 1 and ends[-1][1] == "error" and ends[-2][1] in ("signal", "nonfinite") \
            and ends[-1][0] - ends[-2][0] <= 3:
        return ends[-2]
    return ends[-1]


def _last_step(log: LogFile) -> tuple[int, int, int] | None:
    """(line index, step, steps in all) of the last `step N/M |` line."""
    m = None
    for m in _STEP.finditer(log.text):
        pass
    return (log.line_index(m.start()), int(m[1]), int(m[2])) if m else None


def _steps_text(log: LogFile) -> str:
    last = _last_step(log)
    return f"last finished step {last[1]} of {last[2]}" if last else "no step finished"


def _traceback(log: LogFile, i: int) -> tuple[int | None, list[tuple[int, re.Match]]]:
    """The traceback under line `i`, raw or one log record per line: (index of its last line, the
    exception; its `File "...", line N` frames)."""
    frames, last, seen, after_exception = [], None, False, False
    for j in range(i + 1, min(len(log.lines), i + 1 + MAX_TRACEBACK)):
        body = _LOG_PREFIX.sub("", log.lines[j], count=1)
        if body.startswith("Traceback (most recent call last)"):
            seen, after_exception = True, False
        elif not seen:
            if body != log.lines[j]:  # a new log record: no traceback follows
                break
            continue  # the rest of a message of several lines
        elif body.startswith(("During handling of the above exception", "The above exception was the direct")):
            after_exception = False
        elif not body.strip() or (body[0] in " \t" and not after_exception):
            m = _FRAME.match(body)
            if m:
                frames.append((j, m))
        elif not after_exception:
            last, after_exception = j, True
        else:
            break
    return last, frames


def _own_code(path: str) -> bool:
    return not _LIBRARY.search(path) or bool(_MILES_CODE.search(path))


def _resume(c: Corpus, run: RunState, load: str | None = None) -> str:
    """The command that resumes the run: its command line (config.json) with `--load` set to the
    line's own advice, else the run's --save dir, else its checkpoints/ when there is one."""
    config = next((cfg for p, cfg in c.configs if p.parent == run.dir), {})
    save = config.get("save") if isinstance(config.get("save"), str) else None
    if load is None and (save or (run.dir / "checkpoints").is_dir()):
        load = f"--load {shlex.quote(save or str(run.dir / 'checkpoints'))}"
    if load is None:
        return "rerun it (no checkpoints in the run dir to resume from)"
    command = config.get("command_line") if isinstance(config.get("command_line"), str) else None
    try:
        words = shlex.split(command) if command else []
    except ValueError:
        words = []
    kept = []
    for w in words:  # drop an earlier --load DIR / --load=DIR
        if kept and kept[-1] == "--load":
            kept.pop()
        elif not w.startswith("--load="):
            kept.append(w)
    return f"resume: `{shlex.join(kept)} {load}`" if kept else f"resume with the same command plus `{load}`"


# -- the lock -------------------------------------------------------------------------------------

def _lock_state(lock: dict | str | None) -> tuple[str, str]:
    """(alive | dead | none | other-host | bad, what to say about it)."""
    if lock is None:
        return "none", f"no {LOCK_NAME} in the run dir"
    if isinstance(lock, str):
        return "bad", f"{LOCK_NAME} is {lock}"
    pid, host, started = lock.get("pid"), lock.get("host"), lock.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return "bad", f"{LOCK_NAME} holds no valid pid ({pid!r})"
    me = socket.gethostname()
    if isinstance(host, str) and host and host.split(".")[0] != me.split(".")[0]:
        return "other-host", f"{LOCK_NAME}: pid {pid} on host {host}, not this host ({me}): not checked"
    if _pid_alive(pid, started):
        return "alive", f"pid {pid} on this host is alive (lock since {started})"
    return "dead", f"{LOCK_NAME}: pid {pid} on this host ({me}) is not alive (lock since {started})"


def _pid_alive(pid: int, started) -> bool:
    """Whether `pid` runs on this host and is not a later process that reused the number."""
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except PermissionError:
        pass  # it exists, under another user
    except (OSError, OverflowError):
        return False
    state, since = _proc_stat(pid)
    if state == "Z":  # exited, not yet reaped by its parent
        return False
    try:
        written = datetime.datetime.fromisoformat(str(started)).timestamp()
    except (TypeError, ValueError):
        return True
    return since is None or since <= written + PID_REUSE_SLACK_S


def _proc_stat(pid: int) -> tuple[str | None, float | None]:
    """(state letter, start time in epoch seconds) from Linux's /proc; (None, None) elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None, None


# -- one finding per way of ending ----------------------------------------------------------------

def _crashed(c: Corpus, run: RunState) -> Finding:
    log, i = run.log, run.end
    what = _body(log.lines[i]).split("Crashed: ", 1)[1]
    last, frames = _traceback(log, i)
    evidence = [line_ev(log, i)] + ([line_ev(log, last)] if last is not None else [])
    own = next(((j, m) for j, m in reversed(frames) if _own_code(m["file"])), None)
    if own:
        j, m = own
        evidence.append(line_ev(log, j))
        whose = "miles" if _MILES_CODE.search(m["file"]) else "your code"
        code = _body(log.lines[j + 1]) if j + 1 < len(log.lines) and not _FRAME.match(log.lines[j + 1]) else ""
        culprit = (f"`{what.split(':')[0]}` raised in {whose} at {m['file']}:{m['line']}"
                   + (f" (in {m['func'].strip()})" if m["func"] else "") + (f": `{code}`" if code else ""))
        fix = (f"fix {m['file']}:{m['line']}" if whose == "your code" else
               "a bug in miles or in how it was called: `miles doctor RUN --bundle bug.md` writes the report")
    elif frames:
        culprit = f"raised inside a library ({frames[-1][1]['file']}:{frames[-1][1]['line']}): read the frames above it"
        fix = "read the traceback from its last frame upwards"
    else:
        culprit, fix = "the traceback is not in train.log", "rerun to see the traceback on stderr"
    return Finding("run_crashed", f"run crashed: {what}"[:240], 0.95, evidence, culprit,
                   f"{fix} (traceback at {log.where(i)}); then {_resume(c, run)}")


def _error(c: Corpus, run: RunState) -> Finding:
    log, i = run.log, run.end
    message = _body(log.lines[i]).split("error: ", 1)[1]
    fix = f"fix what the message names, then {_resume(c, run)}"
    if message.startswith("--true-on-policy-mode:"):  # miles/loop.py: check_true_on_policy
        culprit = ("--true-on-policy-mode's check failed (exit 3): the engine's log-probs were not the trainer's bit "
                   "for bit, so an op outside the mode's batch-invariant kernels ran on one side (a layer the mode "
                   "does not cover, such as a model on the HF decode path or a norm other than RMSNorm; another "
                   "attention backend; a kernel changed by a Triton or torch upgrade)")
        fix = ("`miles doctor RUN_DIR --bundle bug.md` writes bug.md, the report to attach; to train meanwhile, "
               f"--true-on-policy-check rescore re-draws the tokens where the two differ; then {_resume(c, run)}")
    elif re.search(r"check failed|consecutive steps with non-finite", message, re.IGNORECASE):
        culprit = "a check the run was told to make fatal failed (exit 3): the message names the lines to read"
    elif message.startswith("WorkerCrashed:"):
        culprit = ("a Ray-hosted worker died or failed (exit 1): the message names it, its node and its first "
                   "error; its own log is under OUTPUT_DIR/workers/")
    elif re.search(r"No space left|Read-only file system|quota exceeded|\bwriting\b", message, re.IGNORECASE):
        culprit = "a write failed (exit 1): the disk is full or read-only, or the directory went away"
    else:
        culprit = "a bad flag, file or input met during the run (exit 2): the message names it"
    return Finding("run_error", f"run stopped with an error: {message}"[:240], 0.95, [line_ev(log, i)], culprit, fix)


def _signal(c: Corpus, run: RunState) -> Finding:
    log, i = run.log, run.end
    body = _body(log.lines[i])
    sig = re.search(r"Stopped by (SIG[A-Z]+)", body)[1]
    during = re.search(r"during step (\d+) of (\d+)", body)
    load = re.search(r"resume with (--load \S.*?)\s*$", body)
    culprit = ("Ctrl-C at the terminal (or a wrapper that passed it on)" if sig == "SIGINT" else
               "the run was asked to stop: a scheduler's preemption or time limit (Slurm, Kubernetes), `kill`, "
               "or `timeout`")
    return Finding("run_signal", f"run stopped by {sig}" + (f" during step {during[1]} of {during[2]}" if during
                   else "") + " (resumable)", 0.6, [line_ev(log, i)], culprit,
                   _resume(c, run, load[1] if load else None)
                   + ("; if a scheduler sent it: ask for more time, or save more often (--save-interval)"
                      if sig == "SIGTERM" else ""))


def _nonfinite(c: Corpus, run: RunState) -> Finding:
    log, i = run.log, run.end
    starts = [log.line_index(m.start()) for m in _START.finditer(log.text[: log.starts[i]])]
    skipped = [(log.line_index(m.start()), m[1], m[2].strip()) for m in _SKIPPED.finditer(log.text)
               if (not starts or log.line_index(m.start()) > starts[-1]) and log.line_index(m.start()) < i]
    what = ", ".join(dict.fromkeys(w for _, _, w in skipped))
    steps = ", ".join(s for _, s, _ in skipped)
    fp8 = c.hints(r"fp8")
    return Finding("run_nonfinite", "run stopped: non-finite values" + (f" (skipped step(s) {steps}: non-finite "
                   f"{what})" if skipped else ""), 0.95,
                   [line_ev(log, i)] + [line_ev(log, j) for j, _, _ in skipped[-5:]],
                   ("activation overflow in FP8, or a bad chat template" if fp8 else
                    "a bad chat template (garbage prompts give extreme log-probs), overflow in low precision, or a "
                    "learning rate too high"),
                   "skipped steps left the weights unchanged, so the checkpoints are finite: --precision fp32 to "
                   "confirm; `miles verify-chat-template --model DIR`; lower --lr; keep --clip-grad 1.0; then "
                   + _resume(c, run))


def _killed(c: Corpus, run: RunState) -> Finding:
    log = run.log
    lock = c.locks.get(run.dir)
    state, lock_text = _lock_state(lock)
    last = _last_step(log)
    tail = max((j for j, line in enumerate(log.lines) if line.strip()), default=None)
    evidence = [line_ev(log, j) for j in dict.fromkeys(j for j in (last and last[0], tail) if j is not None)]
    evidence.append(Evidence(str(run.dir / LOCK_NAME), lock_text))
    culprit = ("killed from outside Python, so nothing was logged: the OOM killer, `kill -9`, a preemption or a "
               "lost node")
    host = lock.get("host") if isinstance(lock, dict) and isinstance(lock.get("host"), str) else None
    fix = (f"on {host or 'the host it ran on'}: `dmesg -T | grep -iE 'killed process|out of memory'` and the "
           f"scheduler's log of the job (exit 137 is SIGKILL); then {_resume(c, run)}")
    if state == "none":
        culprit += (f" (there is no {LOCK_NAME} either, which such a kill leaves behind: the run dir may have been "
                    "copied without it, or written by a miles older than the lock, whose errors went to stderr only)")
    elif state == "bad":
        culprit += f" ({lock_text})"
    elif state == "other-host":
        culprit = f"if it is not still running on {host}: " + culprit
        fix = f"check on {host} whether pid {lock['pid']} still runs (`ps -p {lock['pid']}`); if not: " + fix
    confidence = {"dead": 0.9, "none": 0.7, "bad": 0.7, "other-host": 0.5}[state]
    return Finding("run_killed", f"run was killed (no Done: line, no error): {_steps_text(log)}", confidence,
                   evidence, culprit, fix)
