"""The running batch of `miles serve`'s continuous batching: one KV cache for every sequence being
decoded, and the three operations on it — prefill newcomers, decode one token for every row, drop
rows — with per-row lengths standing in for the attention mask.

Layout: every row is right-aligned in a DynamicCache of width W: row i's L_i cached tokens fill
columns [W - L_i, W) and the columns left of them are padding (zero keys and values, masked out).
So the (B, W) attention mask is a function of the lengths alone, positions are per row (a row's
next token sits at position L_i, whatever W is), and a decode step appends one column that every
row uses. Newcomers are prefilled on their own (left-padded, as LocalEngine does) and merged in by
left-padding the narrower of the two caches along time and concatenating along batch; finished
rows leave through index_select, and columns no row uses any more are cut from the left.

Shapes: B rows, W cache width, H KV heads, D head dim, V vocabulary.

`SlotBatch` is the same batch on the local engine's fast path (LocalEngine.runner): each row owns
a slot of the runner's slot KV cache, prefills are packed, a step runs at the smallest batch bucket
covering the rows' slots (a CUDA graph replay on a GPU), rows that leave free their slots for the
next newcomers, and rows of high slots move down into freed ones. The cache grows (its contents
copied) when more rows or longer rows than it holds arrive; the scheduler's --max-total-tokens
budget bounds rows x longest row as before.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from miles.rollout.local.decode import CachedForward
from miles.rollout.local.runner import LENGTH_STEP, ModelRunner
from miles.rollout.local.slot_cache import batch_buckets, bucket


def _layers_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, each (B, H, W, D)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pads a (B, H, W, D) cache tensor with zero columns on the left, to `width` columns."""
    missing = width - t.shape[-2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))


def _check_plain_dynamic(cache: DynamicCache) -> None:
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"DynamicLayer"}:
        raise ValueError(f"miles serve batches plain DynamicCache layers only; this model's cache has {kinds} "
                         "(sliding-window or hybrid attention)")


class RunningBatch:
    """The KV state of the sequences being decoded, in row order; the scheduler keeps the rows'
    Python-side state in the same order."""

    def __init__(self, model, *, pad_token_id: int):
        self.model = model
        self.config = model.config
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.forward = CachedForward(model)
        _check_plain_dynamic(DynamicCache(config=self.config))
        self.cache: DynamicCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,) cached tokens per row
        self.width = 0  # W

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])

    def clear(self) -> None:
        self.cache, self.width = None, 0
        self.lengths = self.lengths[:0]

    def _mask(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width) long attention mask of right-aligned rows."""
        cols = torch.arange(width, device=self.device)
        return (cols[None, :] >= width - lengths[:, None]).long()

    # -- prefill -----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], keep_logits: int = 1) -> torch.Tensor:
        """Runs `prompts` (left-padded to the longest) through the model and merges their cache in
        as new rows at the end of the batch.

        Returns the logits (Bn, K, V) of each prompt's last `keep_logits` positions (0: all).
        """
        width = max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
        mask = self._mask(lengths, width)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (Bn, P): as LocalEngine's prefill
        cache = DynamicCache(config=self.config)
        logits = self.forward(input_ids.to(self.device), mask, positions, torch.arange(width, device=self.device),
                              cache, logits_to_keep=keep_logits)
        self._merge(cache, lengths, width)
        return logits

    @torch.no_grad()
    def score(self, prompt: list[int], keep_logits: int) -> torch.Tensor:
        """The logits (K, V) of one prompt's last `keep_logits` positions, leaving the batch as it is."""
        positions = torch.arange(len(prompt), device=self.device)[None]
        logits = self.forward(torch.tensor([prompt], device=self.device), torch.ones_like(positions), positions,
                              positions[0], DynamicCache(config=self.config), logits_to_keep=keep_logits)
        return logits[0]

    def _merge(self, cache: DynamicCache, lengths: torch.Tensor, width: int) -> None:
        """Appends a prefilled cache's rows: both caches left-padded to the wider, then concatenated."""
        if self.cache is None:
            self.cache, self.lengths, self.width = cache, lengths, width
            return
        merged = max(self.width, width)
        layers = [(torch.cat([_left_pad(k, merged), _left_pad(k2, merged)]),
                   torch.cat([_left_pad(v, merged), _left_pad(v2, merged)]))
                  for (k, v), (k2, v2) in zip(_layers_kv(self.cache), _layers_kv(cache))]
        self.cache = DynamicCache(ddp_cache_data=layers, config=self.config)
        self.lengths = torch.cat([self.lengths, lengths])
        self.width = merged

    # -- decode ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token (B,) per row at each row's own next position; returns the logits (B, V)."""
        mask = self._mask(self.lengths + 1, self.width + 1)  # (B, W + 1): the new column is every row's
        positions = self.lengths[:, None]  # (B, 1): a row's next token sits after its L_i tokens
        cache_position = torch.arange(self.width, self.width + 1, device=self.device)
        logits = self.forward(tokens[:, None].to(self.device), mask, positions, cache_position, self.cache,
                              logits_to_keep=1)
        self.lengths = self.lengths + 1
        self.width += 1
        return logits[:, -1]

    def keep(self, rows: list[int]) -> None:
        """Keeps only these rows (in this order), then cuts the columns no kept row uses."""
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows, device=self.device)
        self.lengths = self.lengths.index_select(0, index)
        cut = self.width - int(self.lengths.max())  # columns left of the longest row: padding for all
        layers = [(k.index_select(0, index)[:, :, cut:], v.index_select(0, index)[:, :, cut:])
                  for k, v in _layers_kv(self.cache)]
        self.cache = DynamicCache(ddp_cache_data=layers, config=self.config)
        self.width -= cut

    def kv_bytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in _layers_kv(self.cache))


class SlotBatch:
    """RunningBatch's operations on a ModelRunner's slots; row i is slot `slots[i]`."""

    GROW = 4 * LENGTH_STEP  # slot columns added at a time when a row outgrows the cache

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device = runner.device
        self.slots: list[int] = []
        self.lengths_host: list[int] = []  # cached tokens per row

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def width(self) -> int:
        return max(self.lengths_host, default=0)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths_host, dtype=torch.long, device=self.device)

    def clear(self) -> None:
        """No rows; the cache and graphs go back to the allocator (the next prefill allocates again)."""
        self.slots, self.lengths_host = [], []
        self.runner.release()

    def _room(self, rows: int, length: int) -> None:
        """A cache of at least `rows` slots (a batch bucket) of `length` columns, grown by GROW at least."""
        cache = self.runner.cache
        rows = bucket(rows, batch_buckets(rows))
        if cache is None:
            self.runner.reserve(rows, length)
        elif cache.slots < rows or cache.length < length:
            longer = max(length, cache.length + self.GROW) if length > cache.length else cache.length
            self.runner.reserve(rows, longer, keep=True)

    def _free(self, n: int) -> list[int]:
        taken = set(self.slots)
        return [s for s in range(self.runner.cache.slots) if s not in taken][:n]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], keep_logits: int = 1) -> torch.Tensor:
        """Prefills `prompts` into free slots as new rows at the end; the logits (Bn, K, V) of each
        prompt's last K = keep_logits positions (0: all; the prompts then have one length)."""
        self._room(self.size + len(prompts), max(len(p) for p in prompts) + 1)
        slots = self._free(len(prompts))
        keep = [keep_logits or len(p) for p in prompts]
        logits = self.runner.prefill(slots, prompts, keep)
        self.slots += slots
        self.lengths_host += [len(p) for p in prompts]
        return logits.view(len(prompts), keep[0], -1)

    @torch.no_grad()
    def score(self, prompt: list[int], keep_logits: int) -> torch.Tensor:
        """The logits (K, V) of one prompt's last positions, through a free slot the batch does not keep."""
        self._room(self.size + 1, len(prompt) + 1)
        return self.runner.prefill(self._free(1), [prompt], [keep_logits or len(prompt)])

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token (B,) per row at each row's next position; returns the logits (B, V)."""
        self._room(self.size, self.width + 1)
        batch = bucket(max(self.slots) + 1, self.runner.buckets)
        index = torch.tensor(self.slots, device=self.device)
        fed = torch.zeros(batch, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, dtype=torch.long, device=self.device)
        fed[index] = tokens.to(self.device)
        positions[index] = self.lengths
        logits = self.runner.decode(batch, fed, positions, self.width + 1)[index]
        self.lengths_host = [n + 1 for n in self.lengths_host]
        return logits

    def keep(self, rows: list[int]) -> None:
        """Keeps only these rows (in this order); rows of slots above the bucket the rest need move down."""
        self.slots = [self.slots[i] for i in rows]
        self.lengths_host = [self.lengths_host[i] for i in rows]
        if not self.slots:
            return
        size = bucket(len(self.slots), self.runner.buckets)
        movers = [i for i, s in enumerate(self.slots) if s >= size]
        if movers:
            taken = set(self.slots)
            holes = [s for s in range(size) if s not in taken][: len(movers)]
            self.runner.cache.move([self.slots[i] for i in movers], holes)
            for i, hole in zip(movers, holes):
                self.slots[i] = hole

    def kv_bytes(self) -> int:
        return self.runner.cache.nbytes() if self.runner.cache is not None else 0

