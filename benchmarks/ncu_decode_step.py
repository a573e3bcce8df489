"""The fast engine's generate at one batch, bracketed for Nsight Compute: one generate as a warm-up (it captures the
CUDA graphs), then a second between cudaProfilerStart and cudaProfilerStop, so that ncu with --profile-from-start off
reads only the second one's kernels (each kernel node of a graph replay is one result). Qwen2.5-0.5B's shape in bf16,
random weights and prompts, EOS off, the engine as engine_decode.py's `fast-compiled` row runs it.

    ncu --clock-control none --profile-from-start off --launch-skip 2500 --launch-count 240 --csv --page raw \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,... \\
        python3 benchmarks/ncu_decode_step.py --batch 512 --new-tokens 8

(On an H100 that command read 162 kernels: the last step's last five layers, its LM head and draw, and the torch
kernels after it; the prefill of 512 prompts of 128 tokens is about 1,560 kernels under torch's profiler and a step
about 215, so fewer kernels reach ncu than that count suggests: set the skip from a first run's kernel names.)
"""

from __future__ import annotations

import argparse

import torch
from common import QWEN_0_5B
from transformers import AutoModelForCausalLM, Qwen2Config

from miles.config import SamplingParams
from miles.rollout.local import LocalEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN_0_5B), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to("cuda").eval()
    engine = LocalEngine(model, eos_token_ids=[], pad_token_id=0, decoder="fast", compile=True)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    engine.generate(prompts, sampling, list(range(args.batch)))  # the warm-up: captures the graphs
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    engine.generate(prompts, sampling, list(range(args.batch)))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
