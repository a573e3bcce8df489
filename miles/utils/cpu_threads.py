"""How many CPU threads torch uses, and how its idle threads wait: chosen once per process, logged.

torch's CPU kernels run on an OpenMP pool (libgomp). Left to its defaults, every core gets a
thread and a thread that finishes its share of a kernel spins for a while (GOMP_SPINCOUNT,
300,000 iterations) before it sleeps. On a quiet machine that is fastest. On a machine other
processes are using it collapses: a decode step is hundreds of small parallel regions, each
waiting at its barrier for whichever thread the kernel has just preempted, while the waiting
threads burn the CPU share the preempted one needs (32 x 64 tokens of the demo model: ~200
tok/s quiet, ~20 loaded, where vLLM, one thread bound to one core, kept ~140). So:

- `set_wait_policy()`, before torch is imported (libgomp reads the variables once, when torch
  loads it): OMP_WAIT_POLICY=PASSIVE, idle threads sleep at once, unless the user has set
  OMP_WAIT_POLICY or GOMP_SPINCOUNT. Child processes (servers, Ray workers) inherit it.
- `setup_cpu_threads(override)`, once torch is loaded: one thread per core this process may use
  (its affinity mask), whatever the load; `--cpu-threads` or OMP_NUM_THREADS win. With passive
  waiting, fewer threads than cores did not help a loaded machine: the demo rollout with 2 busy
  processes on 2 cores made 28.6 tok/s on 1 thread, 36.0 on 2 (benchmarks/cpu_engines.py, the load in
  miles' own session; in a session of its own, where the kernel shares the CPU by session, 1 thread
  and 2 made about the same loaded and 2 are faster quiet: BENCHMARKS.md, 2026-12-05). It
  logs one line with the load for the record: `CPU threads: 2 of 2 cores (load 1.9), OMP_WAIT_POLICY=PASSIVE`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass

logger = logging.getLogger("miles")

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp's: read when the library loads

# What set_wait_policy did in this process: None until it ran, else a description for the log.
_wait_policy: str | None = None


def wait_policy_for(environ: MutableMapping[str, str], torch_loaded: bool) -> tuple[dict[str, str], str]:
    """The variables to set and how the log line describes the wait policy. Nothing is set when
    the user set either variable (theirs are kept) or when torch, hence libgomp, is already loaded
    (too late: its threads keep spinning)."""
    given = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    if given:
        return {}, ", ".join(given)
    if torch_loaded:
        return {}, "OMP_WAIT_POLICY unset (torch was imported first: idle threads spin)"
    return {"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=PASSIVE"


def set_wait_policy(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets OMP_WAIT_POLICY=PASSIVE in `environ` when the user did not choose a wait policy and torch
    is not loaded yet; returns the description the log line uses. Call it before `import torch`."""
    global _wait_policy
    changes, _wait_policy = wait_policy_for(environ, "torch" in sys.modules)
    environ.update(changes)
    return _wait_policy


def choose_threads(*, cores: int, override: int | None = None,
                   omp_num_threads: str | None = None) -> tuple[int, str | None]:
    """The intra-op thread count and, when not miles' own choice, who chose it: `override`
    (--cpu-threads), then a numeric OMP_NUM_THREADS (which torch has already applied), else one
    per core of the `cores` this process may run on."""
    if override is not None:
        return override, "--cpu-threads"
    if omp_num_threads is not None and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return int(omp_num_threads), "OMP_NUM_THREADS"
    return cores, None


@dataclass(frozen=True)
class ThreadSetup:
    threads: int
    cores: int
    load: float
    chosen_by: str | None  # "--cpu-threads", "OMP_NUM_THREADS", or None: one per core
    wait_policy: str

    def line(self) -> str:
        by = f", {self.chosen_by}" if self.chosen_by else ""
        return (f"CPU threads: {self.threads} of {self.cores} cores (load {self.load:.1f}{by}), "
                f"{self.wait_policy}")


def affinity_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset and cgroups set it)."""
    return len(os.sched_getaffinity(0)) if sys.platform.startswith("linux") else os.cpu_count() or 1


def setup_cpu_threads(override: int | None = None) -> ThreadSetup:
    """Sets torch's intra-op thread count (choose_threads) and logs the `CPU threads:` line."""
    import torch

    cores = affinity_cores()
    load = os.getloadavg()[0]
    threads, chosen_by = choose_threads(cores=cores,
                                        override=override, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(threads)
    wait = _wait_policy or wait_policy_for(os.environ, torch_loaded=True)[1]
    setup = ThreadSetup(threads=threads, cores=cores, load=load, chosen_by=chosen_by, wait_policy=wait)
    logger.info(setup.line())
    return setup
