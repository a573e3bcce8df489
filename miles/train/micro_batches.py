"""How a rank's rows are cut into micro-batches: a fixed count of samples each (--micro-batch-size),
or as many samples as fit a token budget (--use-dynamic-batch-size --max-tokens-per-gpu, as in slime).

A micro-batch is a contiguous range [start, stop) of the batch's rows, so the loss of a row is the
same sum whichever way the rows are cut (its share of the global batch's mean does not depend on its
micro-batch); only the floating-point order of the accumulated gradients changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.errors import UsageError


def fixed(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Rows [start, stop) in micro-batches of `size` samples (the last may be shorter)."""
    return [(lo, min(lo + size, stop)) for lo in range(start, stop, size)]


def cost(lengths: Sequence[int], lo: int, hi: int, *, packed: bool) -> int:
    """Tokens a forward of rows [lo, hi) computes: their real tokens packed (thd), the padded grid of
    the longest of them otherwise (bshd)."""
    rows = lengths[lo:hi]
    return sum(rows) if packed else (hi - lo) * max(rows)


def by_tokens(lengths: Sequence[int], start: int, stop: int, max_tokens: int, *, packed: bool) -> list[tuple[int, int]]:
    """Rows [start, stop) cut greedily, in order, into micro-batches of at most `max_tokens` tokens
    (`cost`). A row longer than the budget alone is refused: it could not fit any micro-batch."""
    parts, lo = [], start
    for i in range(start, stop):
        if lengths[i] > max_tokens:
            raise UsageError(f"--max-tokens-per-gpu {max_tokens} is below sample {i}'s {lengths[i]} tokens "
                             f"(prompt + response): raise it to at least {max(lengths[start:stop])}")
        if i > lo and cost(lengths, lo, i + 1, packed=packed) > max_tokens:
            parts.append((lo, i))
            lo = i
    if stop > lo:
        parts.append((lo, stop))
    return parts


def split_to(parts: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """`parts` cut further until there are `count` of them, halving the one of most rows each time:
    every rank of a sharded trainer must run the same number of forwards (each one's collectives)."""
    parts = list(parts)
    while len(parts) < count:
        i = max(range(len(parts)), key=lambda k: parts[k][1] - parts[k][0])
        lo, hi = parts[i]
        if hi - lo < 2:
            raise ValueError(f"cannot cut {parts} into {count} non-empty micro-batches")
        mid = (lo + hi) // 2
        parts[i:i + 1] = [(lo, mid), (mid, hi)]
    return parts
