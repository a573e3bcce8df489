"""Fixtures: tiny random HF models (miles/testing/tiny.py) with a character-level ChatML tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, miles.utils.invariant's Triton kernels run in Triton's interpreter (tests/test_invariant.py).
# Triton reads it where a kernel is defined (miles.utils.invariant_kernels' import), so it is set before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from miles.testing.tiny import CHATML, build_model_dir, build_tokenizer  # noqa: F401  (re-exported for tests)
from miles.testing.tiny import REWARD, train_args, write_prompts


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


@pytest.fixture(scope="session")
def reward_module() -> str:
    """A custom reward (`--custom-rm-path`) whose values vary across random responses."""
    return REWARD


def tiny_train_args(tiny_model, prompt_file, reward_module, output_dir) -> list[str]:
    return train_args(tiny_model, prompt_file, output_dir, reward_module)


@pytest.fixture
def tiny_args(tiny_model, prompt_file, reward_module, tmp_path):
    """Flags for a fast 2-step run of the tiny model; tests append or override."""
    return train_args(tiny_model, prompt_file, tmp_path / "run", reward_module)


@pytest.fixture
def deterministic_algorithms():
    """torch's deterministic algorithms on (warn only, as the mode sets them), put back after."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
