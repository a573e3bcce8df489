"""Tiny offline models and data for tests and `miles selftest` (no download, milliseconds to build)."""
