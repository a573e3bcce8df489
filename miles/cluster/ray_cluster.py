"""Ray for a run: the cluster of RAY_ADDRESS, or a local one started for this run alone.

A local cluster is sized to what the run asks for (Ray's CPU count is a scheduling unit, not a
core: two CPU trainer ranks and an engine run on a 2-core host) and shut down with the run, its
worker processes with it.
"""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger("miles")


@contextlib.contextmanager
def ray_session(*, num_cpus: int, use_gpus: bool):
    try:
        import ray
    except ImportError:
        from miles.errors import UsageError

        raise UsageError("--actor-num-nodes / --actor-num-gpus-per-node run the trainer on Ray: pip install "
                         "'ray>=2.40' (or pip install -e '.[cluster]')") from None
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        logger.info("Ray: joined the cluster at %s (%s)", address, ray.cluster_resources())
    else:
        ray.init(num_cpus=max(num_cpus, os.cpu_count() or 1), num_gpus=None if use_gpus else 0, include_dashboard=False,
                 log_to_driver=True, configure_logging=False)
        logger.info("Ray: started a local cluster for this run (%s)", ray.cluster_resources())
    try:
        yield ray
    finally:
        ray.shutdown()
