"""The linear-attention core that replaces softmax inside a converted layer.

``LinearAttention`` owns only what conversion adds: the feature map(s) and the
optional depthwise-convolution (DWC) branch. The pretrained Q/K/V/output
projections stay in the original attention module (see ``adapters``), which
hands per-head q, k, v here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .feature_maps import build_feature_map
from .linear_attention import (
    attention_distillation_loss,
    linear_attention,
    linear_attention_weights,
    softmax_attention_weights,
)


class DepthwiseConvBranch(nn.Module):
    """DWC(V): a depthwise conv over tokens shared across heads (FLatten-style).

    Text: Conv1d over the sequence, pads zeroed before and after. Images: a
    k x k Conv2d over the patch grid, prefix tokens (CLS, registers) get none.
    Zero-initialised so a freshly converted model is pure linear attention.
    """

    def __init__(self, head_dim: int, kernel_size: int = 3, spatial: bool = False):
        super().__init__()
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            # an even kernel with padding k // 2 would change the sequence length
            raise ValueError(f"dwc_kernel must be a positive odd integer, got {kernel_size!r}")
        conv = nn.Conv2d if spatial else nn.Conv1d
        self.spatial = spatial
        self.conv = conv(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, v, key_mask=None, grid=None, num_prefix: int = 0):
        b, h, n, d = v.shape
        if not self.spatial:
            if key_mask is not None:
                v = v * key_mask[:, None, :, None].to(v.dtype)
            x = v.reshape(b * h, n, d).transpose(1, 2)
            out = self.conv(x).transpose(1, 2).reshape(b, h, n, d)
            return out if key_mask is None else out * key_mask[:, None, :, None].to(out.dtype)
        gh, gw = grid
        patches = v[:, :, num_prefix:]
        if patches.shape[2] != gh * gw:
            raise ValueError(f"DWC expects {gh}x{gw} patches after {num_prefix} prefix tokens, got {patches.shape[2]}")
        x = patches.reshape(b * h, gh, gw, d).permute(0, 3, 1, 2)
        out = self.conv(x).permute(0, 2, 3, 1).reshape(b, h, gh * gw, d)
        return F.pad(out, (0, 0, num_prefix, 0))


class LinearAttention(nn.Module):
    """phi-kernel attention over per-head q, k, v, with optional DWC.

    ``distill`` switches on attention distillation: the layer then returns
    the softmax output (so every layer sees the teacher's activations) and
    keeps ``distill_loss``, the cross-entropy between softmax and linear
    attention rows. Both come from the same q and k: no second model.
    """

    def __init__(
        self,
        feature_map: str,
        head_dim: int,
        num_heads: int,
        softmax_scale: float,
        dwc: bool = False,
        dwc_kernel: int = 3,
        spatial: bool = False,
        eps: float = 1e-6,
        **feature_map_options,
    ):
        super().__init__()
        self.head_dim, self.num_heads, self.softmax_scale, self.eps = head_dim, num_heads, softmax_scale, eps
        self.phi_q = build_feature_map(feature_map, head_dim, num_heads, **feature_map_options)
        # Separate key map only where the method asks for one; a shared map is
        # stored once so checkpoints hold no duplicated tensors.
        self.phi_k = None if self.phi_q.shared_qk else build_feature_map(feature_map, head_dim, num_heads, **feature_map_options)
        self.dwc = DepthwiseConvBranch(head_dim, dwc_kernel, spatial) if dwc else None
        self.distill = False
        self.distill_loss: torch.Tensor | None = None

    @property
    def feature_dim(self) -> int:
        return self.phi_q.feature_dim

    def features(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.phi_q.prescale_query:
            q = q * self.head_dim**-0.5
        return self.phi_q(q), (self.phi_k or self.phi_q)(k)

    def forward(self, q, k, v, key_mask=None, grid=None, num_prefix: int = 0) -> torch.Tensor:
        """q, k, v: [B, H, N, d]; key_mask: bool [B, N] (True = real). Returns [B, H, N, d]."""
        phi_q, phi_k = self.features(q, k)
        if self.distill:
            teacher = softmax_attention_weights(q, k, self.softmax_scale, key_mask)
            student = linear_attention_weights(phi_q, phi_k, key_mask, self.eps)
            self.distill_loss = attention_distillation_loss(teacher.detach(), student, key_mask, self.eps)
            return torch.einsum("bhnm,bhmd->bhnd", teacher, v.float()).to(v.dtype)
        out = linear_attention(phi_q, phi_k, v, key_mask, self.eps)
        if self.dwc is not None:
            out = out + self.dwc(v, key_mask, grid, num_prefix)
        return out

    def attention_weights(self, q, k, key_mask=None) -> torch.Tensor:
        """The explicit N x N linear attention matrix (for inspection and plots)."""
        return linear_attention_weights(*self.features(q, k), key_mask, self.eps)
