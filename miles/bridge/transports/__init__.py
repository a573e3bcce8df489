"""The `WeightTransport` seam: how the trainer's weights reach the engines after a step.

One class per transport, each `send(model, step) -> SyncStats`: `InProcessTransport` copies into
an engine living in the same process (the reference implementation). Transports for servers
(safetensors on disk + the engine's reload endpoint, a broadcast group) implement the same call.
"""

from miles.bridge.transports.base import WeightReceiver, WeightTransport
from miles.bridge.transports.in_process import InProcessTransport

__all__ = ["InProcessTransport", "WeightReceiver", "WeightTransport"]
