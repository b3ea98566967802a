"""The small LRA encoder, trained from scratch: byte or pixel embeddings plus positions, pre-norm Transformer
blocks whose attention is exact softmax (SDPA) or the project's ``LinearAttention`` for any registered
method, mean pooling over the real tokens (or a CLS token), and an MLP classifier.

The default sizes are those of the small encoder in the public PyTorch LRA code that the Nystromformer- and
Skyformer-era papers share (2 layers, hidden 64, 2 heads, feed-forward 128); every size is a setting.
Retrieval encodes both documents with the same encoder and classifies [u, v, u * v, u - v].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import LinearAttention
from ..errors import LunaConvertError
from ..linear_methods.options import AttentionOptions

SOFTMAX = "softmax"
POOLINGS = ("mean", "cls")
POSITIONS = ("learned", "sinusoidal")


@dataclass
class EncoderSettings:
    """The encoder's sizes (recorded in every run's config)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 2
    ffn: int = 128
    dropout: float = 0.1
    pooling: str = "mean"  # mean (over real tokens) | cls
    positions: str = "learned"  # learned | sinusoidal

    def check(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LunaConvertError(f"encoder.{name} must be a positive whole number, got {value!r}")
        if self.hidden % self.heads:
            raise LunaConvertError(f"encoder.hidden ({self.hidden}) must be a multiple of encoder.heads ({self.heads})")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise LunaConvertError(f"encoder.dropout must be in [0, 1), got {self.dropout!r}")
        if self.pooling not in POOLINGS:
            raise LunaConvertError(f"encoder.pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.positions not in POSITIONS:
            raise LunaConvertError(f"encoder.positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """The fixed sin / cos position table of Vaswani et al. (2017): [length, dim]."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    rate = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)[:, : dim // 2]
    return table.float()


class Attention(nn.Module):
    """Multi-head self-attention over [B, N, C] with a key mask; the core is softmax or ``LinearAttention``."""

    def __init__(self, hidden: int, heads: int, method: str, options: AttentionOptions | None, dropout: float):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = dropout
        # options: the run's options object (LRAConfig.attention_options, validated once, shared by every block)
        self.linear = None if method == SOFTMAX else LinearAttention(
            method, self.head_dim, heads, self.head_dim**-0.5, options=options)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, H, N, d] each
        if self.linear is None:
            p = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], dropout_p=p)
        else:
            out = self.linear(q, k, v, key_mask=mask)
        return self.out(out.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    """Pre-norm: x + attention(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, s: EncoderSettings, method: str, options: AttentionOptions | None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(s.hidden), nn.LayerNorm(s.hidden)
        self.attention = Attention(s.hidden, s.heads, method, options, s.dropout)
        self.ffn = nn.Sequential(nn.Linear(s.hidden, s.ffn), nn.GELU(), nn.Dropout(s.dropout), nn.Linear(s.ffn, s.hidden))
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.norm1(x), mask))
        return x + self.drop(self.ffn(self.norm2(x)))


class LRAEncoder(nn.Module):
    """``LRAEncoder(settings, vocab, num_classes, max_length, method, options, pair)``: ``options`` the method's
    options object (``LRAConfig.attention_options()``; None: softmax, or the method's defaults); ``forward`` takes
    a batch's ``input_ids`` and ``attention_mask`` (and ``pair_ids``, ``pair_mask`` for pairs) and returns logits."""

    def __init__(self, settings: EncoderSettings, vocab: int, num_classes: int, max_length: int,
                 method: str = SOFTMAX, options: AttentionOptions | None = None, pair: bool = False):
        super().__init__()
        settings.check()
        if options is not None and not isinstance(options, AttentionOptions):  # options by name: the config's to check
            raise TypeError(f"options must be the method's options object (LRAConfig.attention_options()), "
                            f"got {type(options).__name__}")
        self.settings, self.method, self.pair = settings, method, pair
        s = settings
        self.cls = nn.Parameter(torch.zeros(1, 1, s.hidden)) if s.pooling == "cls" else None
        positions = max_length + (self.cls is not None)
        self.embed = nn.Embedding(vocab, s.hidden)
        if s.positions == "learned":
            self.position = nn.Parameter(torch.randn(positions, s.hidden) * 0.02)
        else:
            self.register_buffer("position", sinusoidal_table(positions, s.hidden), persistent=False)
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(Block(s, method, options) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.hidden)
        width = 4 * s.hidden if pair else s.hidden
        self.head = nn.Sequential(nn.Linear(width, s.ffn), nn.ReLU(), nn.Linear(s.ffn, num_classes))

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, N] token ids -> [B, hidden], pooled over the real tokens (or the CLS token's output)."""
        mask = mask.bool()
        x = self.embed(ids)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
            mask = torch.cat([mask.new_ones(mask.shape[0], 1), mask], 1)
        if x.shape[1] > self.position.shape[0]:
            raise LunaConvertError(f"an input of {x.shape[1]} positions is longer than the encoder's "
                                   f"{self.position.shape[0]}")
        x = self.drop(x + self.position[: x.shape[1]])
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.cls is not None:
            return x[:, 0]
        weights = mask.to(x.dtype)[..., None]
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    def forward(self, input_ids, attention_mask, pair_ids=None, pair_mask=None) -> torch.Tensor:
        u = self.encode(input_ids, attention_mask)
        if not self.pair:
            return self.head(u)
        v = self.encode(pair_ids, pair_mask)
        return self.head(torch.cat([u, v, u * v, u - v], -1))

    def attention_options(self) -> dict | None:
        """The resolved options of the linear attention (every block has the same), None for softmax."""
        layer = self.blocks[0].attention.linear
        return None if layer is None else layer.options.to_dict()
