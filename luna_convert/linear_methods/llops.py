"""LLoPS: Learnable Low-Rank Polynomial Sketch (OpenReview cI7LY7zghF; abstract only). The construction
follows the method notes (sec. 1), built on PolySketchFormer (google-research polysketchformer/).

Per head h, degree p (even, default 4), rank r:

    x~ = [1, x / sqrt(p tau_h sqrt(d))]                   so <q~, k~> = 1 + s / (p tau_h), s = q.k / sqrt(d)
    psi_l(x) = r^(-1/2) prod_{t=1}^{p/2} <u_{h,t,l}, x~>   (CP-structured sketch, l = 1..r)
    phi(x) = symvec(psi psi^T): psi_l^2 on the diagonal, sqrt(2) psi_l psi_m for l < m     D = r(r+1)/2

so phi(q).phi(k) = <psi(q), psi(k)>^2 >= 0, and with Gaussian u (PolySketch's random sketch, the init)
E <psi(q), psi(k)> = <q~, k~>^(p/2): the kernel sketches (1 + s/(p tau))^p, which tends to exp(s / tau).
Features are signed (the off-diagonal products), the kernel is not. The map is token-wise.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from ..ops.layout import tokens_first
from .base import FeatureMap, Method
from .llops_options import LLoPSOptions
from .registry import register
from .taylor import upper_triangle


class LLoPSFeatureMap(FeatureMap):
    """Learnable CP sketch of a degree-p polynomial kernel, self-tensored; one map for q and k (PSD kernel)."""

    options_class = LLoPSOptions
    context_free = True
    signed_features = True  # sqrt(2) psi_l psi_m can be negative; the kernel <psi(q), psi(k)>^2 cannot

    def __init__(self, head_dim: int, num_heads: int, options: LLoPSOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        r, factors = self.options.rank, self.options.degree // 2
        generator = torch.Generator().manual_seed(self.options.seed)
        # [H, p/2, r, d+1]: i.i.d. N(0, 1), PolySketch's random sketch (its 1/sqrt(r) is applied in forward)
        self.sketch = nn.Parameter(torch.randn(num_heads, factors, r, head_dim + 1, generator=generator))
        self.log_temperature = nn.Parameter(torch.zeros(num_heads, 1, 1))  # tau = 1 at init
        # Feature f = left[left_rows[f]] * psi[right_rows[f]] with left = [psi; sqrt(2) psi]: psi_l psi_m appears
        # twice in <psi, psi'>^2 for l != m (weight sqrt(2)), once for l == m (weight 1).
        rows, cols = upper_triangle(r)
        self.register_buffer("left_rows", rows + r * (rows != cols).long(), persistent=False)
        self.register_buffer("right_rows", cols, persistent=False)

    @property
    def feature_dim(self) -> int:
        r = self.sketch.shape[2]
        return r * (r + 1) // 2

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        return self.each(x)[0]

    def each(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The features of each of ``xs`` (queries and keys), the sketch's operands derived once for all."""
        # in fp32 (float64 stays float64): (1 + s/p)^p reaches ~1e3 and bf16 products would lose the kernel
        compute = accumulation_dtype(*xs)
        with torch.autocast(device_type=xs[0].device.type, enabled=False):
            weight, bias = self.sketch_operands(compute)
            return tuple(self.sketch_features(x.to(compute), weight, bias) for x in xs)

    def sketch_operands(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """<u, x~> = u_0 c + scale <u_1:, x> with scale = 1 / sqrt(p tau sqrt(d)) and c = x~'s constant coordinate (1,
        or 0 when homogeneous), as the operands of one head-major product for all p/2 factors: the weight
        scale u_1: [H, d, p/2 r] and the bias u_0 [H, 1, p/2 r] (None when homogeneous). So there is no
        [c | scale x] copy of x, nor a copy of it per factor."""
        sketch = self.sketch.to(dtype)  # [H, p/2, r, d+1]
        scale = torch.rsqrt(torch.exp(self.log_temperature.to(dtype)) * (self.options.degree * self.head_dim**0.5))
        weight = sketch[..., 1:].flatten(1, 2).transpose(1, 2) * scale  # scale [H, 1, 1]
        bias = None if self.options.homogeneous else sketch[..., :1].view(sketch.shape[0], 1, -1)
        return weight, bias

    def sketch_of(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """psi_l = r^-1/2 prod_t <u_{l,t}, x~> for x [B, H, n, d] and ``sketch_operands``: [B, H, n, r], a view
        with unit stride along r."""
        x = self.sketch_input(x)
        b, h, n, d = x.shape
        r = self.sketch.shape[2]
        x_heads = x.transpose(0, 1).reshape(h, b * n, d)  # a view of the heads split from [B, n, H d]
        # [H, B n, p/2 r]
        projections = torch.bmm(x_heads, weight) if bias is None else torch.baddbmm(bias, x_heads, weight)
        return (projections.view(h, b, n, -1, r).prod(dim=-2) * r**-0.5).permute(1, 0, 2, 3)

    def sketch_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the sketch reads it: with PolySketch's LayerNorm (option qk_norm), else x itself."""
        return F.layer_norm(x, x.shape[-1:], eps=1e-5) if self.options.qk_norm else x

    def sketch_features(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """phi(x) for x [B, H, n, d] and ``sketch_operands``: [B, H, n, D]."""
        psi = self.sketch_of(x, weight, bias).transpose(-1, -2)  # tokens last: [B, H, r, n]
        # The pairs as whole rows of left = [psi; sqrt(2) psi] (tokens last; right_rows < r pick psi itself), returned
        # as the [B, H, n, D] view: selecting rows is about 3x faster than gathering single elements along the
        # last axis (see Taylor).
        left = torch.cat([psi, psi * 2**0.5], -2)
        features = left.index_select(-2, self.left_rows) * left.index_select(-2, self.right_rows)
        return tokens_first(features)


LLOPS = register(Method(
    name="llops", core=LLoPSFeatureMap, distill=True,
    description="LLoPS: learnable low-rank CP polynomial sketch of (1 + s/4)^4, self-tensored (non-negative "
                "kernel); distil, then finetune (OpenReview cI7LY7zghF)",
    paper="Learnable Low-Rank Polynomial Sketch (LLoPS), OpenReview forum cI7LY7zghF (abstract only, no code); "
          "builds on Kacham et al. 2024, PolySketchFormer (ICML)",
    details="""Confirmed (abstract): linear attention with learnable low-rank polynomial-sketch feature maps that
approximate a polynomial kernel. Confirmed (PolySketchFormer code): degree-4 sketch q' = (q S1) * (q S2) with
Gaussian S1, S2 and 1/sqrt(r), self-tensored phi = q' (x) q' so <phi(q), phi(k)> = <q', k'>^2 >= 0; r = 32 or 64;
LayerNorm on q, k; rows divided by 1 + sum.
Derived (method notes sec. 1; options, recorded in linear_attention.json): the inhomogeneous exp-matching
target (1 + s/(p tau))^p with x~ = [1, x/sqrt(p tau sqrt(d))], tau a learnable per-head temperature (init 1)
(homogeneous: PolySketch's <q, k>^p); the CP sketch psi_l = r^-1/2 prod_t <u_{l,t}, x~>, per head, trainable,
initialised at PolySketch's Gaussian sketch from the recorded seed (so distillation starts at its loss);
symmetric packing symvec(psi psi^T) (diagonal psi_l^2, off-diagonal sqrt(2) psi_l psi_m): the same kernel in
r(r+1)/2 features instead of r^2; rank 16 (D = 136, about Hedgehog's 128); degree 4; qk_norm off (the
LayerNorm would discard the pretrained q/k geometry); rows divided by den + eps (PolySketch's 1 + den damps
short inputs; not offered). Not offered: the learned-MLP sketch of sketch_layer.py. Pitfall: an even degree is
symmetric about s = -p tau, so logits below it get weight again. Recipe: Hedgehog attention distillation of the
sketch and tau, then finetune.""",
))
