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

from ..ops import exp_rows, products
from ..ops.context import AttentionContext
from ..ops.products import ProducedRows
from ..ops.dtypes import accumulation_dtype
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
    stabilised = True

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

    def feature_rows(self, *xs: torch.Tensor,
                     context: AttentionContext | None = None) -> tuple[ProducedRows | torch.Tensor, ...] | None:
        """``positive_random_feature_rows`` of each of ``xs``, where no kernel_epsilon is added."""
        if self.options.kernel_epsilon:
            return None
        return positive_random_feature_rows(xs, self.random_features, context, scale=self.head_dim**-0.25)


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
        if exp_rows.applies(logits):  # eager, float32 on the CPU
            return _StabilisedExp.apply(logits, is_key, real is not None).view(b, h, n, m)
        if torch.compiler.is_compiling() and exp_rows.takes(logits):  # the same passes as an operator
            with torch.no_grad():
                shift = _stabiliser(logits, True, real is not None) if is_key else None
            features = exp_rows.stabilised_exp_op(logits, shift, 0.5 * math.log(m))
            return features.view(b, h, n, m)
        with torch.no_grad():  # the stabilisers cancel exactly: no gradient (which also lets exp run in place)
            shift = _stabiliser(logits, is_key, real is not None)
        return logits.sub_(shift).exp_().view(b, h, n, m)


# Keys' features made inside the products from this size of their stored form on (bytes, per call). They
# cost a second pass over the logits (for the stabiliser), which pays where storing them would take fresh
# pages from the system: above the kept heap's 32 MiB (``tools.heap.MMAP_THRESHOLD``). One thread, forward,
# made / stored keys (docs/design-decisions.md, *Features made inside the products*): Flexformer (m = 64)
# 1.27 at 1,024 tokens (3 MB), 1.18 at 4,096 (13 MB), 0.91 at 16,384 (50 MB); Performer (m = 266) 0.95 at
# 13 MB, 0.85 at 52 MB, 0.79 at 209 MB.
MADE_KEYS_MIN_BYTES = 32 << 20


def positive_random_feature_rows(xs: tuple[torch.Tensor, ...], weight: torch.Tensor, context: AttentionContext | None,
                                 scale: float = 1.0) -> tuple[ProducedRows | torch.Tensor, ...] | None:
    """``positive_random_features`` of each of ``xs`` for ``FeatureMap.feature_rows``, or None where they do not
    apply (gradients, not float32 on the CPU, autocast, no native library). The logits scale W x by the affine
    maker. Queries' are made inside the core's products, never stored: exp(logits - their max - ln(m) / 2)
    (``exp_rows.exp_minus_row_max_rows``), whose -|x|^2 / (2 sqrt(d)) term is one number per query that the max
    takes out again, so it is left out. Keys' (``context.role`` "key"), whose stabiliser is a max over all real
    keys: made too (``exp_rows.positive_key_rows``, the stabiliser from a pass of its own over the logits) from
    ``MADE_KEYS_MIN_BYTES`` of stored features on, else stored, as ``positive_random_features`` computes them.
    The made features move by float32 rounding."""
    if not exp_rows.rows_apply(*xs, weight):
        return None
    is_key = context is not None and context.role == "key"
    m = weight.shape[-2]
    # Compiled and exported graphs store the keys at every size: a branch on the size would tie a graph to it
    if is_key and (torch.compiler.is_compiling() or xs[0].shape[:-1].numel() * m * 4 < MADE_KEYS_MIN_BYTES):
        return tuple(positive_random_features(x, weight, context, scale) for x in xs)
    weight_t = (weight * scale).mT.contiguous()  # [d, m], or [H, d, m]: each head's own (Flexformer)
    bias = weight_t.new_zeros(weight_t.shape[:-2] + weight_t.shape[-1:])
    offset = 0.5 * math.log(m)
    logits = [products.affine_feature_rows(x, weight_t, bias, relu=False) for x in xs]
    if is_key:
        norm_scale = -0.5 * xs[0].shape[-1]**-0.5  # -|x|^2 / (2 sqrt(d)), of the unscaled x
        return tuple(exp_rows.positive_key_rows(rows, x, norm_scale, offset, context.view_mask)
                     for rows, x in zip(logits, xs))
    return tuple(exp_rows.exp_minus_row_max_rows(rows, offset) for rows in logits)


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


class _StabilisedExp(torch.autograd.Function):
    """exp(logits - _stabiliser(logits)) in place, the exps one native pass per row (``ops.exp_rows``; the max, the
    subtraction and exp were three passes), a query's max found in the same pass. The stabilisers pass no
    gradient, so the gradient is grad * features. (Eager only: dynamo does not trace ``mark_dirty``; compiled
    graphs call ``exp_rows.stabilised_exp_op``, the same passes into a fresh tensor.)"""

    @staticmethod
    def forward(ctx, logits, is_key: bool, padded: bool):
        if is_key:
            features = exp_rows.exp_minus_shift_(logits, _stabiliser(logits, True, padded))
        else:
            features = exp_rows.exp_minus_row_max_(logits, 0.5 * math.log(logits.shape[-1]))
        ctx.mark_dirty(logits)
        ctx.save_for_backward(features)
        return features

    @staticmethod
    def backward(ctx, grad):
        (features,) = ctx.saved_tensors
        return grad * features, None, None


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
