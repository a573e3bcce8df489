"""`TrainerGroup`: N x G trainer ranks behind the one trainer interface the loop knows.

The loop calls `train`, `send_weights`, `save_fn`, ... exactly as on a `Trainer`; each call runs
on every rank (they shard the model and meet in collectives), and rank 0's answer is returned.
The group is also the `WeightSource` a transport reads: rank 0 hands out the gathered tensors
(in-process engine) or writes them in HF layout (servers), once.

Checkpoints are the 1-process format: one gathered HF copy and one optimizer state numbered as a
single optimizer numbers it, so a run resumes at any rank count (1 -> 2, 2 -> 1, ...); each
rank's RNG state is saved too and restored when the rank count is the same (at another count
the ranks start new streams from --seed, logged: only dropout would notice).
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles.bridge.transports import WeightTransport
from miles.bridge.weight_sync import SyncStats
from miles.cluster.placement import Placement, in_bundle
from miles.cluster.supervisor import SUPERVISION, Supervisor, Worker

logger = logging.getLogger("miles")


class TrainerGroup:
    def __init__(self, ray, placement: Placement, pg, *, log_dir: Path, supervisor: Supervisor):
        """`pg`: the placement group of `trainer_bundles(placement)`, one bundle per rank."""
        from miles.cluster.trainer_worker import TrainerWorker

        self.ray, self.placement, self.supervisor, self.pg = ray, placement, supervisor, pg
        share = placement.trainer_share
        resources = {"num_gpus": share, "num_cpus": share} if placement.use_gpus else {"num_cpus": share}
        actor = ray.remote(max_concurrency=2, concurrency_groups=SUPERVISION, max_restarts=0)(TrainerWorker)
        self.workers: list[Worker] = []
        for rank in range(placement.world_size):
            log = str(log_dir / f"trainer_rank_{rank}.log")
            handle = actor.options(**resources, **in_bundle(self.pg, rank)).remote(rank, placement.world_size, log)
            self.workers.append(Worker(f"trainer rank {rank}", handle, {"log": log}))
        for worker, node in zip(self.workers, self.supervisor.call(self.workers, "node")):
            worker.node = node
        self.rank0 = self.workers[0]

    def setup(self, cfg, *, weights: Path, base: Path, timeout_s: float, prepare=None) -> None:
        master = self.supervisor.call([self.rank0], "master_address")[0]
        memory = self._all("setup", cfg, weights=str(weights), base=str(base), master=master, timeout_s=timeout_s,
                           use_gpus=self.placement.use_gpus, prepare=prepare)
        self.memory = memory[0]
        # Each rank loaded them (its own log says so); the driver's log says it once for the group.
        logger.info("Loaded checkpoint from %s (trainer policy, on %d ranks)", weights, len(self.workers))
        if cfg.train.needs_ref:
            logger.info("Loaded checkpoint from %s (reference model, on %d ranks)", cfg.model.ref_load or base,
                        len(self.workers))
        nodes = sorted({w.node["node_ip"] for w in self.workers})
        kind = "GPU" if self.placement.use_gpus else "CPU rank on gloo (no GPU on this host)"
        logger.info("Trainer: %d ranks (each a %s) on %d node(s) %s, FSDP2; rank 0 at %s:%d; logs in %s",
                    len(self.workers), kind, len(nodes), ", ".join(nodes), *master,
                    Path(self.rank0.node["log"]).parent)

    def _all(self, method: str, *args, uneven: bool = False, **kwargs) -> list:
        """`uneven`: rank 0 does work alone after the ranks meet (writing files, handing out tensors)."""
        return self.supervisor.call(self.workers, method, *args, uneven=uneven, **kwargs)

    # -- the Trainer interface -------------------------------------------------------------------

    def train(self, samples, *, rollout_log_probs: bool = False):
        return self._all("train", samples, rollout_log_probs=rollout_log_probs)[0]

    def send_weights(self, transport: WeightTransport, step: int) -> SyncStats:
        return transport.send(self, step)

    def named_weights(self):
        return self._all("named_weights", uneven=True)[0]

    def write_hf(self, directory: Path, *, untie: bool = False) -> tuple[int, int]:
        return self._all("write_hf", str(directory), untie, uneven=True)[0]

    def weight_digests(self, dtypes):
        return self._all("weight_digests", dtypes, uneven=True)[0]

    def prompt_log_probs(self, tokens):
        return self._all("prompt_log_probs", tokens)[0]

    def save_fn(self, tokenizer):
        """What a Checkpointer calls: every rank gathers, rank 0 writes (the tokenizer is its own copy)."""
        def save(root, step, extra_state):
            rank_rng = self._all("rng_state")
            path = Path(self._all("save", str(root), step, {**extra_state, "rank_rng": rank_rng}, uneven=True)[0])
            logger.info("Saved checkpoint to %s (gathered from %d ranks)", path, len(self.workers))
            return path
        return save

    def load_state_dict(self, state: dict) -> None:
        self._all("load_state_dict", state)
        rank_rng = state.get("rank_rng")
        if rank_rng is not None and len(rank_rng) == len(self.workers):
            self.supervisor.wait(self.workers, [w.actor.call.remote("set_rng_state", s)
                                                for w, s in zip(self.workers, rank_rng)], what="set_rng_state")
        elif rank_rng is not None:
            logger.warning("Resuming %d trainer ranks from a checkpoint of %d: weights and optimizer state carry "
                           "over; each rank's random stream restarts from --seed (only dropout draws from it)",
                           len(self.workers), len(rank_rng))

    def memory_bytes(self) -> dict[str, int]:
        return self.memory

    def offload(self) -> None:
        """--colocate: every rank's parameters and optimizer state to CPU while the engines generate."""
        moved = self._all("offload")[0]
        logger.info("Trainer offloaded to CPU (rank 0's device memory %.0f -> %.0f MiB)", moved["device_mib_before"],
                    moved["device_mib_after"])

    def onload(self) -> None:
        moved = self._all("onload")[0]
        logger.info("Trainer loaded back (rank 0's device memory %.0f -> %.0f MiB)", moved["device_mib_before"],
                    moved["device_mib_after"])

    def close(self) -> None:
        """Leaves the process group where it can, then ends every rank."""
        self.supervisor.end(self.workers, "shutdown", timeout=10)
