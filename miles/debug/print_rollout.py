"""`--debug-rollout-print-every N`: a readable listing of a rollout's samples in the log."""

from __future__ import annotations

import logging

from miles.bridge.types import Sample, mean_rollout_log_prob

logger = logging.getLogger("miles")


def prompt_text(prompt) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn is what was asked
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        return users[-1] if users else str(prompt)
    return str(prompt)


def log_rollout_samples(rollout_id: int, samples: list[Sample], limit: int | None = None) -> None:
    shown = samples if limit is None else samples[:limit]
    logger.info("rollout %d: %d samples%s", rollout_id, len(samples),
                "" if len(shown) == len(samples) else f" (first {len(shown)} shown)")
    for s in shown:
        lp = mean_rollout_log_prob([s])
        logger.info("  [%d] group %d | reward %.3f | %d tokens | %s | mean logp %s\n      prompt:   %s\n"
                    "      response: %s\n      label:    %s",
                    s.index, s.group_index, s.reward, s.response_length, s.status,
                    f"{lp:.3f}" if lp is not None else "n/a", _one_line(prompt_text(s.prompt)),
                    _one_line(s.response), s.label)


def _one_line(text: str, width: int = 200) -> str:
    text = " ".join(str(text).split("\n"))
    return text if len(text) <= width else text[: width - 3] + "..."
