"""Tiny random HF models with a character-level ChatML tokenizer, built offline in milliseconds.

They are real transformers architectures (Llama, Qwen2) at hidden size 64, so every code path of
the engine and the trainer runs as on a real checkpoint. Used by the tests and `miles selftest`.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

REWARD = "miles.testing.rewards:digit_share"  # a dense reward: a random tiny model still learns


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


def build_model_dir(path: Path, arch: str = "llama", seed: int = 0, *, hidden_size: int = 64, layers: int = 2) -> Path:
    """A random model of `arch` with the character tokenizer; larger sizes for GPU runs that need
    a model but cannot fetch one."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from miles.utils.models import quiet_transformers

    quiet_transformers()
    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    if arch == "qwen3":  # per-head q/k norms before RoPE; its head dim is a field of its own
        common["head_dim"] = hidden_size // common["num_attention_heads"]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    # Random init predicts near-uniformly; sharpen the output layer so sampling has preferences and
    # log-probs span a realistic range.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_prompts(path: Path) -> Path:
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_args(model_dir: Path, prompts: Path, output_dir: Path, rm_path: str = REWARD) -> list[str]:
    """Flags of a fast 2-step tiny-model run."""
    return ["train", "--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", rm_path, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--micro-batch-size", "4",
            "--num-rollout", "2", "--lr", "1e-3", "--output-dir", str(output_dir)]


MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


def build_moe_model(family: str = "qwen3_moe", seed: int = 0, *, hidden_size: int = 32, layers: int = 2,
                    experts: int = 8, top_k: int = 2, router_std: float = 1.0):
    """A random HF MoE causal LM of FAMILY (MOE_FAMILIES) over the character tokenizer's vocabulary, in memory.
    `router_std`: the routers' init; a small one makes near-ties between experts of real weight."""
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False, num_experts_per_tok=top_k)
    per_family = {
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_experts=experts, moe_intermediate_size=hidden_size,
                                                               shared_expert_intermediate_size=hidden_size)),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=experts,
                                                                 moe_intermediate_size=hidden_size)),
        "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=experts)),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=experts)),
    }
    config_cls, model_cls, extra = per_family[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra))
    with torch.no_grad():  # the routers start at zero in some families: random routers make real choices
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, router_std)
    return model.eval()


def build_moe_model_dir(path: Path, family: str = "qwen3_moe", seed: int = 0, *, router_std: float = 0.02,
                        **shape) -> Path:
    """`build_moe_model` saved with the character tokenizer, its output layer sharpened as in
    `build_model_dir`: an MoE checkpoint `miles train --hf-checkpoint` runs. Its routers start
    small, so bf16 rounding flips choices between experts that both carry weight (as in a trained
    MoE), not only between negligible ones."""
    import torch

    model = build_moe_model(family, seed, router_std=router_std, **shape)  # shape: hidden_size, layers, experts, top_k
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
