"""Data-parallel training: which rows a rank trains on, the collectives the trainer needs, FSDP2.

The trainer is written once for any number of ranks. It asks a `Ranks` object for the few
things that differ: its share of a batch's rows, and sums / maxima / gathers across ranks. One
process uses `SingleRank` (every collective is the identity); ranks in a torch.distributed group
use `ProcessGroupRanks` (gloo on CPU, NCCL on GPU).

How the 1-rank gradient is kept: every rank builds the whole rollout's batch (samples are small),
scores only its rows and gathers the rest, so advantages, metrics and checks see the same tensors
on every rank as on one. Each optimizer step's rows are cut into one contiguous slice per rank;
each micro-batch loss is already its share of the *global* batch's mean, so the gradient is the
sum over ranks: FSDP2's reduce-scatter is told to sum (divide factor 1) instead of averaging.

`parallelize` shards a model with FSDP2 (`fully_shard`): each decoder layer, then the root (whose
parameters are not resharded after forward; --gradient-checkpointing recomputes inside each
layer's unit, which FSDP2 gathers again for the recomputation). With
bf16 on a GPU its mixed-precision policy computes in bf16 and reduces in fp32 over fp32 sharded
master weights (the optimizer state stays fp32 too); elsewhere compute follows the trainer's
autocast.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SingleRank:
    """One process: rank 0 of 1."""

    rank, world_size = 0, 1

    def rows(self, start: int, end: int) -> tuple[int, int]:
        return start, end

    def gather_rows(self, mine: torch.Tensor) -> torch.Tensor:
        return mine

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def max(self, value: float) -> float:
        return value

    def any(self, flag: bool) -> bool:
        return flag

    def full(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t


class ProcessGroupRanks(SingleRank):
    """This process's rank of the default torch.distributed group."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def rows(self, start: int, end: int) -> tuple[int, int]:
        """This rank's contiguous share of rows [start, end) (the count divides evenly: checked at
        the command line)."""
        share = (end - start) // self.world_size
        return start + self.rank * share, start + (self.rank + 1) * share

    def gather_rows(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order (each rank passes its `rows` share of one batch)."""
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.dist.all_gather(parts, mine.contiguous())
        return torch.cat(parts)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._device())
        self.dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def any(self, flag: bool) -> bool:
        return self.max(float(flag)) > 0

    def full(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The whole tensor of a sharded one (a collective: every rank calls it, in the same order)."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self.dist.get_backend() == "nccl" else "cpu"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (model.model.layers for Llama, Qwen, Mistral, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or getattr(getattr(model, "transformer", None), "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (model.model.layers or transformer.h) "
                         f"to shard with FSDP2")
    return list(layers)


def parallelize(model: torch.nn.Module, *, precision: str) -> torch.nn.Module:
    """FSDP2 over the default process group: each decoder layer a unit, then the root; gradients
    summed across ranks (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    on_gpu = next(model.parameters()).is_cuda
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" and on_gpu else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    # The root's parameters (embeddings, final norm, lm_head) stay gathered from forward to backward:
    # the chunked log-probs (train/logprobs.py) use lm_head's weight after the model's forward returns.
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied one)
    return model


def full_named_parameters(model: torch.nn.Module, ranks: SingleRank) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter, gathering shards (every rank must iterate it all)."""
    for name, p in model.named_parameters():
        yield name, ranks.full(p.detach())


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


# Checkpoints hold the optimizer state as `torch.optim.Optimizer.state_dict()` writes it (parameters
# numbered in `named_parameters()` order), whatever the rank count; torch.distributed.checkpoint
# speaks parameter names (FQNs). These two translate, so any rank count resumes any checkpoint.

def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """Numbered -> named."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_number(state: dict, names: list[str]) -> dict:
    """Named -> numbered."""
    number = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [number[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {number[n]: v for n, v in state["state"].items()}, "param_groups": groups}
