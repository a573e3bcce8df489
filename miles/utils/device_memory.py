"""What a CUDA device holds for this process, and handing the allocator's cached blocks back.

PyTorch's caching allocator keeps freed blocks reserved for reuse, so memory freed by moving a
model to the CPU stays unavailable to other processes (a colocated trainer) until `give_back`
returns it to the driver. On a CPU both are no-ops: there is nothing to report or return.
"""

from __future__ import annotations

import torch

GIB = 1 << 30


def snapshot(device: torch.device) -> dict[str, int] | None:
    """Bytes this process has allocated and reserved on `device`, and the device's free and total
    bytes (every process counted); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "free": free, "total": total}


def give_back(device: torch.device) -> None:
    """The caching allocator's unused blocks on `device` back to the driver (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def describe(before: dict[str, int] | None, after: dict[str, int] | None) -> str:
    """`reserved 1.20 -> 0.00 GiB, device free 130.1 -> 131.3 GiB`, or `on cpu` without numbers."""
    if before is None or after is None:
        return "on cpu: no device memory moves"
    return (f"reserved {before['reserved'] / GIB:.2f} -> {after['reserved'] / GIB:.2f} GiB, "
            f"device free {before['free'] / GIB:.1f} -> {after['free'] / GIB:.1f} GiB")
