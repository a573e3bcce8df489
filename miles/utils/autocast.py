"""What an autocast region computes in, for code that casts as autocast would (attention kernels handed fp32
queries, the engine's weight copies under true on-policy mode)."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype when it is on for `device_type` here, else None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
