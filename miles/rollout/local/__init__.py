"""miles' own rollout engine, in process (the reference `Engine`)."""

from miles.rollout.local.engine import LocalEngine

__all__ = ["LocalEngine"]
