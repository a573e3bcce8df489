"""Where each worker runs: Ray placement groups for the trainer ranks and the engines.

The trainer gets N x G bundles, one per rank, packed node by node (`--actor-num-nodes`,
`--actor-num-gpus-per-node`); a bundle is one GPU, or on a host without GPUs one CPU ("a GPU is
a CPU rank on gloo"). Engines get `--rollout-num-gpus` / `--rollout-num-gpus-per-engine`
bundles of their own (disaggregated), or with `--colocate` share the trainer's: engine i runs
beside trainer rank i and the two take turns on the device (colocate.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from miles.errors import UsageError

logger = logging.getLogger("miles")

# What a colocated engine takes of a shared GPU bundle; the trainer rank takes the rest.
COLOCATED_ENGINE_SHARE = 0.2


@dataclass(frozen=True)
class Placement:
    nodes: int
    gpus_per_node: int
    use_gpus: bool  # False: each "GPU" is a CPU rank (gloo)
    engines: int  # engine actors miles starts (0: none, the engine is local or given by URL)
    gpus_per_engine: int
    colocate: bool

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def unit(self) -> str:
        return "GPU" if self.use_gpus else "CPU"

    @property
    def trainer_share(self) -> float:
        return 1 - COLOCATED_ENGINE_SHARE if self.colocate else 1.0

    def cpus_needed(self) -> int:
        """Ray CPUs a local cluster must declare (one per trainer rank, per separate engine, and the driver)."""
        separate = 0 if self.colocate else self.engines * (1 if self.use_gpus else self.gpus_per_engine)
        return self.world_size + separate + 1


def trainer_bundles(p: Placement) -> list[dict[str, float]]:
    return [{p.unit: 1.0, **({"CPU": 1.0} if p.use_gpus else {})} for _ in range(p.world_size)]


def engine_bundles(p: Placement) -> list[dict[str, float]]:
    """One bundle per engine (its GPUs, or CPUs on a host without them); none when colocated."""
    if p.colocate:
        return []
    return [{p.unit: float(p.gpus_per_engine), **({"CPU": 1.0} if p.use_gpus else {})} for _ in range(p.engines)]


def reserve(ray, bundles: list[dict[str, float]], *, what: str, flags: str, timeout: float):
    """A placement group holding `bundles`, ready; one `error:` line when the cluster cannot hold it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except Exception:  # GetTimeoutError: the cluster does not have the resources
        remove_placement_group(pg)
        total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
        raise UsageError(f"{flags}: the {what} needs {need} but the Ray cluster has {total} (not placed within "
                         f"{timeout:.0f} s); ask for fewer, or add nodes") from None
    return pg


def in_bundle(pg, index: int) -> dict:
    """Actor options that pin it to bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=index)}
