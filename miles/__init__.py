"""miles: RL post-training of LLMs (GRPO family) with the debugging workflow built in."""

__version__ = "0.1.0"
