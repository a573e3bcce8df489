"""Structured facts read from whatever was pasted: framework, versions, flags, MoE / FP8, error types, metrics.

A user's report is prose, a launch script, a stack trace and a `pip freeze` in one file (a GitHub issue
pasted as Markdown, code fences and all). `read_facts` pulls out what a maintainer would ask for first;
the doctor prints it when nothing matches ("what it could read, what is missing") and the retrieval
adds it to its query, so `--colocate` or `MoE` weigh in even when they sit in a config block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from miles.debug.doctor.readers import CANONICAL

# Names as users write them -> the framework (the knowledge base's `framework` values).
FRAMEWORKS = {
    "miles": r"\bmiles\b(?! per)", "slime": r"\bslime\b", "verl": r"\bverl\b",
    "trl": r"\bTRL\b|\bGRPOTrainer\b|\btrl\.",
    "openrlhf": r"\bOpenRLHF\b", "prime-rl": r"\bprime[-_]rl\b", "nemo-rl": r"\bNeMo[-_ ]RL\b|\bnemo_rl\b",
    "skyrl": r"\bSkyRL\b", "areal": r"\bAReaL\b", "sglang": r"\bsglang\b", "vllm": r"\bvllm\b",
    "megatron": r"\bMegatron\b|\bmegatron\.", "deepspeed": r"\bDeepSpeed\b", "fsdp": r"\bFSDP2?\b",
}
# Packages whose versions decide most incompatibilities; `pip freeze` lines, `name==x`, `name version: x`.
PACKAGES = ("torch", "pytorch", "transformers", "vllm", "sglang", "megatron-core", "megatron-lm", "megatron",
            "transformer-engine", "flash-attn", "deepspeed", "ray", "trl", "verl", "slime", "miles", "openrlhf",
            "accelerate", "peft", "cuda", "nccl", "triton", "liger-kernel", "flashinfer-python",
            "flashinfer", "xformers")
_SAME = {"pytorch": "torch", "megatron-lm": "megatron-core", "megatron": "megatron-core",
         "flashinfer-python": "flashinfer"}
# `name==1.2.3` (pip freeze), `name 1.2.3`, `name version: 1.2.3`, and `name version: <commit>` (a git checkout).
_VERSION = re.compile(r"(?i)(?<![\w-])(" + "|".join(re.escape(p).replace(r"\-", "[-_ ]?") for p in PACKAGES)
                      + r")(?:(?:[-_ ]?version\s*[:=]\s*(?P<commit>[0-9a-f]{7,40})\b)"
                        r"|(?:[-_ ]?version)?\s*(?:==|:|=|\s)"
                        r"\s*v?(?P<v>\d+\.\d+\w*(?:[.+]\w+)*))")  # 2.5.1+cu121, 0.8.5.post1; not a sentence's full stop
# RL frameworks come before the engines and libraries they run on: a slime report mentions SGLang more often.
RL_FRAMEWORKS = ("miles", "slime", "verl", "trl", "openrlhf", "prime-rl", "nemo-rl", "skyrl", "areal")
# The launch flags the guide's culprits hinge on (slime/Miles names, verl's and vLLM's spellings too).
FLAGS = {
    "load": r"--load\b", "ref_load": r"--ref-load\b", "hf_checkpoint": r"--hf-checkpoint\b",
    "colocate": r"--colocate\b|\bcolocate[d]?\b", "mem_fraction": r"--sglang-mem-fraction-static|mem_fraction_static|"
                                                                r"gpu_memory_utilization",
    "pp_size": r"pipeline[-_]model[-_]parallel[-_]size|\bpp_size\b|\bpp\s*=\s*\d", "tp_size":
        r"tensor[-_]model[-_]parallel[-_]size|\btp_size\b|tensor_parallel_size",
    "cp_size": r"context[-_]parallel[-_]size|\bcp_size\b", "offload": r"\boffload\b",
    "routing_replay": r"routing[-_]replay|routed[-_]experts|\bR3\b", "deterministic": r"determinis",
    "resume": r"\bresum(?:e|ed|ing)\b|--load\b.*checkpoint", "async": r"\basync\b",
    "attention_backend": r"--attention-backend|attn_implementation|attention_backend",
    "gradient_accumulation": r"gradient[-_ ]accumulation|grad_accum", "max_len": r"max[-_]model[-_]len|"
                                                                           r"max[-_]response[-_]len|max_prompt_length",
}
_MOE = re.compile(r"(?i)\bMoE\b|mixture[- ]of[- ]experts|\bexperts?\b|-A\d+B\b|\bMixtral\b|\bOLMoE\b|"
                  r"\bQwen\d?(?:\.\d)?-?MoE\b|\bDeepSeek-V[23]\b|num_experts|moe_")
_FP8 = re.compile(r"(?i)\bfp8\b|float8|e4m3|--fp8-")
_ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt))\b|\b(CUDA error|NCCL error|illegal memory access|"
                    r"out of memory|Segmentation fault|timed out|Watchdog caught collective operation timeout|"
                    r"core dumped|NaN|nan loss)\b")
_METRIC = re.compile(r"(?<![\w/.\-])['\"]?([a-z][\w]*(?:/[\w@.\-]+)+|grad_norm|grad norm|kl|entropy|reward|"
                     r"forward_logp_max_diff|loss)['\"]?\s*[:=]\s*(?:tensor\()?([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|"
                     r"\.\d+|nan|inf))\b", re.IGNORECASE)
_MODEL = re.compile(r"(?i)\b((?:Qwen|Llama|Meta-Llama|Mistral|Mixtral|DeepSeek|GLM|Gemma|Phi|OLMo|SmolLM|Kimi)"
                    r"[\w.\-]*\d[\w.\-]*)")


@dataclass
class Facts:
    frameworks: list[str] = field(default_factory=list)  # most mentioned first
    versions: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)  # FLAGS keys seen
    models: list[str] = field(default_factory=list)
    moe: bool = False
    fp8: bool = False
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> the last value seen
    pip_freeze: bool = False

    def terms(self) -> list[str]:
        """The facts as query words for the retrieval (flags and switches spelled as in the cases). Not the
        framework's name: it says little of the cause, and the distractors' frameworks would weigh on it."""
        words = [*(f.replace("_", " ") for f in self.flags), *self.errors]
        return words + ["MoE experts"] * self.moe + ["fp8"] * self.fp8

    def summary(self) -> list[str]:
        """What was read, one line per kind, for the doctor's report."""
        out = []
        if self.frameworks:
            out.append("framework: " + ", ".join(self.frameworks))
        if self.versions:
            out.append("versions: " + versions_text(self.versions))
        if self.models:
            out.append("model: " + ", ".join(self.models[:3]) + (" (MoE)" if self.moe else ""))
        elif self.moe:
            out.append("model: MoE")
        if self.flags or self.fp8:
            out.append("settings: " + ", ".join([*self.flags, *(["fp8"] if self.fp8 else [])]))
        if self.errors:
            out.append("errors: " + ", ".join(self.errors[:6]))
        if self.metrics:
            out.append("metrics: " + ", ".join(f"{k}={v}" for k, v in list(self.metrics.items())[:8]))
        return out

    def missing(self) -> list[str]:
        """What a maintainer would ask for that the input does not hold."""
        out = []
        if not self.versions:
            out.append("versions (`pip freeze`, or the framework / torch / engine versions)")
        if not self.flags and not self.frameworks:
            out.append("the launch command or config")
        if not self.errors:
            out.append("an error line or stack trace (the first error, not the last)")
        if not self.metrics:
            out.append("metric values over steps (reward, KL, grad_norm, the train/engine log-prob gap)")
        return out

    def to_dict(self) -> dict:
        return {"frameworks": self.frameworks, "versions": self.versions, "flags": self.flags, "models": self.models,
                "moe": self.moe, "fp8": self.fp8, "errors": self.errors, "metrics": self.metrics,
                "pip_freeze": self.pip_freeze}


def read_versions(text: str) -> dict[str, str]:
    """Package -> the first version TEXT gives it (PACKAGES, by their canonical names)."""
    versions: dict[str, str] = {}
    for m in _VERSION.finditer(text):
        name = re.sub(r"[_ ]", "-", m.group(1).lower())
        versions.setdefault(_SAME.get(name, name), m["v"] or f"commit {m['commit']}")
    return versions


def versions_text(versions: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in versions.items())


def read_facts(text: str) -> Facts:
    f = Facts()
    counts = {name: len(re.findall(rx, text, re.IGNORECASE if name != "trl" else 0)) for name, rx in FRAMEWORKS.items()}
    f.frameworks = [n for n, k in sorted(counts.items(), key=lambda kv: (kv[0] not in RL_FRAMEWORKS, -kv[1])) if k]
    f.pip_freeze = len(re.findall(r"(?m)^[A-Za-z0-9][\w.\-]*==\d[\w.+\-]*\s*$", text)) >= 5
    f.versions = read_versions(text)
    f.flags = [name for name, rx in FLAGS.items() if re.search(rx, text, re.IGNORECASE)]
    f.models = list(dict.fromkeys(m.group(1) for m in _MODEL.finditer(text)))[:5]
    f.moe, f.fp8 = bool(_MOE.search(text)), bool(_FP8.search(text))
    f.errors = list(dict.fromkeys(m.group(1) or m.group(2) for m in _ERROR.finditer(text)))[:10]
    for m in _METRIC.finditer(text):
        key = CANONICAL.get(m.group(1), m.group(1))
        f.metrics[key] = m.group(2)
    return f
