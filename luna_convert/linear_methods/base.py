"""What every method is made of: its attention core (its options, in ``options.py``, and its registry entry,
:class:`Method` in ``registry.py``, are imported here too for the method files).

Two kinds of attention core:

* :class:`FeatureMap` (feature-map attention): phi: R^d -> R^D per head, and the layer computes
  phi(q)^T S / (phi(q)^T z + eps) with ``ops.linear`` (streamed over chunks of tokens on long CPU
  inputs, ``ops.streamed``). Its explicit N x N form is ``ops.reference.linear_attention_weights``.
* :class:`KernelAttention` (kernel attention), for kernels k(q, k) that do not factor into finite
  features: the method supplies ``forward`` (the output) and ``weights`` (the explicit N x N
  matrix, which tests compare ``forward`` against and attention distillation trains).

Both take ``(head_dim, num_heads, options)`` where options is the method's options dataclass
(:class:`AttentionOptions` or a subclass), or keyword overrides of its defaults. Both may read an
optional per-call :class:`~luna_convert.ops.context.AttentionContext` (key mask, positions among
real tokens, prefix tokens); token-wise maps ignore it.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import replace

import torch
from torch import nn

from ..ops.context import AttentionContext
from ..ops.linear import Divisor
from ..ops.products import ProducedRows
# the torch-free parts, here too for the method files: options, their checks, the kinds, the registry entry
from .options import (FEATURE_MAP_KIND, KERNEL_KIND, AttentionOptions, check_choice, check_int,  # noqa: F401
                      check_non_negative_number, check_positive_int, is_int, is_number, option, option_table)
from .registry import Method  # noqa: F401


class MethodCore(nn.Module):
    """Common constructor: ``Core(head_dim, num_heads, options=None, **overrides)``."""

    options_class: type[AttentionOptions] = AttentionOptions
    kind: str  # FEATURE_MAP_KIND or KERNEL_KIND: what the layer does with the core (``Method.kind``)
    # True: the core reads the context's num_prefix (ViT prefix tokens), so the layer asks the model
    # for each image input's patch layout even without a spatial DWC branch (cosFormer)
    reads_prefix: bool = False

    def __init__(self, head_dim: int, num_heads: int, options: AttentionOptions | None = None, **overrides):
        super().__init__()
        if options is None:
            options = self.options_class(**overrides)
        elif overrides:
            options = replace(options, **overrides)
        self.head_dim, self.num_heads, self.options = head_dim, num_heads, options

    def learning_rate_scales(self) -> dict[int, float]:
        """id(parameter) -> factor on the learning rate it trains at (distillation and the added-module
        group of finetuning); parameters not listed train at the plain rate."""
        return {}

    def frozen_for_export(self) -> contextlib.AbstractContextManager:
        """A block inside which an exported graph may hold constants computed from the core's current
        parameter values (they do not change while a graph is exported); none unless the core says so."""
        return contextlib.nullcontext()


class FeatureMap(MethodCore, abc.ABC):
    """phi: [B, H, N, d] -> [B, H, N, D]; non-negative unless the method says otherwise.

    Class attributes tell the attention layer how to use a map:
      shared_qk       one map for queries and keys (False: a second copy for keys)
      prescale_query  multiply q by head_dim**-0.5 before the map (T2R)
      token_wise      a token's features depend on that token (and its context row) only; False
                      (e.g. a stabiliser taken over all keys) keeps the map off the streamed path
      stream_when_training  long inputs go through the map in chunks of tokens
                      (``ops.streamed``) at inference always (token-wise maps), and in training
                      too unless this is False
      signed_features features may be negative (Taylor, ELA's distance kernels); tests then check the
                      kernel phi(q).phi(k) instead of the features
      divisor         how each row is divided by its sum phi(q)^T z (``ops.linear.Divisor``): plain (+ eps);
                      clamped for a signed kernel, whose sums may be <= 0 (never streamed), with a floor
                      on the scale of the row's own terms; checked for underflow under stabilised exps
      context_free    the map never reads its context (nor the role): a token's features depend on
                      its own vector alone, so a shared map can take queries and keys in one call (``each``)
    """

    kind = FEATURE_MAP_KIND
    shared_qk: bool = True
    prescale_query: bool = False
    token_wise: bool = True
    stream_when_training: bool = True
    signed_features: bool = False
    divisor: Divisor = Divisor()
    context_free: bool = False

    @property
    @abc.abstractmethod
    def feature_dim(self) -> int:
        """D, the number of features per head."""

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        """Features of x [B, H, n, d] -> [B, H, n, D]; ``context`` describes those n tokens (may be None)."""

    def each(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The features of each of ``xs`` (a context-free map's queries and keys); a map that derives
        something from its parameters first (LUNA's channel tables) does that once for all."""
        return tuple(self(x) for x in xs)

    def makes_rows(self, x: torch.Tensor) -> bool:
        """Whether :meth:`feature_rows` takes ``x`` now (the layer's MADE_ROWS path): none but Taylor's."""
        return False

    def feature_rows(self, *xs: torch.Tensor,
                     context: AttentionContext | None = None) -> tuple[ProducedRows, ...] | None:
        """The features of each of ``xs`` as ``ops.products.ProducedRows`` (made inside the core's native
        products, never stored: Taylor's), or None: the layer then stores them."""
        return None


class KernelAttention(MethodCore, abc.ABC):
    """out_i = sum_j k(q_i, k_j) v_j / sum_j k(q_i, k_j) over real keys, for a kernel that need not factor."""

    kind = KERNEL_KIND
    feature_dim: int = 0  # no finite feature space

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        """q, k, v: [B, H, N, d]; key_mask bool [B, N] (True = real). Returns [B, H, N, d] in v's dtype."""

    @abc.abstractmethod
    def weights(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        """The explicit row-normalised N x N matrix [B, H, N, N] (pad keys weigh 0); ``forward`` equals ``weights @ v``."""
