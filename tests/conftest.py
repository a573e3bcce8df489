"""Fixtures: tiny random HF models with a character-level ChatML tokenizer, built offline.

The models are real transformers architectures (Llama, Qwen2) at hidden size 64, so every code
path of the engine and trainer runs as it does on a real checkpoint, in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one char, one token
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def build_model_dir(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    # Random init puts all tokens near-uniform; scale up the output layer so sampling has preferences
    # and log-probs span a realistic range.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REWARD_MODULE = '''
def digit_share(sample):
    """Share of digits in the response: a dense, varied reward for random tiny models."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
'''


@pytest.fixture(scope="session")
def reward_module(tmp_path_factory) -> str:
    """A custom reward (`--custom-rm-path`) whose values vary across random responses."""
    d = tmp_path_factory.mktemp("rm")
    (d / "tiny_rewards.py").write_text(REWARD_MODULE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")]))
    import sys

    sys.path.insert(0, str(d))
    return "tiny_rewards:digit_share"


def tiny_train_args(tiny_model, prompt_file, reward_module, output_dir) -> list[str]:
    return ["train", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(prompt_file),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", reward_module, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--micro-batch-size", "4",
            "--num-rollout", "2", "--lr", "1e-3", "--output-dir", str(output_dir)]


@pytest.fixture
def tiny_args(tiny_model, prompt_file, reward_module, tmp_path):
    """Flags for a fast 2-step run of the tiny model; tests append or override."""
    return tiny_train_args(tiny_model, prompt_file, reward_module, tmp_path / "run")
