"""Servers miles starts itself (`--rollout-backend sglang|vllm` without a URL).

`miles serve` runs from this Python; vLLM from `--vllm-python` (its own venv: it pins its own torch
and transformers), else the interpreter of the `vllm` on PATH. Each server gets a free loopback
port, its own process group and a log file under `--sglang-log-dir`; `start` returns once every
server answers its health check, and `stop` (SIGTERM, then SIGKILL after 20 s) runs at exit, on a
crash and on Ctrl-C alike, because the caller holds the fleet in an ExitStack.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.errors import UsageError
from miles.rollout.remote.http import EngineError

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
                   python: str | None, weight_version: int) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one server."""
    if backend == "sglang":
        return ([sys.executable, "-m", "miles", "serve", "--hf-checkpoint", model_dir, "--port", str(port),
                 "--precision", precision, "--seed", str(seed), "--weight-version", str(weight_version)], {})
    dtype = "bfloat16" if precision == "bf16" else "float32"
    return ([vllm_python(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
             "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager", "--seed", str(seed),
             "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
             "--disable-uvicorn-access-log"],
            {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",  # the RL endpoints; a local dir needs no hub
             # vLLM's CPU backend reserves this many GiB of KV cache (its default, 4, is most of a small host)
             "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})


class ServerFleet:
    """`n` servers of `backend` on `model_dir`; a context manager that stops them on the way out."""

    def __init__(self, backend: str, model_dir: str, n: int, *, log_dir: str, start_timeout: float, precision: str,
                 seed: int, max_model_len: int, python: str | None, weight_version: int):
        self.backend, self.model_dir, self.n = backend, model_dir, n
        self.log_dir, self.start_timeout = Path(log_dir), start_timeout
        self.options = dict(precision=precision, seed=seed, max_model_len=max_model_len, python=python,
                            weight_version=weight_version)
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
                                           env={**os.environ, **env}, start_new_session=True)
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
                                  f"{server.process.returncode} while starting; last lines of {server.log}: "
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
