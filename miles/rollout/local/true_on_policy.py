"""`--true-on-policy-mode`: the engine samples from exactly the distribution the trainer computes.

The engine decodes fast, with its KV cache, which computes slightly different numbers from the
trainer's full forward (other shapes, other reduction orders). In this mode each rollout is then
checked against the trainer's own computation: the engine runs the trainer's scoring function
(`miles.train.batch.score_sequences`, handed in by the loop: the rollout side does not import the
training side) on the same batch layout and micro-batches, with the same weights and autocast,
and re-draws every response token from those probabilities with the token's own
uniform number. Where a drawn token differs from the decoded one (a draw within rounding of a
CDF boundary), the response is cut there, the drawn token is kept, and decoding resumes; the
check repeats until every token agrees. The log-probs the engine reports are then the trainer's,
bit for bit, and every token was sampled from exactly those probabilities: the rollout is
on-policy by construction, not re-scored after the fact.

On a GPU the decode and the scoring run miles.utils.invariant's batch-invariant kernels, so they compute
the same numbers and the check finds nothing to re-draw (none in bf16 at the Qwen2.5-0.5B shape on the
H200); on the CPU, in fp32, a disagreement is rare.

Cost: one scoring pass of the rollout (plus one per round with a disagreement).
Top-p truncation would make the sampled distribution differ from the reported one, so this mode
takes --rollout-top-p 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput
from miles.rollout.sampling import sample_tokens

# (model, sequences, response lengths, on_logits=sink) -> (log-probs (B, R) of the response tokens, None); the
# sink gets each micro-batch's logits (start, stop, logits (stop - start, R, V)), which are not kept after it
ScoreFn = Callable[..., tuple[torch.Tensor, None]]


class TrainerComputationVerifier:
    def __init__(self, score: ScoreFn):
        self.score = score

    def verify(self, engine, prompts: list[list[int]], outputs: list[GenerationOutput], sampling: SamplingParams,
               uniforms: torch.Tensor) -> list[GenerationOutput]:
        """`engine` is the LocalEngine whose model and decode loop the check uses; returns the
        outputs with every token agreed and the trainer's log-probs, each counting its re-draws."""
        redrawn = [0] * len(outputs)
        # Each round fixes at least the first disagreeing token of every row, so the agreed prefix
        # grows by one a round; more rounds than tokens means the two computations are not stable.
        rounds = sampling.max_new_tokens + 2
        on_device = uniforms.to(engine.device)  # once: a copy per draw would wait for the forward before it
        for _ in range(rounds):
            drawn: list[torch.Tensor] = []

            def draw(start: int, stop: int, logits: torch.Tensor) -> None:
                # One micro-batch's logits at a time: the whole rollout's B x R x V would not fit at scale. A row's
                # positions past its response's end are drawn too and dropped below; nothing waits for the device.
                width = logits.shape[1]
                drawn.extend(sample_tokens(logits[j], sampling, on_device[start + j, :width])[0]
                             for j in range(stop - start))

            log_probs, _ = self.score(engine.model, [p + o.token_ids for p, o in zip(prompts, outputs)],
                                      [len(o.token_ids) for o in outputs], on_logits=draw)
            tokens = torch.stack(drawn).cpu()  # (B, R): the host waits once, after the last micro-batch
            redo = {}
            for i, out in enumerate(outputs):
                n = len(out.token_ids)
                mismatch = (tokens[i, :n] != torch.tensor(out.token_ids)).nonzero()
                if len(mismatch):
                    redo[i] = (int(mismatch[0]), int(tokens[i, int(mismatch[0])]))
            if not redo:
                log_probs = log_probs.cpu()
                return [dataclasses.replace(out, log_probs=log_probs[i, : len(out.token_ids)].tolist(),
                                            redrawn=redrawn[i]) for i, out in enumerate(outputs)]
            for i in redo:
                redrawn[i] += 1
            prefixes = {i: outputs[i].token_ids[:j] + [token] for i, (j, token) in redo.items()}
            outputs = self._resume(engine, prompts, outputs, prefixes, sampling, uniforms)
        raise RuntimeError(f"true on-policy: engine and trainer still disagreed after {rounds} rounds")

    @staticmethod
    def _resume(engine, prompts, outputs, prefixes: dict[int, list[int]], sampling: SamplingParams,
                uniforms: torch.Tensor) -> list[GenerationOutput]:
        """Decodes on after each re-drawn token, all such rows in one batch; every position keeps
        its own uniform number (the next check decides what stands)."""
        outputs = list(outputs)
        resume = []
        for i, prefix in prefixes.items():
            if prefix[-1] in engine.eos_token_ids or len(prefix) == sampling.max_new_tokens:
                reason = "stop" if prefix[-1] in engine.eos_token_ids else "length"
                outputs[i] = GenerationOutput(prefix, [0.0] * len(prefix), reason, engine.weight_version)
            else:
                resume.append(i)
        if resume:
            width = sampling.max_new_tokens - min(len(prefixes[i]) for i in resume)
            rest_uniforms = torch.zeros(len(resume), width, dtype=uniforms.dtype)
            for row, i in enumerate(resume):
                left = uniforms[i, len(prefixes[i]):]
                rest_uniforms[row, : len(left)] = left
            rests = engine.decode([prompts[i] + prefixes[i] for i in resume], sampling, rest_uniforms,
                                  limits=[sampling.max_new_tokens - len(prefixes[i]) for i in resume])
            for i, rest in zip(resume, rests):
                tokens = prefixes[i] + rest.token_ids
                outputs[i] = GenerationOutput(tokens, [0.0] * len(tokens), rest.finish_reason, rest.weight_version)
        return outputs
