"""Rewards for tiny random models (tests, `miles selftest`): dense, so a random policy still learns."""


def digit_share(sample) -> float:
    """Share of digits in the response: varies across random responses, unlike a math reward."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def vowel_share(sample) -> float:
    """Share of vowels in the response: varies even across near-uniform samples of a large vocabulary."""
    text = sample.response
    return sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1)


def digit_share_odd_sums(sample) -> float:
    """0 for every response to a prompt whose label is an even number (a group that carries no signal),
    the digit share otherwise: half of the tiny arithmetic prompts make uniform groups."""
    return 0.0 if int(sample.label) % 2 == 0 else digit_share(sample)
