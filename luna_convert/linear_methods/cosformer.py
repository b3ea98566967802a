"""cosFormer: Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention" (ICLR).

phi(x_i) = [relu(x_i) sin(pi i / 2M), relu(x_i) cos(pi i / 2M)], so
phi(q_i).phi(k_j) = relu(q_i).relu(k_j) cos(pi (i - j) / 2M): ReLU attention re-weighted towards
nearby tokens. Here i is the token's rank among the REAL tokens of its example and M that
example's real length (the official code uses the padded index and padded length), so padding,
left or right, changes nothing; |i - j| < M keeps the weights >= 0.

ViT prefix tokens (CLS, registers; option ``prefix_neutral``, default on) are position-neutral:
they weigh relu(q).relu(k) (cos = 1) with every token, both as queries and as keys, and the patches
take ranks and M among the patches only. That is exact and still linear with two more feature
blocks (D = 4d on inputs that have prefix tokens; text inputs keep D = 2d):
  query patch [f s, f c, f, 0]   query prefix [0, 0, f, f]
  key patch   [f s, f c, 0, f]   key prefix   [0, 0, f, 0]      (f = relu(x), s/c = sin/cos)
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..ops.context import AttentionContext
from .base import FeatureMap, Method
from .cosformer_options import CosformerOptions
from .registry import register


def _position_trig(rank: torch.Tensor, length: torch.Tensor, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """[sin, cos] of pi/2 rank / length, [B or 1, n, 2]: rank [B or 1, n] among real tokens, length [B or 1]
    real tokens; with ``prefix`` tokens, patches count from 0 and M is the patch count."""
    if prefix:
        rank = rank - prefix  # prefix ranks go negative and are unused
        length = length - prefix
    # at least 1: an all-padding example (length 0) would give 0 / 0, and its NaN reaches every gradient
    length = length.clamp_min(1)
    angle = (math.pi / 2) * rank.to(torch.float64) / length[:, None].to(torch.float64)  # [B or 1, n]
    return torch.stack([torch.sin(angle), torch.cos(angle)], -1).to(dtype)


@functools.lru_cache(maxsize=16)
def _unpadded_trig(start: int, stop: int, tokens: int, prefix: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """``_position_trig`` of tokens [start, stop) of an unpadded sequence of ``tokens`` (read-only: cached)."""
    rank = torch.arange(start, stop, device=device)[None]
    return _position_trig(rank, torch.full((1,), tokens, device=device), prefix, dtype)


class CosformerFeatureMap(FeatureMap):
    """ReLU features with cos/sin re-weighting by position among real tokens; one map for q and k."""

    options_class = CosformerOptions

    @property
    def reads_prefix(self) -> bool:
        return self.options.prefix_neutral

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim  # 4 * head_dim on inputs with prefix tokens when prefix_neutral

    def prefix(self, context: AttentionContext) -> int:
        """The position-neutral prefix tokens of this call (0: every token takes a position)."""
        return context.num_prefix if self.options.prefix_neutral else 0

    def position_trig(self, context: AttentionContext, prefix: int, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
        """[sin, cos] of each token of the context's view, [B or 1, n, 2] (``_position_trig``)."""
        if context.key_mask is None and not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
            # The same table for every unpadded call of this length (queries and keys, every layer): about
            # fifteen small operator calls per map saved. Not under inference_mode, whose tensors could not
            # be saved for a later backward; compiled code computes it in the graph.
            return _unpadded_trig(context.view.start, context.view.stop, context.tokens, prefix, device, dtype)
        lengths = context.lengths
        length = torch.full((1,), context.tokens, device=device) if lengths is None else lengths.to(device)
        return _position_trig(context.positions(device), length, prefix, dtype)

    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        if context is None:
            context = AttentionContext(None, x.shape[2])
        feats = F.relu(x)
        prefix = self.prefix(context)
        trig = self.position_trig(context, prefix, x.device, feats.dtype)
        # [f s | f c] in one product over a [2, d] view: no half-size products to concatenate
        weighted = (feats.unsqueeze(-2) * trig[:, None, :, :, None]).flatten(-2)  # [B, H, n, 2d]
        if not prefix:
            return weighted
        is_prefix = (torch.arange(context.view.start, context.view.stop, device=x.device) < prefix)[None, None, :, None]
        zeros = torch.zeros_like(feats)
        patch_block = [zeros, feats] if context.role == "key" else [feats, zeros]
        prefix_block = [feats, zeros] if context.role == "key" else [feats, feats]
        patch = torch.cat([weighted] + patch_block, -1)
        head = torch.cat([zeros, zeros] + prefix_block, -1)
        return torch.where(is_prefix, head, patch)


COSFORMER = register(Method(
    name="cosformer", core=CosformerFeatureMap, distill=False,
    description="cosFormer: ReLU features re-weighted by cos(pi (i-j) / 2M) over real tokens; finetune only "
                "(Qin et al. 2022)",
    paper="Qin et al. 2022, cosFormer: Rethinking Softmax in Attention (ICLR)",
    details="""Confirmed (official code OpenNLPLab/cosFormer): phi = relu on the projected q and k (no 1/sqrt(d)),
q'_i = [phi(q_i) sin(pi i/2M), phi(q_i) cos(pi i/2M)], likewise k', so q'_i.k'_j = phi(q_i).phi(k_j)
cos(pi (i-j)/2M), D = 2d; no parameters; one map for q and k. Recipe: swap, then finetune; no distillation.
Derived (method notes 5.2): i is the token's rank among the real tokens and M the example's real length
(the official M is the padded length), so pads change nothing; pads are removed by zeroing phi(k).
Option prefix_neutral (default true; recorded in linear_attention.json): on ViT inputs the prefix tokens
(CLS, registers) weigh cos = 1 with every token, as queries and as keys, through two more feature
blocks (D = 4d on those inputs), and patches are ranked among the patches with M = the patch count;
false: one raster index over [prefix, patches]. Not carried: the cos_2d variant. Pitfall: ReLU is
homogeneous, so attention cannot sharpen; the locality prior fights heads that attend to far [CLS]/[SEP].""",
))
