"""Rewards for tiny random models (tests, `miles selftest`): dense, so a random policy still learns."""


def digit_share(sample) -> float:
    """Share of digits in the response: varies across random responses, unlike a math reward."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
