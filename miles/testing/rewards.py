"""Rewards for tiny random models (tests, `miles selftest`): dense, so a random policy still learns."""


def digit_share(sample) -> float:
    """Share of digits in the response: varies across random responses, unlike a math reward."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def vowel_share(sample) -> float:
    """Share of vowels in the response: varies even across near-uniform samples of a large vocabulary."""
    text = sample.response
    return sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1)
