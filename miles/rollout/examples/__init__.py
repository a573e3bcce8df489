"""Bundled examples of miles' plug-in points (`--custom-generate-function-path`)."""
