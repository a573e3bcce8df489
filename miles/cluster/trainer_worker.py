"""One trainer rank: a Ray actor holding a `Trainer` over an FSDP2-sharded model.

Every method the driver calls is called on all ranks at once (collectives inside); rank 0's
return value is the group's. `ping()` and `stacks()` run on threads of their own (the
"supervision" concurrency group), so they answer while a call is busy or stuck: the supervisor's
heartbeat, and a hang reported with the stuck rank's stack. The rank logs to
OUTPUT_DIR/workers/trainer_rank_R.log and to stderr, which Ray forwards to the driver's console.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

from miles.cluster.supervisor import log_to, python_stacks

logger = logging.getLogger("miles")


class TrainerWorker:
    def __init__(self, rank: int, world_size: int, log_file: str):
        self.rank, self.world_size, self.log_file = rank, world_size, log_file
        self.trainer = self.tokenizer = None
        self.device = "cpu"
        log_to(Path(log_file), f"rank {rank}")

    def node(self) -> dict:
        import ray

        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid(), "log": self.log_file,
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's, for the process group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, cfg, *, weights: str, base: str, master: tuple[str, int], timeout_s: float,
              use_gpus: bool, prepare=None) -> dict:
        """Joins the process group, loads policy (and reference) and shards them. `prepare` runs
        first (deterministic mode, when asked)."""
        import torch
        import torch.distributed as dist

        from miles.train.parallel import ProcessGroupRanks, parallelize
        from miles.train.trainer import Trainer
        from miles.utils.models import load_causal_lm, load_tokenizer, quiet_transformers

        quiet_transformers()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        backend = "nccl" if use_gpus else "gloo"
        device = self.device = "cuda" if use_gpus else "cpu"
        if use_gpus:
            torch.cuda.set_device(0)  # Ray shows each rank its own GPU as device 0
        if prepare is not None:
            prepare()
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        torch.manual_seed(cfg.run.seed)
        logger.info("Trainer rank %d/%d on %s, pid %d (%s, %s): process group joined", self.rank, self.world_size,
                    socket.gethostname(), os.getpid(), device if use_gpus else "a CPU rank", backend)
        self.tokenizer = load_tokenizer(base)
        load = dict(device=device, attention_backend=cfg.model.attention_backend)
        policy = load_causal_lm(weights, **load)
        ref = load_causal_lm(cfg.model.ref_load or base, **load) if cfg.train.needs_ref else None
        self.trainer = Trainer(cfg.train, policy, ref, temperature=cfg.rollout.sampling.temperature,
                               group_size=cfg.rollout.n_samples_per_prompt, pad_token_id=self.tokenizer.pad_token_id,
                               precision=cfg.model.precision, record_hashes=cfg.debug.debug_determinism,
                               parallelize=lambda m: parallelize(m, precision=cfg.model.precision),
                               ranks=ProcessGroupRanks())
        return self.trainer.memory_bytes()

    def call(self, method: str, *args, **kwargs):
        """What the driver calls: `method` of this worker, its failure logged in the rank's own log
        (the supervisor quotes that log's first error when the rank dies)."""
        try:
            return getattr(self, method)(*args, **kwargs)
        except BaseException as e:
            logger.error("%s failed: %s: %s\n%s", method, type(e).__name__, e, traceback.format_exc().rstrip())
            raise

    # -- the trainer's calls, on every rank; rank 0 answers ---------------------------------------

    def train(self, samples, rollout_log_probs: bool = False):
        result = self.trainer.train(samples, rollout_log_probs=rollout_log_probs)
        return result if self.rank == 0 else None

    def named_weights(self):
        return [(name, t.cpu()) for name, t in self.trainer.named_weights()]

    def write_hf(self, directory: str, untie: bool):
        return self.trainer.write_hf(Path(directory), untie=untie)

    def weight_digests(self, dtypes):
        return self.trainer.weight_digests(dtypes)

    def prompt_log_probs(self, tokens):
        return self.trainer.prompt_log_probs(tokens)

    def save(self, root: str, step: int, extra_state: dict):
        path = self.trainer.save(root, step, self.tokenizer, extra_state)
        return str(path) if path is not None else None

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def rng_state(self) -> dict:
        from miles.utils.rng import rng_state

        return rng_state()

    def set_rng_state(self, state: dict) -> None:
        from miles.utils.rng import set_rng_state

        set_rng_state(state)

    def offload(self) -> dict:
        """Colocate: parameters, gradients and optimizer state to CPU, the device's cache freed."""
        return _move(self.trainer, "cpu")

    def onload(self) -> dict:
        """Back onto this rank's device (on a CPU rank both moves stay on the CPU)."""
        return _move(self.trainer, self.device)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- what the supervisor asks while a call may be stuck ---------------------------------------

    def ping(self) -> bool:
        return True

    def stacks(self) -> str:
        return python_stacks()


def _move(trainer, device: str) -> dict:
    """Moves the trainer's models and optimizer state; returns the device memory before/after (MiB)."""
    import torch

    before = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            model.to(device)
    for state in trainer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    return {"device_mib_before": before, "device_mib_after": after}
