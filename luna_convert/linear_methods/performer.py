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

import torch

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from ..ops.linear import Divisor
from .base import FeatureMap, Method
from .performer_options import PerformerOptions
from .registry import register


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
    divisor = Divisor(check=True)

    def __init__(self, head_dim: int, num_heads: int, options: PerformerOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        m = self.options.num_features or default_num_features(head_dim)
        generator = torch.Generator().manual_seed(self.options.seed)
        self.register_buffer("random_features", orthogonal_random_features(m, head_dim, generator).float())

    @property
    def feature_dim(self) -> int:
        return self.random_features.shape[0]

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        feats = positive_random_features(x, self.random_features, context, scale=self.head_dim**-0.25)
        if self.options.kernel_epsilon:  # not in place: exp's backward reads its output
            feats = feats + self.options.kernel_epsilon * self.feature_dim**-0.5
        return feats


def positive_random_features(x: torch.Tensor, weight: torch.Tensor, context: AttentionContext | None,
                             scale: float = 1.0) -> torch.Tensor:
    """m^(-1/2) exp(scale W x - |x|^2 / (2 sqrt(d)) - c) for x [B, H, n, d] and W [m, d] (every head's) or [H, m, d]
    (one per head), with the stabilisers c of the module docstring: per query a max over features; for keys
    (``context.role`` "key") one max over the real keys and features per example and head, and pad keys get
    exact zero features. [B, H, n, m], contiguous, in the accumulation dtype (exp and sums in fp32, float64
    stays float64: bf16 would round the exponent before exp). Performer's map and Flexformer's positive variant."""
    compute = accumulation_dtype(x)
    b, h, n, d = x.shape
    with torch.autocast(device_type=x.device.type, enabled=False):
        # One product per example and head over x as [B H, n, d] (a view of x, or a copy of it, smaller than the
        # features, where the batch axes cannot merge): the logits come out in the [B, H, n, m] order the core
        # reads, and the |x|^2 term is baddbmm's added input (no pass of its own over the logits). The scales
        # go on the small operands: a beta or alpha other than 1 would cost the backward a pass over the
        # [B H, n, m] gradient (measured: forward + backward 5-19 % slower at 4,096 tokens).
        x = x.to(compute).reshape(b * h, n, d)
        half_sq_norm = x.square().sum(-1, keepdim=True).mul_(-0.5 * d**-0.5)  # [BH, n, 1]: -|x|^2 / (2 sqrt(d))
        is_key = context is not None and context.role == "key"
        real = context.view_mask if is_key else None
        if real is not None:  # pads at -inf: out of the max, and exp gives exact zeros
            half_sq_norm = torch.where(real.view(b, 1, n, 1), half_sq_norm.view(b, h, n, 1),
                                       -math.inf).view(b * h, n, 1)
        # [BH, d, m]: the one W of every head (Performer) or each head's own (Flexformer), for each example
        m, weight = weight.shape[-2], weight.to(compute)
        if scale != 1.0:
            weight = weight * scale
        weight = (weight.expand(b * h, m, d) if weight.dim() == 2 else weight.repeat(b, 1, 1)).mT
        logits = torch.baddbmm(half_sq_norm, x, weight)  # [BH, n, m]
        with torch.no_grad():  # the stabilisers cancel exactly: no gradient (which also lets exp run in place)
            shift = _stabiliser(logits, is_key, real is not None)
        return logits.sub_(shift).exp_().view(b, h, n, m)


def _stabiliser(logits: torch.Tensor, is_key: bool, padded: bool) -> torch.Tensor:
    """c + ln(m) / 2 for logits [BH, n, m], so that m^(-1/2) exp(logits - c) = exp(logits - that): c per query its
    row's max ([BH, n, 1]); for keys one max per example and head ([BH, 1, 1]; 0 where every key is a pad)."""
    if is_key:
        shift = logits.amax(dim=(1, 2), keepdim=True)
        if padded:
            shift.nan_to_num_(neginf=0.0)  # an example without a real key (all -inf): 0
    else:
        shift = logits.amax(dim=-1, keepdim=True)  # per query: cancels in its own row
    return shift.add_(0.5 * math.log(logits.shape[-1]))


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
