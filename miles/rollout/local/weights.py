"""One decoder layer's weights as the fast engine's layer functions take them.

The q/k/v and the gate/up projections are each one fused tensor whose row blocks *are* the modules' parameters
(views), so a weight update copied into the parameters reaches them. For the CPU decode in fp32 the projections are
also kept in oneDNN's packed layout (`Packed`), under an autocast to bf16 over fp32 weights (true on-policy mode)
as bf16 copies (`Cast`), and for a GPU's decode steps the q/k/v and gate/up weights with the norm before each folded
in (`Folded`); each is made again when a weight update has written into the parameters.
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 32  # the rows oneDNN lays packed weights out for (any count runs): a CPU decode batch


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """`w` reordered once into oneDNN's blocked layout for its linear (benchmarks/cpu_linear.py: the
    decode's GEMMs 1.0-1.6x faster, the LM head 2.4-2.9x; outputs within fp32 rounding of F.linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)


def fuse(linears, attr: str) -> torch.Tensor:
    """One tensor of the linears' `attr` (weight or bias) stacked by rows, whose row blocks become
    those parameters (views of it)."""
    fused = torch.cat([getattr(lin, attr).detach() for lin in linears])
    start = 0
    for lin in linears:
        old = getattr(lin, attr)
        setattr(lin, attr, torch.nn.Parameter(fused[start:start + old.shape[0]], requires_grad=old.requires_grad))
        start += old.shape[0]
    return fused


def fuse_bias(linears) -> torch.Tensor | None:
    """The fused bias, None when no linear has one (a missing one among others becomes zeros)."""
    if all(lin.bias is None for lin in linears):
        return None
    for lin in linears:
        if lin.bias is None:
            lin.bias = torch.nn.Parameter(torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype,
                                                      device=lin.weight.device), requires_grad=False)
    return fuse(linears, "bias")


class Packed:
    """A weight packed for oneDNN (`pack_weight`), packed again when the weight changed in place since (a
    weight sync copies into the parameters; torch counts in-place writes in `_version`, shared by views)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.version, self.packed = weight, None, None

    def get(self) -> torch.Tensor:
        if self.version != self.weight._version:
            self.packed, self.version = pack_weight(self.weight), self.weight._version
        return self.packed


class Cast:
    """`weight` in `dtype`, as autocast casts it at every use (fp32 weights under bf16 autocast: true on-policy
    mode), made once and written again in place when the weight changed, so CUDA graphs keep reading it."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight, self.copy, self.version = weight, weight.detach().to(dtype), weight._version

    def get(self) -> torch.Tensor:
        if self.version != self.weight._version:
            self.copy.copy_(self.weight.detach())
            self.version = self.weight._version
        return self.copy


class Folded:
    """`weight` (out, in) with an RMSNorm's weight `norm` (in,) folded into its columns (weight * norm, rounded to the
    weight's dtype): its product with a row x is weight's with norm * x. Made once, written again in place when the
    weight or the norm changed since (a weight sync), so CUDA graphs keep reading it."""

    def __init__(self, weight: torch.Tensor, norm: torch.Tensor):
        self.weight, self.norm, self.copy, self.versions = weight, norm, torch.empty_like(weight), None

    def get(self) -> torch.Tensor:
        versions = (self.weight._version, self.norm._version)
        if self.versions != versions:
            torch.mul(self.weight.detach(), self.norm.detach(), out=self.copy)
            self.versions = versions
        return self.copy


class LayerWeights:
    """One decoder layer's tensors as the layer functions take them; fused blocks are views. With `pack`
    (the CPU decode in fp32, not compiled) the four projections also in oneDNN's packed layout; under
    autocast (`cast`), the projections and biases as the autocast dtype's copies (Cast)."""

    def __init__(self, layer, pack: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up = (mlp.gate_proj, mlp.up_proj)
        self.qkv_w, self.qkv_b = fuse(self.qkv, "weight"), fuse_bias(self.qkv)
        self.gate_up_w = fuse(self.gate_up, "weight")
        self.norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.q_norm = attn.q_norm.weight if hasattr(attn, "q_norm") else None
        self.k_norm = attn.k_norm.weight if hasattr(attn, "k_norm") else None
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.down_w = mlp.down_proj.weight
        self.packed = [Packed(w) for w in (self.qkv_w, self.o_w, self.gate_up_w, self.down_w)] if pack else None
        self.casts: list[Cast | None] = []  # of qkv_w, o_w, gate_up_w, down_w, qkv_b, o_b, in `cast_dtype`
        self.cast_dtype = None
        self.folds: tuple[Folded, Folded] | None = None  # made by `folded`

    def projections(self, cast: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """The q/k/v, output, gate/up and down weights as the layer functions take them."""
        if cast is not None:
            return tuple(c.get() for c in self._casts(cast)[:4])
        if self.packed is None:
            return self.qkv_w, self.o_w, self.gate_up_w, self.down_w
        return tuple(p.get() for p in self.packed)

    def biases(self, cast: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The q/k/v and output biases (None where the model has none)."""
        if cast is None:
            return self.qkv_b, self.o_b
        return tuple(c.get() if c is not None else None for c in self._casts(cast)[4:])

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k/v weight with the input norm's weight folded in and the gate/up weight with the post-attention
        norm's (Folded; the copies made at the first call)."""
        if self.folds is None:
            self.folds = (Folded(self.qkv_w, self.norm), Folded(self.gate_up_w, self.post_norm))
        return self.folds[0].get(), self.folds[1].get()

    def _casts(self, dtype: torch.dtype) -> list[Cast | None]:
        if self.cast_dtype != dtype:
            tensors = (self.qkv_w, self.o_w, self.gate_up_w, self.down_w, self.qkv_b, self.o_b)
            self.casts, self.cast_dtype = [Cast(t, dtype) if t is not None else None for t in tensors], dtype
        return self.casts

    def current(self) -> bool:
        """Whether the modules' weights are still views of the fused tensors (moving the model
        between devices makes them separate tensors again)."""
        return (self.qkv[0].weight.data_ptr() == self.qkv_w.data_ptr()
                and self.gate_up[0].weight.data_ptr() == self.gate_up_w.data_ptr())
