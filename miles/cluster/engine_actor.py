"""`EngineActor`: a Ray actor that owns one inference server process on its bundle's devices.

It starts the server with the launcher of `--rollout-backend` (miles serve / SGLang / vLLM; the
actor's CUDA_VISIBLE_DEVICES are Ray's, so the server sees the bundle's GPUs) and returns its URL;
the driver talks to it as to any server (a `RemoteEngine`). The server dies with the actor: the
actor stops it on `stop()`, and the launcher's death signal covers an actor killed outright.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from miles.cluster.supervisor import log_to, python_stacks

logger = logging.getLogger("miles")


class EngineActor:
    def __init__(self, index: int, log_file: str):
        self.index, self.log_file, self.fleet = index, log_file, None
        log_to(Path(log_file), f"engine {index}")

    def node(self) -> dict:
        import ray

        return {"engine": self.index, "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid(), "log": self.log_file, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def call(self, method: str, *args, **kwargs):
        """What the driver calls; a failure is logged in the engine's own log (quoted when it dies)."""
        try:
            return getattr(self, method)(*args, **kwargs)
        except BaseException as e:
            logger.error("%s failed: %s: %s", method, type(e).__name__, e)
            raise

    def start(self, backend: str, model_dir: str, options: dict) -> str:
        from miles.rollout.remote.launcher import ServerFleet

        self.fleet = ServerFleet(backend, model_dir, 1, **options)
        url = self.fleet.start()[0]
        logger.info("Engine %d: %s server at %s (devices %s)", self.index, backend, url,
                    os.environ.get("CUDA_VISIBLE_DEVICES") or "cpu")
        return url

    def alive(self) -> bool:
        return self.fleet is not None and all(s.process.poll() is None for s in self.fleet.servers)

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None

    def ping(self) -> bool:
        return True

    def stacks(self) -> str:
        return python_stacks()
