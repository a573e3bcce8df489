"""The fast decode path's model runner: the HF model's own modules, run over a slot KV cache.

The runner keeps the model's modules (embeddings, norms, projections, MLPs, the LM head; so the
numbers are the model's own, and weight updates reach it as they reach the model) and replaces
only attention and its cache:
  - `SlotKVCache` (slot_cache.py): per layer an (S, H, L, D) key and value tensor, views of one tensor allocated
    once. A sequence owns a slot; its token at position p is cached at column p of its slot.
  - prefill: the prompts of a batch packed into one row of tokens (no padding), attention per
    prompt (miles.utils.varlen: torch's `varlen_attn` on a GPU in bf16, one causal SDPA per prompt on the CPU),
    their keys and values written to their slots in one indexed copy per layer (in `_pre_attention`; on a GPU by
    decode_fused's RoPE kernel, which takes each packed token's slot). Its index tensors go up in one copy
    (`upload`), from pinned memory on a GPU, so the host never waits for the GPU's queued work to build the next.
    A prompt that comes again in the call (a GRPO group) is computed once and its slot copied; on the CPU a prefix the
    prompts share (a chat template's system prompt) is computed once too, the rest attending to it;
  - decode: one token for each of slots [0, b), attending to columns [0, position] of its slot. On a GPU a
    Triton kernel (decode_attention.py) reads each slot's keys up to its position, once for the g query heads
    that share a KV head; elsewhere SDPA attends to columns [0, Lb) under a (b, Lb) mask of the positions,
    the g query heads as g queries of one head (GQA reads each cached key once). On a GPU each (b, Lb)
    bucket's step is captured once in a CUDA graph and replayed; its logits land in one shared buffer, and
    the step's pointwise work (norms, RoPE with the cache writes, SiLU-and-multiply) runs in decode_fused.py's
    Triton kernels instead of the layer functions below (the prefill's too, outside --true-on-policy-mode), and
    a layer's two norms have no kernels of their own: their weights are folded into the projections after them and
    the kernels after those scale each row (`_folded_layer`).

Each layer runs as two functions of tensors, `_pre_attention` (norm, one fused q/k/v projection,
RoPE, the keys and values written into the cache) and `_post_attention` (output projection,
residual, norm, one fused gate/up projection, activation, down projection, residual), computing what
the HF modules compute. The fused projections (weights.py) are single tensors whose row blocks *are* the modules'
parameters (views), so a weight update copied into the parameters is in them. With `compile=True` the two functions
go through torch.compile (one trace for every layer and batch), so the elementwise work between
the matmuls runs as a few fused kernels. On the CPU in fp32 (not compiled) the projections and the LM
head run on copies of their weights packed once for oneDNN (`weights.Packed`), packed again when a weight
update has written into the parameters. Under an autocast to bf16 over fp32 weights (true on-policy
mode) they run on bf16 copies made once (`weights.Cast`), written again in place after a weight update; on a
GPU decode attention then runs miles.utils.invariant's kernel: what the trainer computes, bit for bit.

Shapes: S slots, L slot length, H KV heads, Q query heads, D head dim, V vocabulary, N packed tokens.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch
import torch.nn.functional as F

from miles.rollout.local.slot_cache import SlotKVCache, batch_buckets, upload
from miles.rollout.local.weights import Cast, Folded, LayerWeights, Packed
from miles.utils import invariant
from miles.utils.autocast import autocast_dtype
from miles.utils.varlen import packed_causal_attention

logger = logging.getLogger("miles")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
LENGTH_STEP = 128  # slot columns attended in multiples of this (a CUDA graph per length bucket)
EAGER_LENGTH_STEP = 16  # the same without graphs (the CPU): attention reads little beyond the longest row
SHARED_PREFIX_MIN = 16  # the CPU prefill computes a prefix this long, common to a call's prompts, once


def unsupported_reason(model) -> str | None:
    """Why the runner cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (the fast path runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    if any(kind != "full_attention" for kind in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"{rope.get('rope_type', rope.get('type'))} RoPE (its frequencies depend on the sequence length)"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama RMSNorm: normalised in fp32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; oneDNN's linear when `w` is a weight packed by `weights.pack_weight` (the CPU decode)."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _pre_attention(x, norm, qkv_w, qkv_b, q_norm, k_norm, cos, sin, keys, values, rows, *, heads: int, kv_heads: int,
                   eps: float):
    """Tokens x (N, hidden) -> queries (N, Q, D), keys and values (N, H, D), RoPE applied (to the queries and keys in
    one pass); the keys and values also written into the cache `keys` and `values` (S, H, L, D) at `rows`
    (ModelRunner._rows) of the caches seen as (S * H * L, D), by `index_copy_`. (On a CPU with passive OpenMP threads
    `index_put_` opened a parallel region for each write, and waking its sleeping thread cost about 70 us where the
    write takes 8: BENCHMARKS.md, 2026-12-05.) Under torch.compile the writes fuse into the kernel that applies RoPE."""
    h = _linear(_rms_norm(x, norm, eps), qkv_w, qkv_b)
    head_dim = cos.shape[-1]
    qk, v = h.view(x.shape[0], heads + 2 * kv_heads, head_dim).split([heads + kv_heads, kv_heads], dim=1)
    if q_norm is not None:  # Qwen3: per-head norms before RoPE
        q, k = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat([_rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)], dim=1)
    q, k = (qk * cos + _rotate_half(qk) * sin).split([heads, kv_heads], dim=1)
    keys.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(keys.dtype))
    values.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(values.dtype))
    return q, k, v


def _post_attention(x, attended, o_w, o_b, norm, gate_up_w, down_w, *, eps: float):
    """The rest of the layer: x (N, hidden) and the attention output (N, Q * D) -> the layer's output."""
    x = x + _linear(attended, o_w, o_b)
    gate, up = _linear(_rms_norm(x, norm, eps), gate_up_w).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down_w)


class ModelRunner:
    triton_decode = True  # decode attention on a GPU in decode_attention's kernel; False: SDPA (benchmarks compare)
    fused_decode = True  # a GPU decode step's and prefill's pointwise work in decode_fused's kernels; False: the
    # layer functions
    fold_norms = True  # a GPU decode step's and prefill's layers in `_folded_layer`; False: `_fused_layer` (benchmarks
    # compare)

    def __init__(self, model, *, cuda_graphs: bool = True, compile: bool = False):
        self.model = model
        self.inner = model.model
        cfg = model.config
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.group = self.q_heads // self.kv_heads
        self.device = next(model.parameters()).device
        self.dtype = self.inner.embed_tokens.weight.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.cache: SlotKVCache | None = None
        self.buckets: list[int] = []
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self._pre, self._post = _pre_attention, _post_attention
        if compile:
            self._pre = torch.compile(_pre_attention, dynamic=True, fullgraph=True)
            self._post = torch.compile(_post_attention, dynamic=True, fullgraph=True)
        self._weights: list[LayerWeights] = []
        # The CPU decode in fp32 runs its GEMMs on weights packed for oneDNN (not compiled: Inductor
        # packs CPU weights itself only when it may treat them as constants).
        self.pack = (self.device.type == "cpu" and self.dtype == torch.float32 and not compile
                     and torch.backends.mkldnn.is_available())
        self._head = Packed(model.lm_head.weight) if self.pack and model.lm_head.bias is None else None
        self._head_cast: Cast | None = None

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    # -- the cache -------------------------------------------------------------------------------

    def slot_bytes(self, length: int) -> int:
        return SlotKVCache.slot_bytes(layers=self.num_layers, length=length, kv_heads=self.kv_heads,
                                      head_dim=self.head_dim, dtype=self.dtype)

    def reserve(self, slots: int, length: int, *, keep: bool = False) -> None:
        """A cache of at least `slots` slots of `length` columns (length rounded up to LENGTH_STEP);
        a smaller one is replaced, its graphs dropped, and with `keep` its contents copied over."""
        length = -(-length // LENGTH_STEP) * LENGTH_STEP
        self.prepare_weights()
        if self.cache is not None and self.cache.slots >= slots and self.cache.length >= length:
            return
        old = self.cache if keep else None
        if old is not None:
            slots, length = max(slots, old.slots), max(length, old.length)
        self.release()
        self.cache = SlotKVCache(layers=self.num_layers, slots=slots, length=length, kv_heads=self.kv_heads,
                                 head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        if old is not None:
            self.cache.data[:, :, : old.slots, :, : old.length] = old.data
        # A bucket pays off as a captured graph; without graphs a step runs at its live rows' count.
        self.buckets = ([b for b in batch_buckets(slots) if b < slots] + [slots] if self.cuda_graphs
                        else list(range(1, slots + 1)))
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.zeros((), dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, positions)  # (1, L, D): the model's own RoPE
        self._cos, self._sin = cos[0, :, None], sin[0, :, None]  # (L, 1, D)
        self._tokens = torch.zeros(slots, dtype=torch.long, device=self.device)  # graph inputs
        self._positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._logits = torch.empty(slots, self.model.config.vocab_size, dtype=self.dtype, device=self.device)
        logger.info("Engine KV cache: %d slots x %d tokens (%.2f GiB, %s)%s", slots, length,
                    self.cache.nbytes() / (1 << 30), str(self.dtype).removeprefix("torch."),
                    "; decode steps captured in CUDA graphs per batch bucket" if self.cuda_graphs else "")

    def prepare_weights(self) -> None:
        """The layers' weights as the layer functions take them (weights.LayerWeights), made again (and the graphs that
        read them dropped) when the parameters are no longer their views; with the folded copies `_folded_layer`
        reads where a decode step runs it. The engine calls it before it measures the memory left for the cache."""
        if not self._weights or not all(w.current() for w in self._weights):
            self._weights = [LayerWeights(layer, self.pack) for layer in self.inner.layers]
            self._graphs, self._pool = {}, None  # they read the tensors the fusing replaced
        if self._folds_norms():
            for w in self._weights:
                w.folded()

    def release(self, weights: bool = False) -> None:
        """Drops the cache and every captured graph (their memory goes back to the allocator); with `weights`, the
        weights' folded copies too (the model is leaving the device; `prepare_weights` makes them again)."""
        self.cache, self._graphs, self._pool = None, {}, None
        if weights:
            for w in self._weights:
                w.folds = None

    def length_bucket(self, longest: int) -> int:
        """The columns a decode step attends to when no slot has more than `longest` tokens: a multiple
        of LENGTH_STEP when steps are captured in graphs (one per width), else of EAGER_LENGTH_STEP."""
        step = LENGTH_STEP if self.cuda_graphs else EAGER_LENGTH_STEP
        return min(self.cache.length, -(-longest // step) * step)

    # -- one transformer layer over rows of tokens ---------------------------------------------------

    def _cast(self) -> torch.dtype | None:
        """Under an autocast to a narrower dtype than the weights' (fp32 weights, bf16 autocast: true on-policy
        mode), the dtype the projections run in from copies made once; else None (the weights as they are)."""
        dtype = autocast_dtype(self.device.type) if self.dtype == torch.float32 else None
        return dtype if dtype != torch.float32 else None

    def _rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The (N * H) rows of a layer's cache seen as (S * H * L, D) that tokens at (slots[j], positions[j]) write:
        the same in every layer, so made once a forward."""
        heads = torch.arange(self.kv_heads, device=slots.device)
        return ((slots[:, None] * self.kv_heads + heads) * self.cache.length + positions[:, None]).view(-1)

    def _qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor):
        """Layer i's queries, keys and values of tokens x, the keys and values cached at `rows` (self._rows)."""
        w, cast = self._weights[i], self._cast()
        return self._pre(x, w.norm, w.projections(cast)[0], w.biases(cast)[0], w.q_norm, w.k_norm, cos, sin,
                         self.cache.keys[i], self.cache.values[i], rows, heads=self.q_heads, kv_heads=self.kv_heads,
                         eps=self.eps)

    def _finish_layer(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        w, cast = self._weights[i], self._cast()
        _, o_w, gate_up_w, down_w = w.projections(cast)
        return self._post(x, attended.reshape(x.shape[0], -1), o_w, w.biases(cast)[1], w.post_norm, gate_up_w,
                          down_w, eps=self.eps)

    def _lm_head(self, x: torch.Tensor, out: torch.Tensor | None = None, norm=None) -> torch.Tensor:
        """Logits of rows x (N, hidden) after the final norm (the model's module, or `norm` computing the same)."""
        h = (norm or self.inner.norm)(x)
        head = self.model.lm_head
        if (cast := self._cast()) is not None:  # as autocast computes head(h), from a copy cast once
            made = self._head_cast
            if made is None or made.copy.dtype != cast or made.weight is not head.weight:
                self._head_cast = Cast(head.weight, cast)
            logits = F.linear(h, self._head_cast.get(), None if head.bias is None else head.bias.to(cast))
            return logits if out is None else out.copy_(logits)
        if self._head is not None and self._head.weight is head.weight:
            logits = _linear(h, self._head.get())
            return logits if out is None else out.copy_(logits)
        if out is None or head.bias is not None or h.dtype != out.dtype:
            logits = head(h)
            return logits if out is None else out.copy_(logits)
        return torch.mm(h, head.weight.t(), out=out)

    # -- prefill ---------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]], keep: list[int] | None = None) -> torch.Tensor:
        """Caches each prompt in its slot (positions 0..len-1) and returns the logits of its last
        keep[i] positions (default 1), concatenated in prompt order: (sum keep, V).

        A prompt that comes again in the call (a GRPO group's samples) is computed once: its first
        occurrence is prefilled, the others get copies of that slot's cached columns and logits."""
        keep = keep or [1] * len(prompts)
        first: dict[tuple, int] = {}
        source = [first.setdefault((tuple(p), k), i) for i, (p, k) in enumerate(zip(prompts, keep))]
        unique = list(first.values())  # in order of first occurrence
        if len(unique) == len(prompts):
            return self._prefill(slots, prompts, keep)
        logits = self._prefill([slots[i] for i in unique], [prompts[i] for i in unique], [keep[i] for i in unique])
        copies = [i for i, s in enumerate(source) if s != i]
        self.cache.copy_columns([slots[source[i]] for i in copies], [slots[i] for i in copies],
                                max(len(prompts[i]) for i in copies))
        start, at = {}, 0  # each unique prompt's first logits row
        for i in unique:
            start[i], at = at, at + keep[i]
        rows = [start[s] + j for s, k in zip(source, keep) for j in range(k)]
        return logits[upload([rows], logits.device)[0]]

    def _prefill(self, slots: list[int], prompts: list[list[int]], keep: list[int]) -> torch.Tensor:
        """prefill() of distinct prompts. On the CPU, where the prefill's GEMMs are most of a rollout, a
        prefix the prompts share (a chat template's system prompt) is computed once, in the first slot,
        and its columns copied to the others; the rest of each prompt then attends to them."""
        shared = self._shared_prefix(prompts, keep)
        if shared:
            self._forward([slots[0]], [prompts[0][:shared]], 0, None)
            self.cache.copy_columns(slots[:1] * (len(slots) - 1), slots[1:], shared)
        return self._forward(slots, [p[shared:] for p in prompts], shared, keep)

    def _shared_prefix(self, prompts: list[list[int]], keep: list[int]) -> int:
        """The columns prefilled once for all prompts: their common prefix, less what each needs to keep
        its `keep` logits rows after it; 0 on a GPU, for one prompt, or below SHARED_PREFIX_MIN."""
        if self.device.type != "cpu" or len(prompts) < 2:
            return 0
        common = next((i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1), min(map(len, prompts)))
        shared = min(common, *(len(p) - k for p, k in zip(prompts, keep)))
        return shared if shared >= SHARED_PREFIX_MIN else 0

    def _forward(self, slots: list[int], pieces: list[list[int]], start: int, keep: list[int] | None):
        """Runs pieces[i] at positions start.. of slot slots[i], packed into one row of tokens, caching their
        keys and values; each attends to its slot's columns [0, start) and causally to itself. Returns the
        logits of each piece's last keep[i] positions, concatenated ((sum keep, V)), or None without keep."""
        lengths = [len(p) for p in pieces]
        tokens, positions, slot_of, cu_seq_lens, wanted = self._packed(slots, pieces, start, keep)
        x = self.inner.embed_tokens(tokens)  # (N, hidden)
        if not start and (fused := self._fused_kernels()) is not None and not invariant.enabled():
            longest, folded = max(lengths), self._folds_norms()

            def attend(i: int, qkv: torch.Tensor, bias=None) -> torch.Tensor:  # each query head's KV head repeated
                rotated = fused.rope_and_cache(qkv, self._cos, self._sin, positions, self.cache.keys[i],
                                               self.cache.values[i], self.q_heads, False, slot_of, self.group,
                                               norm=(x, self.eps) if folded else None, bias=bias)
                return packed_causal_attention(*rotated, cu_seq_lens, longest, self.scaling)  # (no GQA)

            if folded:
                for i in range(self.num_layers):
                    self._folded_layer(fused, i, x, attend)
                return None if keep is None else self._fused_head(fused, x[wanted], None)
            delta = self._fused_layers(fused, x, attend)
            return None if keep is None else self._fused_head(fused, x[wanted], delta[wanted])
        cos, sin, rows = self._cos[positions], self._sin[positions], self._rows(slot_of, positions)
        for i in range(self.num_layers):
            q, k, v = self._qkv(i, x, cos, sin, rows)
            if start:
                attended = self._after_prefix(i, q, slots, lengths, start)
            else:
                attended = packed_causal_attention(q, k, v, cu_seq_lens, max(lengths), self.scaling)
            x = self._finish_layer(i, x, attended)
        return None if keep is None else self._lm_head(x[wanted])

    def _packed(self, slots: list[int], pieces: list[list[int]], start: int, keep: list[int] | None):
        """The index tensors of _forward's packed row of N tokens, on the device (one `upload`): the tokens, their
        positions and slots (N,), where each piece starts (B + 1,), int32) and the rows whose logits it keeps
        (sum keep,). Built with numpy (0.35-0.38 ms of host time for 128 prompts of 128 tokens on the 2-core CPU,
        1.2-1.4 ms as Python lists): before a call's first prefill forward the GPU waits for it."""
        lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        ends, n = starts[1:], int(starts[-1])
        kept = np.asarray(keep or [0] * len(pieces), np.int64)
        first_kept = np.concatenate([[0], np.cumsum(kept)])[:-1]  # each piece's first row in `wanted`
        wanted = np.arange(kept.sum()) + np.repeat(ends - kept - first_kept, kept)
        tokens, positions, slot_of, cu_seq_lens, wanted = upload(
            [np.fromiter(itertools.chain.from_iterable(pieces), np.int64, n),
             np.arange(n) + np.repeat(start - starts[:-1], lengths), np.repeat(np.asarray(slots, np.int64), lengths),
             starts, wanted], self.device)
        return tokens, positions, slot_of, cu_seq_lens.to(torch.int32), wanted

    def _after_prefix(self, layer: int, q: torch.Tensor, slots: list[int], lengths: list[int],
                      start: int) -> torch.Tensor:
        """Attention of each piece's queries (n, Q, D), at positions start.., over its slot's cached columns
        [0, start + n), causal: one SDPA per piece, (N, Q, D)."""
        keys, values, parts = self.cache.keys[layer], self.cache.values[layer], []
        for slot, qs in zip(slots, q.split(lengths)):
            n = qs.shape[0]
            columns = torch.arange(start + n, device=q.device)
            visible = columns[None] <= columns[start:, None]  # (n, start + n): query j sees columns <= start + j
            window = slice(0, start + n)
            out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None].to(self.dtype), keys[slot, :, window][None],
                                                 values[slot, :, window][None], attn_mask=visible,
                                                 scale=self.scaling, enable_gqa=self.group > 1)
            parts.append(out[0].transpose(0, 1))
        return torch.cat(parts)

    # -- decode ----------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, batch: int, tokens: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
        """Feeds tokens[j] (b,) at positions[j] of slot j for j < batch (a bucket size); `longest`
        bounds every slot's cached length after the step. Returns the logits (b, V), valid until the
        next call."""
        width = self.length_bucket(longest)
        if not self.cuda_graphs:
            return self._decode_step(batch, width, tokens, positions)
        graph = self._graphs.get((batch, width)) or self._capture(batch, width)
        self._tokens[:batch].copy_(tokens)
        self._positions[:batch].copy_(positions)
        for copy in self._copies():  # a weight written since (a sync) reaches its copy, which the graph reads
            copy.get()
        graph.replay()
        return self._logits[:batch]

    def _decode_step(self, batch: int, width: int, tokens: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        kernel, shared = self._decode_kernel(), None  # what every layer's attention of the step reads alike
        if self._mode_attention():  # the mode's attention tiles
            shared = invariant.slot_tiles(self.q_heads, self.cache.keys[0], positions)
        elif kernel is None:  # SDPA's additive (b, 1, 1, Lb) mask, shared by the g queries of each KV head (the
            # same bits as a boolean one, which SDPA turns into this; 9-11% faster a call on the CPU: BENCHMARKS.md)
            hidden = torch.arange(width, device=self.device)[None] > positions[:, None]
            shared = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
            shared = shared[:, None, None, :]
        x = self.inner.embed_tokens(tokens)  # (b, hidden)
        if (fused := self._fused_kernels()) is not None:
            rope_in_kernel = kernel is not None and not self._mode_attention()  # RoPE and the cache write in it too
            if rope_in_kernel and self._folds_norms():
                def attend_folded(i: int, qkv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                    return kernel.rope_and_attend(qkv, self._cos, self._sin, positions, self.cache.keys[i],
                                                  self.cache.values[i], self.q_heads, self.scaling,
                                                  norm=(x, self.eps), bias=bias)

                for i in range(self.num_layers):
                    self._folded_layer(fused, i, x, attend_folded)
                return self._fused_head(fused, x, None, out)

            def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
                keys, values = self.cache.keys[i], self.cache.values[i]
                if rope_in_kernel:
                    return kernel.rope_and_attend(qkv, self._cos, self._sin, positions, keys, values, self.q_heads,
                                                  self.scaling)
                q = fused.rope_and_cache(qkv, self._cos, self._sin, positions, keys, values, self.q_heads,
                                         invariant.enabled())
                return self._decode_attention(kernel, q, keys, values, positions, shared, width)

            return self._fused_head(fused, x, self._fused_layers(fused, x, attend), out)
        cos, sin = self._cos[positions], self._sin[positions]
        rows = self._rows(torch.arange(batch, device=self.device), positions)
        for i in range(self.num_layers):
            q, _, _ = self._qkv(i, x, cos, sin, rows)
            attended = self._decode_attention(kernel, q, self.cache.keys[i], self.cache.values[i], positions, shared,
                                              width)
            x = self._finish_layer(i, x, attended)
        return self._lm_head(x, out)

    def _fused_kernels(self):
        """miles.rollout.local.decode_fused where its kernels run this runner's decode step and prefill (a GPU, unless
        `fused_decode` is off; not for per-head q/k norms, nor under --true-on-policy-mode for rows wider than the
        trainer's exact row mean takes), else None: the layer functions."""
        if not (self.fused_decode and self.device.type == "cuda"):
            return None
        from miles.rollout.local import decode_fused

        hidden, exact = self.inner.embed_tokens.weight.shape[1], invariant.enabled()
        if self._weights[0].q_norm is not None or not decode_fused.supported(self.head_dim, hidden, exact):
            return None
        return decode_fused

    def _fused_layers(self, fused, x: torch.Tensor, attend) -> torch.Tensor:
        """Every layer through `_fused_layer`, the residual stream x updated in place; returns the last layer's output,
        not yet added to x."""
        delta = None
        for i in range(self.num_layers):
            delta = self._fused_layer(fused, i, x, delta, attend)
        return delta

    def _fused_head(self, fused, x: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None = None):
        """Logits of rows x with the last layer's output `delta` added, in the final norm's kernel."""
        return self._lm_head(x, out, norm=lambda h: fused.rms_norm(h, self.inner.norm.weight, self.eps, delta,
                                                                    self._cast(), invariant.enabled()))

    def _fused_layer(self, fused, i: int, x: torch.Tensor, delta: torch.Tensor | None, attend) -> torch.Tensor:
        """Layer i in decode_fused's kernels around the GEMMs: the residual stream x (N, hidden) gets the last layer's
        output `delta` (None before the first) and this layer's attention added in place, each in the norm's kernel
        after it; returns this layer's MLP output (N, hidden), what the layer functions compute. `attend(i, qkv)`
        takes the fused q/k/v projection's rows (N, (Q + 2H) * D) to the attention's output (N, Q, D), the RoPE
        and the cache write included (a decode step's and a prefill's own ways).

        Under --true-on-policy-mode (fp32 weights, bf16 autocast, the batch-invariant kernels) the norms and RoPE
        compute the layer functions' bits (decode_fused.EXACT), each norm returning what the autocast would cast it
        to; the SiLU-and-multiply stays torch's two ops, whose rounding a kernel of its own would not repeat."""
        w, cast = self._weights[i], self._cast()
        qkv_w, o_w, gate_up_w, down_w = w.projections(cast)
        qkv_b, o_b = w.biases(cast)
        exact = invariant.enabled()
        qkv = _linear(fused.rms_norm(x, w.norm, self.eps, delta, cast, exact), qkv_w, qkv_b)
        attention_out = _linear(attend(i, qkv).reshape(x.shape[0], -1), o_w, o_b)
        gate_up = _linear(fused.rms_norm(x, w.post_norm, self.eps, attention_out, cast, exact), gate_up_w)
        if exact:
            gate, up = gate_up.chunk(2, dim=-1)
            return _linear(F.silu(gate) * up, down_w)
        return _linear(fused.silu_and_mul(gate_up), down_w)

    def _folds_norms(self) -> bool:
        """Whether the prefill and a decode step run `_folded_layer` (a step where it has the RoPE in the decode
        attention's kernel): `fold_norms` on, decode_fused's kernels and the decode attention's on, outside
        --true-on-policy-mode (whose norms compute the trainer's bits) and any autocast (whose copies the GEMMs read),
        and for a model without an output-projection bias (the GEMM's residual add takes one addend)."""
        return (self.fold_norms and self.triton_decode and self._fused_kernels() is not None
                and not invariant.enabled() and self._cast() is None and self._weights[0].o_b is None)

    def _folded_layer(self, fused, i: int, x: torch.Tensor, attend) -> None:
        """Layer i of a GPU's decode step or prefill without its two RMSNorms' kernels, the residual stream x (N,
        hidden) updated in place. Each norm's weight is folded into the projection after it (weights.Folded), which
        then takes x itself; the kernel that reads the projection next multiplies it by each row's 1 / rms of x
        (decode_fused.row_scale): the RoPE's (then adding the q/k/v bias) and silu_and_mul. The output and down
        projections add into x in their GEMMs (addmm's beta = 1). `attend(i, qkv, bias)` takes the projection of x
        by the folded q/k/v weight to the attention's output (N, Q, D), scaling it by the row scale and adding `bias`
        (decode_attention.rope_and_attend's or decode_fused.rope_and_cache's `norm`). What `_fused_layer` computes,
        rounded elsewhere: the normalised row is never rounded to the model's dtype, the folded weights are, and each
        residual add rounds once, after the GEMM's fp32 sum."""
        w = self._weights[i]
        qkv_w, gate_up_w = w.folded()
        x.addmm_(attend(i, torch.mm(x, qkv_w.t()), w.qkv_b).reshape(x.shape[0], -1), w.o_w.t())
        x.addmm_(fused.silu_and_mul(torch.mm(x, gate_up_w.t()), norm=(x, self.eps)), w.down_w.t())

    def _decode_kernel(self):
        """miles.rollout.local.decode_attention where its kernel runs this runner's cache (a GPU, unless
        `triton_decode` is off; imported, and Triton with it, only there), else None: SDPA."""
        if not (self.triton_decode and self.device.type == "cuda"):
            return None
        from miles.rollout.local import decode_attention

        return decode_attention if decode_attention.supported(self.cache.keys[0]) else None

    def _mode_attention(self) -> bool:
        """Whether decode attention runs --true-on-policy-mode's kernel (the mode on a GPU): the trainer's attention
        over tiles made once a step."""
        return invariant.enabled() and self.device.type == "cuda"

    def _decode_attention(self, kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          positions: torch.Tensor, shared, width: int) -> torch.Tensor:
        """Decode attention of slots [0, b)'s queries q (b, Q, D): under --true-on-policy-mode what the trainer's
        attention computes, over the step's tiles (`shared`: invariant.slot_tiles); else in the `_decode_kernel`
        KERNEL, which reads each slot only up to its position; without one, SDPA over the width bucket under the
        (b, 1, 1, Lb) mask `shared`, the g query heads of a KV head as g queries of one head."""
        batch = q.shape[0]
        if self._mode_attention():
            return invariant.slot_attention(q, keys, values, positions, self.scaling, shared)
        q = q.to(self.dtype)
        if kernel is not None:
            return kernel.decode_attention(q.view(batch, self.q_heads, self.head_dim), keys, values, positions,
                                           self.scaling)
        grouped = q.view(batch, self.kv_heads, self.group, self.head_dim)  # (b, H, g, D)
        return F.scaled_dot_product_attention(grouped, keys[:batch, :, :width], values[:batch, :, :width],
                                              attn_mask=shared, scale=self.scaling)

    def _copies(self) -> list[Cast | Folded]:
        """The weights' copies made so far: cast (none outside autocast) and folded (none outside `_folded_layer`)."""
        casts = [c for w in self._weights for c in (*w.casts, *(w.folds or ())) if c is not None]
        return casts + ([self._head_cast] if self._head_cast is not None else [])

    def _capture(self, batch: int, width: int):
        """Captures the (batch, width) step reading the shared input buffers, writing the logits buffer."""
        tokens, positions, out = self._tokens[:batch], self._positions[:batch], self._logits[:batch]
        positions.zero_()  # the warm-up runs write column 0 of slots [0, batch): kept and put back
        kept = self.cache.data[:, :, :batch, :, 0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture: kernels chosen, workspaces allocated
                self._decode_step(batch, width, tokens, positions, out)
        torch.cuda.current_stream().wait_stream(side)
        self.cache.data[:, :, :batch, :, 0] = kept
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._decode_step(batch, width, tokens, positions, out)
        self._graphs[(batch, width)] = graph
        return graph

