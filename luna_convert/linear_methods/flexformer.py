"""Flexformer: Zhang & Zhou 2026 (arXiv 2606.27748), random-Fourier-feature attention whose spectral
frequencies are trained. Only the abstract is available; the construction follows the method notes (sec. 3).

Three variants, option ``variant``, per head h with trainable frequencies Omega_h [m, d]:

    stationary     phi(x) = m^(-1/2) [cos(Omega x), sin(Omega x)]                       D = 2m
                   phi(x).phi(y) = m^(-1) sum_r cos(w_r.(x - y))   (Bochner: depends on x - y only)
    nonstationary  phi(x) = (4m)^(-1/2) [cos(O1 x) + cos(O2 x), sin(O1 x) + sin(O2 x)]    D = 2m
                   (two frequency sets; O1 = O2 is the stationary map)
    positive       phi(x) = m^(-1/2) exp(Omega x - |x|^2 / (2 sqrt(d)))                   D = m
                   (Performer's positive feature with trainable Omega)

Softmax wrapper: exp(q.k/sqrt(d)) = e^(|q|^2/2sqrt(d)) e^(|k|^2/2sqrt(d)) k_G(q - k), k_G Gaussian with spectral
density N(0, I/sqrt(d)). The query factor cancels in the row normalisation, so the trigonometric variants
weight each key by rho_j = exp(|k_j|^2/2sqrt(d) - c), c one max over the REAL keys of the example and head
(a per-key max would re-weight keys; a max seeing pads would make real outputs depend on them). The positive
variant's stabilisers are Performer's: a per-query max over features, one max over real keys and features.
So the map is not token-wise (off the streamed path). The trigonometric features and kernel are signed:
the layer divides by max(den, den_floor m^(-1/2) |phi(q)| sum_j |phi(k_j)|) (``ops.linear.floored_linear_attention``),
so a row whose den cancels is never divided by ~0.

Omega is drawn from the recorded ``seed`` at N(0, I/sqrt(d)) (orthogonal blocks with chi_d row norms, as
Performer), so the freshly converted layer is the Gaussian RFF estimate of softmax attention; it is a
parameter, saved with the model (model.safetensors).
"""

from __future__ import annotations


import torch
from torch import nn

from ..ops.context import AttentionContext
from ..ops.dtypes import accumulation_dtype
from ..ops.linear import Divisor
from .base import FeatureMap, Method
from .performer import orthogonal_random_features, positive_random_features
from .flexformer_options import FlexformerOptions
from .registry import register


def gaussian_frequencies(num_heads: int, m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """[H, m, d]: rows ~ N(0, I/sqrt(d)), orthogonal within blocks of d (one draw per head)."""
    return torch.stack([orthogonal_random_features(m, d, generator) for _ in range(num_heads)]) * d**-0.25


class FlexformerFeatureMap(FeatureMap):
    """Trainable-frequency RFF features, one map (and one set of frequencies per head) for q and k."""

    options_class = FlexformerOptions
    token_wise = False  # the key weight rho / the key stabiliser is a max over all real keys of the example

    def __init__(self, head_dim: int, num_heads: int, options: FlexformerOptions | None = None, **overrides):
        super().__init__(head_dim, num_heads, options, **overrides)
        variant = self.options.variant
        self.signed_features = variant != "positive"
        m = self.options.num_frequencies or (64 if variant == "positive" else 32)
        generator = torch.Generator().manual_seed(self.options.seed)
        omega = gaussian_frequencies(num_heads, m, head_dim, generator)
        self.frequencies = nn.Parameter(omega.float())
        if variant == "nonstationary":
            spread = torch.randn(omega.shape, generator=generator, dtype=torch.float64) * head_dim**-0.25
            self.second_frequencies = nn.Parameter((omega + self.options.nonstationary_offset * spread).float())
        else:
            self.second_frequencies = None
        # |phi| <= 1 for both signed maps, and their estimate of a kernel value is noisy at about m^(-1/2)
        self.divisor = Divisor.signed(self.options.den_floor * m**-0.5) if self.signed_features else \
            Divisor(check=True)

    @property
    def feature_dim(self) -> int:
        m = self.frequencies.shape[1]
        return m if self.options.variant == "positive" else 2 * m

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        if self.options.variant == "positive":  # Performer's feature and stabilisers, with trainable Omega
            return positive_random_features(x, self.frequencies, context)
        # in fp32 (float64 stays float64): rho and exp overflow or round badly in half precision
        compute = accumulation_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.to(compute)
            proj = torch.matmul(x, self.frequencies.to(compute).transpose(-1, -2))  # [B, H, n, m]
            if self.second_frequencies is None:
                feats = torch.cat([torch.cos(proj), torch.sin(proj)], -1) * (proj.shape[-1] ** -0.5)
            else:
                proj2 = torch.matmul(x, self.second_frequencies.to(compute).transpose(-1, -2))
                feats = torch.cat([torch.cos(proj) + torch.cos(proj2), torch.sin(proj) + torch.sin(proj2)], -1)
                feats = feats * ((4 * proj.shape[-1]) ** -0.5)
            if context is None or context.role != "key":
                return feats  # the query's factor e^(|q|^2/2sqrt(d)) cancels in its row
            half_sq_norm = x.square().sum(-1, keepdim=True) * (0.5 * self.head_dim**-0.5)  # |x|^2 / 2 sqrt(d)
            real = context.view_mask
            log_rho = half_sq_norm if real is None else half_sq_norm.masked_fill(~real[:, None, :, None], float("-inf"))
            shift = log_rho.amax(dim=-2, keepdim=True).detach()  # one per example and head
            return feats * torch.exp(log_rho - shift.masked_fill(torch.isinf(shift), 0.0))


FLEXFORMER = register(Method(
    name="flexformer", core=FlexformerFeatureMap, distill=True,
    description="Flexformer: random Fourier features with trainable frequencies, initialised at softmax's "
                "Gaussian RFF; distil, then finetune (Zhang & Zhou 2026)",
    paper="Zhang & Zhou 2026, Flexformer (arXiv 2606.27748; abstract only, no code)",
    details="""Confirmed (abstract; a secondary article): random-Fourier-feature linear attention whose spectral
frequencies are trainable; a stationary variant (the kernel depends on x - y only, Bochner) and a strictly more
expressive nonstationary one; it can be distilled from a pretrained Transformer to recover softmax attention.
Derived (method notes sec. 3; options, recorded in linear_attention.json): variant 'stationary' phi =
m^-1/2 [cos(Omega x), sin(Omega x)]; 'nonstationary' (4m)^-1/2 [cos(O1 x) + cos(O2 x), sin(O1 x) + sin(O2 x)]
(Yaglom / generalised spectral line), O2 = O1 + nonstationary_offset d^-1/4 N(0, I) at init (tied sets would
stay tied); 'positive' (the default) m^-1/2 exp(Omega x - |x|^2/2sqrt(d)), Performer's positive feature with
trainable Omega: the notes recommend it where the signed variants give negative denominators, which RFF noise
(m^-1/2) against BERT-scale kernel values makes the rule; the signed variants divide by max(den, den_floor
m^-1/2 |phi(q)| sum_j |phi(k_j)|) (den_floor 1; max(den, 1e-12) gave outputs of 1e11 where den cancelled).
Softmax wrapper: keys weighted by rho_j = exp(|k_j|^2/2sqrt(d) - max over real keys) (the query's factor
cancels); positive variant: Performer's stabilisers (per-query max, one max over real keys and features).
Init: Omega ~ N(0, I/sqrt(d)) per head, orthogonal blocks with chi_d norms, from the recorded seed (then
saved as parameters): the initial layer is the RFF estimate of softmax attention. num_frequencies 0 = 64
features (m = 64 positive, 32 cos/sin, LUNA / T2R parity); eps 1e-12 (den has no fixed scale).
Recipe (the abstract's distillation): Hedgehog attention distillation of Omega, then finetune, with
train.added_lr 1e-3 for the frequencies (large rates make the kernel delta-like). Not offered: the
|den| guard, log-scale frequency parameters, DARKFormer's learnable covariance.""",
    recipe={"train.added_lr": 1e-3},
))
