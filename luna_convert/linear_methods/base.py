"""What every method is made of: its options, its attention core, and its registry entry.

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
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from ..ops.context import AttentionContext
from ..ops.products import ProducedRows

FEATURE_MAP_KIND = "feature map"
KERNEL_KIND = "kernel"


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and the one-line help `luna-convert methods --details` shows."""
    return field(default=default, metadata={"help": help})


def check_positive_int(options: Any, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(options: Any, *names: str, non_negative: bool = False) -> None:
    for name in names:
        value = getattr(options, name)
        if not is_int(value) or (non_negative and value < 0):
            raise ValueError(f"{name} must be a{' non-negative' if non_negative else 'n'} integer, got {value!r}")


def check_non_negative_number(options: Any, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, choices))}")


@dataclass
class AttentionOptions:
    """Options of the attention layer itself, shared by every method (each method's options extend these).

    Everything here is saved: ``asdict(options)`` is the ``options`` of linear_attention.json.
    """

    dwc: bool = option(False, "add a depthwise-convolution branch on V (FLatten-style; zero-initialised)")
    dwc_kernel: int = option(3, "kernel size of the DWC branch (odd; k x k on the ViT patch grid)")
    eps: float = option(1e-6, "added to the linear-attention denominator")
    window: int = option(0, "w > 0: exact softmax over keys with |i - j| <= w, learned per-head gamma x linear "
                            "attention beyond (feature-map methods; cost O(N w D)); 0: off")

    def __post_init__(self):
        if isinstance(self.dwc_kernel, bool) or not isinstance(self.dwc_kernel, int) or self.dwc_kernel < 1 \
                or self.dwc_kernel % 2 == 0:
            # an even kernel with padding k // 2 would change the sequence length
            raise ValueError(f"dwc_kernel must be a positive odd integer, got {self.dwc_kernel!r}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps must be a positive number, got {self.eps!r}")
        check_int(self, "window", non_negative=True)

    # Values for options a folder saved by an older version lacks, where they differ from today's
    # defaults (a method whose defaults changed lists the old ones here, so old models rebuild as saved).
    saved_before: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def with_saved_defaults(cls, saved: Mapping[str, Any]) -> dict:
        """``saved`` (the options of a linear_attention.json) with every key it lacks that an older
        version did not write filled in with that version's value."""
        return {**{k: v for k, v in cls.saved_before.items() if k not in saved}, **saved}


def option_table(options_class: type[AttentionOptions]) -> list[tuple[str, Any, str]]:
    """(name, default, help) of every option of ``options_class``."""
    return [(f.name, f.default if f.default is not MISSING else None, f.metadata.get("help", ""))
            for f in fields(options_class)]


class MethodCore(nn.Module):
    """Common constructor: ``Core(head_dim, num_heads, options=None, **overrides)``."""

    options_class: type[AttentionOptions] = AttentionOptions
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
      signed_kernel   the kernel itself may be <= 0, so a row's sum phi(q)^T z may be too: the layer
                      divides by max(phi(q)^T z, eps) instead of adding eps (never streamed)
      denominator_floor  with a signed kernel, a number f (or None): the layer divides by
                      max(phi(q)^T z, f |phi(q)| sum_j |phi(k_j)|) (``ops.linear.floored_linear_attention``),
                      a floor on the scale of the row's own terms, so a row never divides by ~0
      stabilised      the features are exps shifted by stabilisers that cancel in the normalisation (Performer,
                      Flexformer's positive variant, ELA's exp): rows whose den is that of underflowed features
                      are warned about (``ops.linear.warn_small_denominators``)
      context_free    the map never reads its context (nor the role): a token's features depend on
                      its own vector alone, so a shared map can take queries and keys in one call (``each``)
    """

    shared_qk: bool = True
    prescale_query: bool = False
    token_wise: bool = True
    stream_when_training: bool = True
    signed_features: bool = False
    signed_kernel: bool = False
    denominator_floor: float | None = None
    stabilised: bool = False
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

    def feature_rows(self, *xs: torch.Tensor,
                     context: AttentionContext | None = None) -> tuple[ProducedRows | torch.Tensor, ...] | None:
        """The features of each of ``xs`` as ``ops.products.ProducedRows`` (made inside the core's native
        products, never stored), or None: the layer then stores them. A map that is not ``context_free`` is
        given one x at a time with its ``context`` (the layer's, its role set); keys' may be given stored, as a
        tensor (Performer's, whose stabiliser is a max over all keys)."""
        return None


class KernelAttention(MethodCore, abc.ABC):
    """out_i = sum_j k(q_i, k_j) v_j / sum_j k(q_i, k_j) over real keys, for a kernel that need not factor."""

    feature_dim: int = 0  # no finite feature space

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        """q, k, v: [B, H, N, d]; key_mask bool [B, N] (True = real). Returns [B, H, N, d] in v's dtype."""

    @abc.abstractmethod
    def weights(self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        """The explicit row-normalised N x N matrix [B, H, N, N] (pad keys weigh 0); ``forward`` equals ``weights @ v``."""


@dataclass(frozen=True)
class Method:
    """A registered conversion method.

    name         what ``--method`` takes
    core         its FeatureMap or KernelAttention class (whose ``options_class`` are its options)
    description  one line for ``luna-convert methods``
    paper        the paper it follows
    details      what is confirmed from the paper / code and what is derived (``methods --details``)
    distill      its recipe distils attention (Hedgehog stage 1) before finetuning
    recipe       further run settings the method recommends (e.g. ``{"train.added_lr": ...}``)
    aliases      former names: ``get_method`` and ``load`` accept them, so folders saved under an old name
                 still load (a renamed method lists its old name here)
    """

    name: str
    core: type[MethodCore]
    description: str
    paper: str
    details: str
    distill: bool = False
    recipe: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    aliases: tuple[str, ...] = ()

    @property
    def options(self) -> type[AttentionOptions]:
        return self.core.options_class

    @property
    def kind(self) -> str:
        return KERNEL_KIND if issubclass(self.core, KernelAttention) else FEATURE_MAP_KIND

    @property
    def defaults(self) -> dict:
        """Every option with its default, as saved."""
        return asdict(self.options())

    def make_options(self, **given) -> AttentionOptions:
        """The options object (defaults filled in, validated); ValueError / TypeError on a bad value or name."""
        return self.check_options(self.options(**given))

    def check_options(self, options: AttentionOptions) -> AttentionOptions:
        """``options`` if they are this method's (its options class) and fit its kind; ValueError / TypeError
        if not. The dataclass validated its own values when it was made."""
        if type(options) is not self.options:
            raise TypeError(f"{self.name!r} takes {self.options.__name__}, not {type(options).__name__}")
        if options.window and self.kind != FEATURE_MAP_KIND:
            # the window's complement is subtracted as phi(q) . phi(k) terms, which a kernel method does not have
            raise ValueError(f"window must be 0 for {self.name!r}: only feature-map methods support a sliding "
                             f"window, and {self.name!r} is a {self.kind} method")
        return options
