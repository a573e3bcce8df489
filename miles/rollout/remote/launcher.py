"""Servers miles starts itself (`--rollout-backend sglang|vllm` without a URL).

`miles serve` runs from this Python; vLLM from `--vllm-python` (its own venv: it pins its own torch
and transformers), else the interpreter of the `vllm` on PATH. Each server gets a free loopback
port, its own process group and a log file under `--sglang-log-dir`; `start` returns once every
server answers its health check, and `stop` (SIGTERM, then SIGKILL after 20 s) runs at exit, on a
crash and on Ctrl-C alike, because the caller holds the fleet in an ExitStack. A parent killed
outright (SIGKILL, the OOM killer) runs no `stop`: on Linux each server also asks the kernel for a
SIGTERM when its parent dies (PR_SET_PDEATHSIG), which both servers answer by shutting down what
they started (vLLM its engine core). The kernel sends it when the *thread* that started the server
ends, so call `start` from a thread that lives as long as the servers should (the main thread).

On a CPU the host's cores are shared out: each `miles serve` gets `--cpu-threads` cores / servers
(all spinning on every core is several times slower). On a GPU, `mem_fraction` caps what each
server takes (`--mem-fraction-static` for `miles serve`, `--gpu-memory-utilization` for vLLM),
leaving room for a colocated trainer, and vLLM gets `--enable-sleep-mode`, without which its
`/sleep` frees nothing (RemoteEngine.release_memory).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.errors import UsageError
from miles.rollout.remote.http import EngineError
from miles.utils.cpu_threads import affinity_cores

logger = logging.getLogger("miles")


@dataclass
class Launched:
    url: str
    process: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python(given: str | None) -> str:
    if given:
        return given
    script = shutil.which("vllm")
    if script is None:
        raise UsageError("--rollout-backend vllm without --vllm-url starts vLLM servers, but no vLLM was found: pass "
                         "--vllm-python PATH (the python of a venv with vllm installed) or --vllm-url URL")
    with open(script, "rb") as f:  # a console script's first line names its interpreter
        first = f.readline().decode(errors="replace").strip()
    return first[2:].strip() if first.startswith("#!") else sys.executable


def server_command(backend: str, model_dir: str, port: int, *, precision: str, seed: int, max_model_len: int,
                   python: str | None, weight_version: int, device: str, cpu_threads: int | None = None,
                   mem_fraction: float | None = None, tensor_parallel: int = 1,
                   enforce_eager: bool = True, moe: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one server on `device` (cpu | cuda); `cpu_threads`
    is for `miles serve` on a CPU, `mem_fraction` for a GPU, `tensor_parallel` (devices per server)
    and `enforce_eager` (False: vLLM's default compiled mode, which benchmarks/cpu_engines.py
    measures) for vLLM (`miles serve` runs on one device: the CLI refuses more). `moe`: an MoE model,
    whose routes a vLLM server on a GPU returns (--enable-return-routed-experts, which needs vLLM's
    model runner V2; `miles serve` returns them when asked)."""
    gpu = device == "cuda"
    if backend == "sglang":
        command = [sys.executable, "-m", "miles", "serve", "--hf-checkpoint", model_dir, "--port", str(port),
                   "--device", device, "--precision", precision, "--seed", str(seed),
                   "--weight-version", str(weight_version)]
        if not gpu and cpu_threads is not None:
            command += ["--cpu-threads", str(cpu_threads)]
        if gpu and mem_fraction is not None:
            command += ["--mem-fraction-static", str(mem_fraction)]
        return command, {}
    dtype = "bfloat16" if precision == "bf16" else "float32"
    command = [vllm_python(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
               "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", str(seed),
               "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
               "--disable-uvicorn-access-log"]
    if enforce_eager:
        command += ["--enforce-eager"]
    if tensor_parallel > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel)]
    env = {}
    if moe and gpu:  # routed experts need the V2 model runner, which needs Triton: a GPU
        command += ["--enable-return-routed-experts"]
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if gpu:  # on a CPU --gpu-memory-utilization is a share of the host's RAM, and sleep mode refuses to start
        command += ["--enable-sleep-mode"]
        if mem_fraction is not None:
            command += ["--gpu-memory-utilization", str(mem_fraction)]
    return (command,
            {**env, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",  # the RL endpoints; a local dir needs no hub
             # vLLM's CPU backend reserves this many GiB of KV cache (its default, 4, is most of a small host)
             "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset and cgroups set it)."""
    return affinity_cores()


def default_device() -> str:
    import torch  # already imported by `miles train`; servers see what this process sees

    return "cuda" if torch.cuda.is_available() else "cpu"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A Popen preexec_fn (Linux): the child is sent SIGTERM when the thread that started it ends,
    however it ends; if the parent is already gone by then, at once. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class ServerFleet:
    """`n` servers of `backend` on `model_dir`; a context manager that stops them on the way out.
    `device` None: cuda when this process sees a GPU, else cpu. `mem_fraction` None: no cap.
    `cpu_threads` None: the host's cores shared out among the `n`."""

    def __init__(self, backend: str, model_dir: str, n: int, *, log_dir: str, start_timeout: float, precision: str,
                 seed: int, max_model_len: int, python: str | None, weight_version: int, device: str | None = None,
                 mem_fraction: float | None = None, cpu_threads: int | None = None, tensor_parallel: int = 1,
                 enforce_eager: bool = True, moe: bool = False):
        self.backend, self.model_dir, self.n = backend, model_dir, n
        self.log_dir, self.start_timeout = Path(log_dir), start_timeout
        device = device or default_device()
        if device != "cuda" and mem_fraction is not None:
            logger.info("mem_fraction %g is for GPU servers; the %s servers run on %s without a cap", mem_fraction,
                        backend, device)
        self.options = dict(precision=precision, seed=seed, max_model_len=max_model_len, python=python,
                            weight_version=weight_version, device=device, mem_fraction=mem_fraction,
                            cpu_threads=cpu_threads or max(1, host_cores() // n), tensor_parallel=tensor_parallel,
                            enforce_eager=enforce_eager, moe=moe)
        self.servers: list[Launched] = []

    def __enter__(self) -> ServerFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> list[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            port = free_port()
            command, env = server_command(self.backend, self.model_dir, port, **self.options)
            if self.backend == "vllm" and self.n > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))  # else all bind core 0
            log = self.log_dir / f"{self.backend}-{i}-{port}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env={**os.environ, **env}, start_new_session=True,
                                           preexec_fn=die_with_parent())
            self.servers.append(Launched(f"http://127.0.0.1:{port}", process, log))
            logger.info("Started %s server %d of %d: %s (pid %d, log %s)", self.backend, i + 1, self.n,
                        self.servers[-1].url, process.pid, log)
        start = time.monotonic()
        for server in self.servers:
            self._wait_healthy(server, start)
        logger.info("%d %s server(s) healthy after %.1f s", self.n, self.backend, time.monotonic() - start)
        return [s.url for s in self.servers]

    def _wait_healthy(self, server: Launched, start: float) -> None:
        path = "/health_generate" if self.backend == "sglang" else "/health"
        while True:
            if server.process.poll() is not None:
                raise EngineError(f"the {self.backend} server {server.url} exited with code "
                                  f"{server.process.returncode} while starting (started as "
                                  f"`{shlex.join(server.process.args[:3])} ...`); last lines of {server.log}: "
                                  f"{tail(server.log)}")
            try:
                if httpx.get(server.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > self.start_timeout:
                raise EngineError(f"the {self.backend} server {server.url} was not healthy after "
                                  f"{self.start_timeout:g} s (--engine-start-timeout); its log: {server.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        for server in self.servers:
            if self.backend == "vllm" and server.process.poll() is None:
                # vLLM waits for in-flight requests on SIGTERM (minutes); aborted first, it exits in seconds
                try:
                    httpx.post(server.url + "/pause", params={"mode": "abort"}, timeout=5)
                except httpx.HTTPError:
                    pass
            _signal(server.process, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for server in self.servers:
            try:
                server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(server.process, signal.SIGKILL)
                server.process.wait()
        if self.servers:
            logger.info("Stopped %d %s server(s)", len(self.servers), self.backend)
        self.servers = []


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server and anything it started (vLLM's engine core)
    except ProcessLookupError:
        pass


def tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(unreadable)"
    return " | ".join(text[-lines:]) or "(empty)"
