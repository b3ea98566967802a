"""Performer FAVOR+: Choromanski et al. 2021, "Rethinking Attention with Performers" (ICLR).

phi(x) = m^(-1/2) exp(W x~ - |x~|^2 / 2 - c) with x~ = d^(-1/4) x and W [m, d] positive orthogonal
random features, so E_W[phi(q).phi(k)] = exp(q.k / sqrt(d)) up to the stabilisers c, which cancel
in the row normalisation:
- queries: c = max over features of W q~ - |q~|^2/2, per query (a per-query factor cancels);
- keys: c = one max over the REAL keys of the example (and over features), per example and head.
  A per-key max would not cancel (it re-weights keys), and a max that sees pads would make the
  output depend on them; so keys read the key mask of the call's context, and the map is not
  token-wise (it stays off the streamed path).
W is drawn once, from the recorded ``seed``, at conversion; it is a buffer saved with the model
(model.safetensors), so a load reproduces it and finetuning never redraws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from .base import (AttentionOptions, FeatureMap, Method, check_int, check_non_negative_number, check_positive_int,
                   option)
from .registry import register


@dataclass
class PerformerOptions(AttentionOptions):
    # The stabilisers fix the features' scale relative to the largest key, not to den, which can be ~1e-3
    # for a query far from every key: 1e-6 would then shrink that row by 0.1%. performer-pytorch adds none.
    eps: float = option(1e-12, "added to the linear-attention denominator (only guards an underflowed den; "
                        "1e-12 here, not 1e-6: den has no fixed scale under the stabilisers)")
    num_features: int = option(0, "m, random features; 0 = int(d ln d) (266 for d = 64, performer-pytorch's default)")
    seed: int = option(0, "seed of the random matrix W (drawn once at conversion, then saved with the model)")
    kernel_epsilon: float = option(0.0, "uniform floor added inside phi (performer-pytorch's kernel_epsilon, 1e-4 "
                                   "there); 0 keeps the estimator unbiased")

    def __post_init__(self):
        super().__post_init__()
        if self.num_features != 0:
            check_positive_int(self, "num_features")
        check_int(self, "seed")
        check_non_negative_number(self, "kernel_epsilon")


def default_num_features(head_dim: int) -> int:
    return max(1, int(head_dim * math.log(head_dim)))


def orthogonal_random_features(num_features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[m, d]: stacked blocks of d orthonormal rows (QR of a Gaussian), each row rescaled to a chi_d norm
    (the norm of a Gaussian row), as performer-pytorch's gaussian_orthogonal_random_matrix (scaling 0).

    Q's columns are multiplied by the signs of R's diagonal: Householder QR makes R's diagonal negative, so
    without them every block's first row points into x_1 < 0 and the estimator is biased (E[phi(q).phi(k)]
    5% below exp(q.k/sqrt(d)) at small norms); with them the rows are Haar-distributed."""
    blocks = []
    for _ in range(-(-num_features // dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)
    rows = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return rows * norms[:, None]


class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive features with a seeded, saved W shared by heads, q and k."""

    options_class = PerformerOptions
    token_wise = False  # the key stabiliser is a max over all real keys of the example

    def __init__(self, head_dim: int, num_heads: int, options: PerformerOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        m = self.options.num_features or default_num_features(head_dim)
        generator = torch.Generator().manual_seed(self.options.seed)
        self.register_buffer("random_features", orthogonal_random_features(m, head_dim, generator).float())

    @property
    def feature_dim(self) -> int:
        return self.random_features.shape[0]

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        # exp and sums in fp32 (float64 stays float64): bf16 would round the exponent before exp
        compute = accumulation_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            # logits = W x~ - |x~|^2 / 2 with x~ = d^(-1/4) x: d^(-1/4) folded into W and -|x~|^2 / 2 =
            # -|x|^2 / (2 sqrt(d)) added in place (no scaled copy of x, no separate subtraction)
            x = x.to(compute)
            d = x.shape[-1]
            half_sq_norm = x.square().sum(-1, keepdim=True) * (-0.5 * d**-0.5)
            weight = (self.random_features.to(compute) * d**-0.25).T  # [d, m]
            # 4-D matmul on the heads as they are split: measured faster on the CPU than one mm over
            # all rows (which also needs a contiguous copy of x)
            logits = torch.matmul(x, weight).add_(half_sq_norm)  # [B, H, n, m]
            # The stabilisers cancel exactly, so they carry no gradient (detached, which also lets exp run in place)
            scored = logits.detach()
            if context is not None and context.role == "key":
                real = context.view_mask
                scored = scored if real is None else scored.masked_fill(~real[:, None, :, None], float("-inf"))
                shift = scored.amax(dim=(-2, -1), keepdim=True)  # one constant per example and head: cancels
                shift = shift.masked_fill(torch.isinf(shift), 0.0)  # an example with no real key at all
            else:
                shift = scored.amax(dim=-1, keepdim=True)  # per query: cancels in its own row
            # m^(-1/2) exp(logits - shift) = exp(logits - (shift + ln(m) / 2)), computed in place
            feats = logits.sub_(shift + 0.5 * math.log(self.feature_dim)).exp_()
            if self.options.kernel_epsilon:  # not in place: exp's backward reads its output
                feats = feats + self.options.kernel_epsilon * self.feature_dim**-0.5
        return feats


PERFORMER = register(Method(
    name="performer", core=PerformerFeatureMap, distill=False,
    description="Performer FAVOR+: positive orthogonal random features of exp, W seeded and saved; finetune only "
                "(Choromanski et al. 2021)",
    paper="Choromanski et al. 2021, Rethinking Attention with Performers (ICLR)",
    details="""Confirmed (paper, performer-pytorch): phi(x) = m^-1/2 exp(W x~ - |x~|^2/2) with x~ = d^-1/4 x,
E[phi(q).phi(k)] = exp(q.k/sqrt(d)); W [m, d] stacked orthonormal blocks (QR of a Gaussian) with chi_d row
norms; m = int(d ln d) (266 at d = 64); one W for q, k and every head; stabilisers: per-query max for q,
one max over keys and features for k (both cancel in the normalisation; detached, as in performer-pytorch,
so with kernel_epsilon > 0 they pass no gradient); no parameters.
Recipe: swap, then finetune; no distillation. W is drawn once from the recorded seed, saved in
model.safetensors (buffer random_features), never redrawn (redrawing during finetuning adds noise).
Derived (options, recorded in linear_attention.json): seed; the key stabiliser's max runs over the
example's real keys only (so pads change nothing) and includes the -|x~|^2/2 term (the largest key
feature is then exactly m^-1/2: no underflow of the whole row); the query's |q~|^2/2 term is kept and
cancels with its max; kernel_epsilon (default 0; 1e-4 in performer-pytorch); the denominator guard eps
defaults to 1e-12 (performer-pytorch has none; den has no fixed scale under the stabilisers). Every converted layer
draws the same W from the one seed. Pitfall: the estimator's variance grows like exp(|q~ + k~|^2),
large at BERT-scale norms (Hedgehog's CoLA ablation: 24.7, the worst map).""",
))
