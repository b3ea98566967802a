"""Taylor: the second-order Taylor feature map of exp (the "Based" map; Arora et al. 2024, "Simple
linear attention language models balance the recall-throughput tradeoff", ICML).

phi(x) = [1, x / d^(1/4), symvec(x x^T) / sqrt(d)] with the upper-triangular packing of x x^T
(diagonal x_i^2 / sqrt(2), off-diagonal x_i x_j for i < j), so that
phi(q).phi(k) = 1 + s + s^2 / 2 with s = q.k / sqrt(d), the softmax logit. 1 + s + s^2/2 =
((1 + s)^2 + 1) / 2 >= 1/2, so the denominator is always safe.

D = 1 + d + d(d + 1)/2 (2,145 for d = 64): for N below about D the linear form costs more than
softmax. Option ``project_dim`` first maps each head's q and k to d' < d dimensions (as Based does,
d' = 16: D = 153) with a learned projection.
"""

from __future__ import annotations


import torch
from torch import nn

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from ..ops import pair_rows
from ..ops.layout import tokens_first
from ..ops.products import ProducedRows
from .base import FeatureMap, Method
from .taylor_options import TaylorOptions
from .registry import register


def upper_triangle(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the i <= j entries of an n x n matrix, row by row."""
    return torch.triu_indices(n, n)


class TaylorFeatureMap(FeatureMap):
    """[1, x / d^(1/4), x_i x_j / sqrt(d) (i < j), x_i^2 / sqrt(2 d)], one map for q and k.

    d is the attention's head_dim (the softmax logit's scale) even with a projection, so that
    with an orthonormal projection s stays the logit of the kept subspace.
    """

    options_class = TaylorOptions
    context_free = True
    signed_features = True  # x can be negative; the kernel 1 + s + s^2/2 is >= 1/2 all the same

    def __init__(self, head_dim: int, num_heads: int, options: TaylorOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        width = self.options.project_dim or head_dim
        if self.options.project_dim:
            if width > head_dim:
                raise ValueError(f"project_dim must be at most head_dim ({head_dim}), got {width}")
            # [H, d, d']: orthonormal columns (the first d' of a random orthogonal matrix per head).
            q = torch.linalg.qr(torch.randn(num_heads, head_dim, head_dim))[0][..., :width]
            self.projection = nn.Parameter(q.contiguous())
        else:
            self.projection = None
        self.width = width
        # Every feature is one product left[f] * right[f] of rows of two small stacks (tokens last):
        #   left  = [1; x / d^(1/4); x / sqrt(d); x / sqrt(2 d)]   (1 + 3 w rows)
        #   right = [1; x]                                           (1 + w rows)
        # feature 0 = 1 * 1, the linear part x_i / d^(1/4) * 1, the pairs x_i / sqrt(d) * x_j (i < j) and
        # x_i / sqrt(2 d) * x_i: x_i x_j appears twice in (q.k)^2 for i != j, once for i == j.
        rows, cols = upper_triangle(width)
        linear = torch.arange(width)
        pair_left = 1 + width + rows + width * (rows == cols).long()
        self.register_buffer("left_rows", torch.cat([torch.zeros(1, dtype=torch.long), 1 + linear, pair_left]),
                             persistent=False)
        self.register_buffer("right_rows", torch.cat([torch.zeros(1 + width, dtype=torch.long), 1 + cols]),
                             persistent=False)

    @property
    def feature_dim(self) -> int:
        return 1 + self.width + self.width * (self.width + 1) // 2

    def projected(self, x: torch.Tensor) -> torch.Tensor:
        """x in the compute dtype, through the projection if there is one (call with autocast off)."""
        compute = accumulation_dtype(x)
        x = x.to(compute)
        return x if self.projection is None else torch.matmul(x, self.projection.to(compute))

    def makes_rows(self, x: torch.Tensor) -> bool:
        return pair_rows.rows_apply(x, *self.parameters())

    def feature_rows(self, *xs: torch.Tensor,
                     context: AttentionContext | None = None) -> tuple[ProducedRows, ...] | None:
        """The features of each of ``xs`` made inside the core's native products, never stored
        (``ops.pair_rows``): at inference, float32 on the CPU, where the library is built."""
        if not all(self.makes_rows(x) for x in xs):
            return None
        d = self.head_dim  # the scales of forward's left rows
        return tuple(pair_rows.pair_feature_rows(self.projected(x), (2 * d)**-0.5, d**-0.5, constant=True,
                                                 linear_scale=d**-0.25) for x in xs)

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # In fp32 (float64 stays float64): bf16 products x_i x_j lose the s^2/2 term's precision, and the
        # attention sums upcast the features to fp32 anyway, so this costs no extra copy.
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = self.projected(x)
            # Built tokens last, [.., D, N], and returned as its [.., N, D] view: selecting whole rows of
            # x^T is about 3x faster than gathering single elements along the last axis (taylor at 4,096
            # tokens spent 62 % of its forward in that gather); the core's products take either layout.
            xt = x.transpose(-1, -2)
            ones = xt.new_ones(()).expand(*xt.shape[:-2], 1, xt.shape[-1])
            d = self.head_dim  # Python scales: exact in float64, never cast with the module's dtype
            left = torch.cat([ones, xt * d**-0.25, xt * d**-0.5, xt * (2 * d)**-0.5], -2)
            right = torch.cat([ones, xt], -2)
            features = left.index_select(-2, self.left_rows) * right.index_select(-2, self.right_rows)
            return tokens_first(features)


TAYLOR = register(Method(
    name="taylor", core=TaylorFeatureMap, distill=False,
    description="Taylor (Based): [1, x, x x^T] features, phi(q).phi(k) = 1 + s + s^2/2; finetune only "
                "(Arora et al. 2024)",
    paper="Arora et al. 2024, Simple linear attention language models balance the recall-throughput tradeoff "
          "(Based, ICML); the Taylor map as a baseline in Zhang et al. 2024 (Hedgehog)",
    details="""Confirmed (Based / fla packing, method notes 5.3): phi(x) = [1, x/d^(1/4), symvec(x x^T)] with
diagonal x_i^2/(sqrt(2) sqrt(d)) and off-diagonal x_i x_j/sqrt(d) (i < j), so phi(q).phi(k) = 1 + s + s^2/2
with s = q.k/sqrt(d); no parameters; D = 1 + d + d(d+1)/2 = 2,145 at d = 64 (at BERT's N = 128 about 17x
the FLOPs of softmax: it pays off only above N ~ 2k). 1 + s + s^2/2 >= 1/2, so den >= N/2. Pads: phi(0)
= [1, 0, 0] is not 0, so phi(k) is zeroed. Pitfalls: not monotone for s < -1; the features are signed, so
float32 sums cancel (error ~1e-7 of sum_j |phi(q)|.|phi(k_j)| |v_j| / den: ~1e-3 at logits near 70).
Recipe: swap, then finetune; no distillation (no parameters by default).
Derived (options, recorded in linear_attention.json): project_dim d' (a learned per-head projection to
d' dims first, random orthonormal init rather than Based's per-head PCA, which needs data; s keeps the
1/sqrt(d) of the full head dim); Based's sliding window and short convolutions are not carried.""",
))
