"""The `WeightTransport` seam: how the trainer's weights reach the engines after a step.

One class per transport, each `send(source, step) -> SyncStats`, the source a `WeightSource` (the
trainer): `InProcessTransport` copies into
an engine living in the same process (the reference implementation); `DiskTransport` writes
safetensors once and has every server load them (their reload endpoints). A broadcast group
would implement the same call.
"""

from miles.bridge.transports.base import ModelWeights, WeightReceiver, WeightSource, WeightTransport
from miles.bridge.transports.disk import DiskTransport, DiskWeightReceiver
from miles.bridge.transports.in_process import InProcessTransport

__all__ = ["DiskTransport", "DiskWeightReceiver", "InProcessTransport", "ModelWeights", "WeightReceiver",
           "WeightSource", "WeightTransport"]
