"""Custom generation functions for tests (`--custom-generate-function-path`): two policy turns with a
tool's output between them."""

from __future__ import annotations

TOOL_TEXT = "<result>42</result>"


async def two_turns(client, sample, sampling, masked_log_prob: float = 0.0):
    """Policy turn (half the budget), the tool's fixed output (masked), policy turn (the rest)."""
    half = max(1, sampling.max_new_tokens // 2)
    tokens, mask, log_probs = list(sample.tokens), [], []
    first = await client.generate(tokens, max_new_tokens=half)
    tool = client.tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    tokens += first.token_ids + tool
    mask += [1] * len(first.token_ids) + [0] * len(tool)
    log_probs += first.log_probs + [masked_log_prob] * len(tool)
    second = await client.generate(tokens, max_new_tokens=half)
    tokens += second.token_ids
    mask += [1] * len(second.token_ids)
    log_probs += second.log_probs
    sample.tokens, sample.response_length = tokens, len(tokens) - len(sample.tokens)
    sample.loss_mask, sample.rollout_log_probs = mask, log_probs
    return sample


async def two_turns_other_masked_log_probs(client, sample, sampling):
    """`two_turns` with nonsense where the mask is 0: a run must train exactly as with `two_turns`."""
    return await two_turns(client, sample, sampling, masked_log_prob=-50.0)


async def wrong_mask(client, sample, sampling):
    sample = await two_turns(client, sample, sampling)
    sample.loss_mask = sample.loss_mask[:-1]
    return sample
