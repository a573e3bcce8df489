"""Watching Ray calls: a dead or failed worker becomes one `WorkerCrashed`, within a bounded time.

`Supervisor.call(workers, method, ...)` runs `method` on every worker and waits. When one fails
(its process died, or the call raised), the others get `grace` seconds to finish; any still
running then are stuck (typically in a collective with the failed one, or the reason it failed):
their Python stacks are logged. The error names the first failure: which worker, its node, and
the first ERROR line of its own log (or Ray's account of how its process died).

A worker can also stall where no collective would time out for it (a stopped process, in a call
its peers have returned from): with `stall` set, a worker still running `stall` seconds after the
first of its peers returned is stuck too, and the call raises `WorkerCrashed` naming it. Calls
whose work is uneven by design (rank 0 alone writes a checkpoint) pass `uneven=True`, which lifts
that bound; the heartbeat still holds there: every worker in a call is pinged in its actor's
"supervision" concurrency group (beside the call's thread), and one that leaves a ping unanswered
for `stall` seconds (its process stopped, or stuck outside Python) is stuck, whatever the call.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from miles.errors import WorkerCrashed

logger = logging.getLogger("miles")

# What a supervised actor is created with: its `ping` and `stacks` run in this group, on their own
# threads, so they answer while a call (in the default group) is busy or stuck.
SUPERVISION = {"supervision": 2}


@dataclass
class Worker:
    name: str  # "trainer rank 1", "engine 0"
    actor: object  # the Ray actor handle
    node: dict  # node_ip, host, pid, log


class Supervisor:
    def __init__(self, ray, *, grace: float = 10.0, stall: float | None = None):
        """`stall`: seconds a worker may run on after a peer returned from the same call (None: no bound)."""
        self.ray, self.grace, self.stall = ray, grace, stall

    def call(self, workers: list[Worker], method: str, *args, uneven: bool = False, **kwargs) -> list:
        """`uneven`: some workers do more of this call than others (no `stall` bound on it)."""
        refs = [w.actor.call.remote(method, *args, **kwargs) for w in workers]
        return self.wait(workers, refs, what=method, uneven=uneven)

    def wait(self, workers: list[Worker], refs: list, *, what: str, uneven: bool = False) -> list:
        ray = self.ray
        pending = dict(zip(refs, workers))
        results: dict = {}
        failed_at = returned_at = None
        first_failure: tuple[Worker, BaseException] | None = None
        stall = None if uneven else self.stall
        heartbeat = Heartbeat(ray, self.stall) if self.stall is not None else None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                worker = pending.pop(ref)
                try:
                    results[ref] = ray.get(ref)
                    returned_at = returned_at or time.monotonic()
                except Exception as e:  # RayActorError (it died) or RayTaskError (the call raised)
                    first_failure = first_failure or (worker, e)
                    failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if failed_at is not None and pending and now - failed_at > self.grace:
                self._log_stuck(list(pending.values()), what, f"{self.grace:.0f} s after another worker failed")
                break
            if failed_at is None and stall is not None and returned_at is not None and pending \
                    and now - returned_at > stall:
                raise self._stuck(list(pending.values()), what, f"{stall:.0f} s after its peers returned",
                                  f" within {stall:.0f} s of its peers")
            silent = heartbeat.silent(list(pending.values())) if heartbeat and failed_at is None else []
            if silent:
                raise self._stuck(silent, what, f"with no answer to a ping in {self.stall:.0f} s",
                                  f": no answer to a ping in {self.stall:.0f} s, its process stopped or stuck "
                                  f"outside Python")
        if first_failure is not None:
            error = crashed(first_failure[0], first_failure[1], what)
            if pending:
                error.args = (f"{error.args[0]}; still running {self.grace:.0f} s later (stuck; stacks in the log): "
                              f"{', '.join(w.name for w in pending.values())}",)
            raise error
        return [results[ref] for ref in refs]

    def end(self, workers: list[Worker], method: str, timeout: float) -> None:
        """Asks every worker to wind down (`method`, all at once, for up to `timeout` s), then ends
        its process whatever it answered: a dead or stuck worker is not waited for."""
        try:
            self.ray.get([w.actor.call.remote(method) for w in workers], timeout=timeout)
        except Exception:
            pass
        for w in workers:
            self.ray.kill(w.actor, no_restart=True)

    def _stuck(self, stuck: list[Worker], what: str, when: str, why: str) -> WorkerCrashed:
        """Logs the stuck workers' stacks; returns the error naming them (`why` right after "did not finish WHAT")."""
        self._log_stuck(stuck, what, when)
        names = ", ".join(w.name for w in stuck)
        return WorkerCrashed(f"WorkerCrashed: {names} did not finish {what}{why} (--distributed-timeout-minutes); "
                             f"still running (stuck; stacks in the log): {names}")

    def _log_stuck(self, stuck: list[Worker], what: str, when: str) -> None:
        for worker in stuck:
            try:
                stack = self.ray.get(worker.actor.stacks.options(concurrency_group="supervision").remote(),
                                     timeout=10)
            except Exception as e:
                stack = (f"(no stack: no answer in 10 s ({type(e).__name__}): its process is stopped, or stuck "
                         f"outside Python)")
            logger.error("%s had not finished %s %s; its stacks:\n%s", worker.name, what, when, stack.rstrip())


@dataclass
class Heartbeat:
    """Pings the workers still in a call, one ping outstanding each, a new one `every` seconds; a
    worker whose ping is unanswered `bound` seconds after it was sent is silent."""
    ray: object
    bound: float
    sent: dict = field(default_factory=dict)  # worker name -> (its outstanding ping, when it was sent)
    answered: dict = field(default_factory=dict)  # worker name -> when its last ping was answered

    @property
    def every(self) -> float:
        return min(self.bound / 4, 5.0)

    def silent(self, workers: list[Worker]) -> list[Worker]:
        now, silent = time.monotonic(), []
        for worker in workers:
            if worker.name in self.sent:
                ping, at = self.sent[worker.name]
                if self.ray.wait([ping], timeout=0)[0]:  # answered (a dead actor's failed ping too: its call fails)
                    del self.sent[worker.name]
                    self.answered[worker.name] = now
                elif now - at > self.bound:
                    silent.append(worker)
            elif now - self.answered.get(worker.name, float("-inf")) >= self.every:
                ping = worker.actor.ping.options(concurrency_group="supervision").remote()
                self.sent[worker.name] = (ping, now)
        return silent


def crashed(worker: Worker, error: BaseException, what: str) -> WorkerCrashed:
    node = worker.node
    where = f"node {node.get('node_ip')} ({node.get('host')}), pid {node.get('pid')}"
    first = first_error(node.get("log")) or _ray_reason(error)
    log = f"; its log: {node['log']}" if node.get("log") else ""
    return WorkerCrashed(f"WorkerCrashed: {worker.name} on {where} failed during {what}: {first}{log}")


def first_error(log: str | None) -> str | None:
    """The first ERROR line of a worker's log (a failed call logs its exception on that line)."""
    if not log or not Path(log).is_file():
        return None
    lines = Path(log).read_text(errors="replace").splitlines()
    for line in lines:
        if " ERROR " in line:
            return line.split(" ERROR ", 1)[1].strip()
    return None


def _ray_reason(error: BaseException) -> str:
    """Ray's own account on one line: how the process died, or the remote exception's last line
    (`Type: message`, after Ray's traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    last = lines[-1].split(" Some common causes include")[0] if lines else type(error).__name__
    return last[:200]


# -- what runs inside a worker, for the supervisor to read ------------------------------------------

def log_to(path: Path, who: str) -> None:
    """Sends the worker's `miles` logger to `path` (what `first_error` reads) and to stderr, which
    Ray forwards to the driver's console; each line tagged with `who` ("rank 1", "engine 0")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s [{who}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in (logging.FileHandler(path), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(fmt)
        logger.addHandler(handler)


def python_stacks() -> str:
    """Every other thread's Python stack: what a worker's `stacks()` answers while its busy thread is stuck."""
    me = threading.get_ident()
    return "\n".join(f"thread {ident}:\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items() if ident != me)
