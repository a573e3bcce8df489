"""`ClusterRun`: Ray for one `miles train`: the session, the trainer ranks, the engine actors.

Everything it starts is registered on the run's ExitStack, so a finished run, a crash, a
`WorkerCrashed` and Ctrl-C all end the same way: engine servers stopped, ranks ended, bundles
freed, and a local Ray cluster shut down with its processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from miles.cluster.placement import Placement, engine_bundles, in_bundle, reserve, trainer_bundles
from miles.cluster.ray_cluster import ray_session
from miles.cluster.supervisor import SUPERVISION, Supervisor, Worker, crashed
from miles.cluster.trainer_group import TrainerGroup
from miles.config import Configs
from miles.errors import WorkerCrashed

logger = logging.getLogger("miles")

PLACE_TIMEOUT_S = 60.0  # how long resources may take to be granted before the run says they are not there


def process_group_timeout(cfg: Configs) -> float:
    """Seconds a collective may wait: --distributed-timeout-minutes, or NCCL_TIMEOUT when set."""
    if text := os.environ.get("NCCL_TIMEOUT"):
        try:
            return float(text)
        except ValueError:
            logger.warning("NCCL_TIMEOUT=%r is not a number of seconds; using --distributed-timeout-minutes", text)
    return cfg.cluster.distributed_timeout_minutes * 60


def placement_of(cfg: Configs) -> Placement:
    c, engines = cfg.cluster, 0
    if cfg.engines.backend != "local" and not cfg.engines.urls:
        per_engine = c.rollout_num_gpus_per_engine
        gpus = c.rollout_num_gpus or (c.ranks if c.colocate else cfg.engines.num_engines * per_engine)
        engines = gpus // per_engine
    return Placement(nodes=c.actor_num_nodes or 1, gpus_per_node=c.actor_num_gpus_per_node or 1,
                     use_gpus=cfg.model.device == "cuda", engines=engines,
                     gpus_per_engine=c.rollout_num_gpus_per_engine,
                     colocate=c.colocate)


class ClusterRun:
    def __init__(self, cfg: Configs, closers: contextlib.ExitStack):
        self.cfg, self.closers = cfg, closers
        self.placement = placement_of(cfg)
        self.log_dir = Path(cfg.run.output_dir) / "workers"
        self.ray = closers.enter_context(ray_session(num_cpus=self.placement.cpus_needed(),
                                                     use_gpus=self.placement.use_gpus))
        # A rank still in a call this long after its peers returned is stuck, as a collective would say.
        self.supervisor = Supervisor(self.ray, stall=process_group_timeout(cfg))
        p = self.placement
        self.trainer_pg = reserve(self.ray, trainer_bundles(p), what="trainer", timeout=PLACE_TIMEOUT_S,
                                  flags=f"--actor-num-nodes {p.nodes} --actor-num-gpus-per-node {p.gpus_per_node}")
        self.closers.callback(_remove, self.trainer_pg)
        self.trainer: TrainerGroup | None = None
        self.engines: list[Worker] = []

    def start_trainer(self, weights: Path, base: Path, prepare=None) -> TrainerGroup:
        group = TrainerGroup(self.ray, self.placement, self.trainer_pg, log_dir=self.log_dir,
                             supervisor=self.supervisor)
        self.closers.callback(group.close)
        group.setup(self.cfg, weights=weights, base=base, timeout_s=process_group_timeout(self.cfg), prepare=prepare)
        self.trainer = group
        return group

    def launch_engines(self, backend: str, model_dir: str, options: dict) -> list[str]:
        """`placement.engines` servers, each owned by an EngineActor on its bundle (or, colocated, on
        trainer rank i's); returns their URLs once all are healthy."""
        from miles.cluster.engine_actor import EngineActor

        p = self.placement
        if p.colocate:  # engine i in trainer rank i's bundle
            pg = self.trainer_pg
        else:
            flags = (f"--rollout-num-gpus {p.engines * p.gpus_per_engine} "
                     f"--rollout-num-gpus-per-engine {p.gpus_per_engine}")
            pg = reserve(self.ray, engine_bundles(p), what="engines", flags=flags, timeout=PLACE_TIMEOUT_S)
        share = 1 - p.trainer_share if p.colocate else float(p.gpus_per_engine)
        resources = {"num_gpus": share, "num_cpus": share if p.colocate else 1} if p.use_gpus else {"num_cpus": share}
        actor = self.ray.remote(concurrency_groups=SUPERVISION, max_restarts=0)(EngineActor)
        for i in range(p.engines):
            log = str(self.log_dir / f"engine_{i}.log")
            handle = actor.options(**resources, **in_bundle(pg, i)).remote(i, log)
            self.engines.append(Worker(f"engine {i}", handle, {"log": log}))
        self.closers.callback(self._stop_engines, pg if not p.colocate else None)
        for worker, node in zip(self.engines, self.supervisor.call(self.engines, "node")):
            worker.node = node
        if not p.use_gpus:  # CPU servers: a core each (colocated, the rank's), not every core of the host
            options = {**options, "cpu_threads": max(1, int(resources["num_cpus"] or 1))}
        options = {**options, "tensor_parallel": p.gpus_per_engine}  # a vLLM server over its bundle's GPUs
        # Servers start in their own time (one may load from a slower disk): no stall bound.
        urls = self.supervisor.call(self.engines, "start", backend, model_dir, options, uneven=True)
        logger.info("Engines: %d %s server(s) on Ray (%s), %s", len(urls), backend,
                    "colocated with the trainer ranks" if p.colocate else "on their own bundles", ", ".join(urls))
        return urls

    def explain(self, error: Exception) -> Exception:
        """An engine request failed: if an engine actor or its server is gone, that is the error."""
        for worker in self.engines:
            try:
                alive = self.ray.get(worker.actor.call.remote("alive"), timeout=10)
            except Exception as e:
                return crashed(worker, e, "rollout")
            if not alive:
                return WorkerCrashed(f"WorkerCrashed: {worker.name} on node {worker.node.get('node_ip')}: its server "
                                     f"process exited ({error}); its log: {worker.node.get('log')}")
        return error

    def _stop_engines(self, pg) -> None:
        self.supervisor.end(self.engines, "stop", timeout=30)
        if pg is not None:
            _remove(pg)


def _remove(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # the cluster is already going away
        pass
