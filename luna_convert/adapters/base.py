"""What every adapter shares: the converted-attention mixin, the key-padding mask and call-signature helpers."""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import nn

from ..layers.attention import AttentionMode, LinearAttention
from ..errors import ConversionError
from ..ops.context import AttentionContext
from ..ops.reference import softmax_attention_weights
from .grid import PatchGrid

# An additive mask value at or below this removes the key from softmax exactly
# (exp(-1000) is 0 in every float format): v4 eager (finfo.min), the -10000
# convention of older code and -inf all count as padding.
_ADDITIVE_DROP = -1000.0


def _kept(mask: torch.Tensor) -> torch.Tensor:
    """Any accepted attention mask as bool, same shape (True = keep): bool masks as they are, [B, N] 0/1
    masks, additive float masks (0 = keep, very negative = drop; anything else is a score bias: refused)."""
    if not isinstance(mask, torch.Tensor):  # e.g. a flex-attention BlockMask
        raise ValueError(
            f"linear attention cannot read a {type(mask).__name__} attention mask; load the model with "
            "attn_implementation='eager' or 'sdpa'"
        )
    if mask.dtype == torch.bool:
        return mask
    dropped = mask > _ADDITIVE_DROP
    if mask.dim() == 2:  # 0/1 (or 0/positive) key-padding mask, unless it holds negative (additive) values
        additive = (mask < 0).any()
        keep = torch.where(additive, dropped, mask > 0)
        biased = additive & keep & (mask != 0)
    else:  # additive
        keep = dropped
        biased = keep & (mask != 0)  # neither keep (0) nor drop: a score bias
    _require(~biased.any(), "the attention mask adds biases to the scores (e.g. a relative-position bias), not "
             "only key padding; linear attention cannot apply them")
    return keep


def key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise any attention mask reaching self-attention to bool [B, N] (True = real key).

    Accepts [B, N] 0/1 or bool masks, and [B, 1|H, 1|N, N] (or [B, 1|N, N]) bool
    (True = keep) or additive float masks (0 = keep, very negative = drop), as
    built by transformers v4 (eager: [B,1,1,N] additive; sdpa: [B,1,N,N]
    additive) and v5 (eager: [B,1,N,N] additive; sdpa: [B,1,N,N] bool).
    An all-real mask becomes None (in eager code; compiled code keeps it, with the same result).

    Linear attention can only drop keys, so a mask whose real query rows do
    not all share one key pattern (causal, block or per-query masks) is
    refused instead of being silently approximated (ValueError; in compiled
    code a RuntimeError with the same message, see ``_require``). Query rows that keep
    nothing or everything (how some libraries treat pad queries) are allowed.

    A model hands every layer the same mask tensor: eager code reads it once and keeps the result
    for the next layers while the tensor is unchanged (``_MaskCache``).
    """
    if mask is None:
        return None
    if torch.compiler.is_compiling():
        return _read_key_padding_mask(mask)
    cached = _MASK_CACHE.get(mask)
    if cached is _MaskCache.MISS:
        cached = _MASK_CACHE.put(mask, _read_key_padding_mask(mask))
    return cached


def _read_key_padding_mask(mask: torch.Tensor) -> torch.Tensor | None:
    keep = _kept(mask)
    if keep.dim() == 4:
        keep = keep[:, 0]  # the head axis is 1 (or repeats the same pattern)
    if keep.dim() == 3 and keep.shape[1] == 1:
        keep = keep[:, 0]  # one row for every query: the pattern itself
    elif keep.dim() == 3:
        # Bidirectional padding masks repeat the key pattern on every query row; rows that keep
        # nothing count as keeping everything, and the pattern is what every row keeps (their AND;
        # nothing where no row keeps anything). Every row then holds the pattern, so a valid mask is
        # one whose rows are it or keep every key.
        filled = keep | ~keep.any(-1, keepdim=True)
        pattern = filled.all(-2) & keep.any(-2)  # [B, N]
        _require(((filled == pattern[:, None]) | filled.all(-1, keepdim=True)).all(),
                 "linear attention supports key-padding masks only; this attention mask varies across query "
                 "rows (causal or structured masks cannot be linearised)")
        keep = pattern
    elif keep.dim() != 2:
        raise ValueError(f"unsupported attention mask shape {tuple(mask.shape)}")
    if torch.compiler.is_compiling():
        # Whether every key is real is a data-dependent branch; an all-real mask gives the same
        # result as None (every use multiplies by it or masks with it), only a few ops more.
        return keep
    return None if bool(keep.all()) else keep


class _MaskCache:
    """The key-padding mask read from the last attention mask seen (one entry, per thread).

    An entry is used only for the very same tensor (a weak reference: no id reuse) at the same
    version (no in-place edit since). Inference tensors carry no version counter and are read
    every time, as are masks under torch.compile (whose graph is traced once anyway).
    """

    MISS = object()

    def __init__(self):
        self._local = threading.local()

    @staticmethod
    def _version(mask: torch.Tensor) -> int | None:
        return None if mask.is_inference() else mask._version

    def get(self, mask: torch.Tensor):
        entry = getattr(self._local, "entry", None)
        if entry is None or entry[0]() is not mask or self._version(mask) is None \
                or entry[1] != self._version(mask):
            return self.MISS
        return entry[2]

    def put(self, mask: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor | None:
        version = self._version(mask)
        self._local.entry = None if version is None else (weakref.ref(mask), version, key_mask)
        return key_mask


_MASK_CACHE = _MaskCache()


def sliding_window_key_padding_mask(mask: torch.Tensor | None, half_window: int) -> torch.Tensor | None:
    """The key-padding mask (bool [B, N], None: all real) inside a bidirectional sliding-window mask, which
    keeps key j for query i where j is real and |i - j| <= half_window (transformers v5 hands ModernBERT's
    local layers only this mask). Linear attention in a converted local layer attends to every real key, so
    it needs the padding alone: the diagonal, as every token's own key lies inside its window. A [B, N]
    padding mask (flash attention's, whose window is an argument) is read as such; a mask that is not
    exactly window and padding is refused."""
    if mask is None:
        return None
    keep = _kept(mask)
    if keep.dim() == 2:
        return key_padding_mask(keep)
    keep = keep[:, 0] if keep.dim() == 4 else keep  # [B, N, N]: the head axis is 1
    square = keep.dim() == 3 and keep.shape[-2] == keep.shape[-1]
    real = keep.diagonal(dim1=-2, dim2=-1) if square else None
    position = torch.arange(keep.shape[-1], device=keep.device)
    window = (position[:, None] - position[None, :]).abs() <= half_window
    if not square or not bool((keep == (window & real[:, None, :])).all()):
        raise ValueError(f"this mask of a sliding-window layer is not a bidirectional window of {half_window} tokens "
                         "each side over padded keys; linear attention cannot read it")
    return None if bool(real.all()) else real


def _require(ok: torch.Tensor, message: str) -> None:
    """ValueError(message) unless the bool tensor ``ok`` is True. Compiled code cannot branch on a
    tensor's value without a graph break: there the check stays in the graph as an assertion that
    raises (a RuntimeError with the same message) when the compiled code runs."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


class LinearizedAttention:
    """Marker mixin shared by every converted attention class."""

    linear_attn: LinearAttention
    patch_grid: PatchGrid | None = None
    # Set per class by ``registry.linearized_class``: the class converted, and its forward's parameters.
    _original_class: type
    _original_forward_params: tuple[str, ...] = ()

    def _call_arguments(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name, whatever the library version passed positionally
        (v4 ViT: ``(hidden_states, head_mask)``; v4 BERT: ``(hidden_states, attention_mask,
        head_mask, encoder_hidden_states, ...)``; v5: ``(hidden_states, attention_mask, ...)``)."""
        return {**dict(zip(self._original_forward_params, args)), **kwargs}

    def _attend(self, q, k, v, mask, head_mask=None, output_attentions: bool = False):
        """q, k, v: [B, H, N, d] -> ([B, N, H*d], attention weights [B, H, N, N] or None)"""
        b, _, n, _ = q.shape
        key_mask = key_padding_mask(mask)
        grid, prefix = self.patch_grid.layout(n) if self.linear_attn.uses_patch_layout else (None, 0)
        out = self.linear_attn(q, k, v, key_mask, grid, prefix)
        if head_mask is not None:  # v4 head pruning mask: [num_heads] or broadcastable [1|B, H, 1, 1]
            if head_mask.dim() == 1:
                head_mask = head_mask[None, :, None, None]
            if head_mask.dim() != 4 or head_mask.shape[-2:] != (1, 1):
                raise ValueError(f"linear attention supports per-head masks only, got head_mask {tuple(head_mask.shape)}")
            out = out * head_mask.to(out.dtype)
        weights = None
        if output_attentions:
            la = self.linear_attn
            # The weights that produced the output: softmax while distilling or run as softmax, else the linear ones.
            softmax = la.mode is not AttentionMode.LINEAR
            weights = (softmax_attention_weights(q, k, la.softmax_scale, key_mask) if softmax
                       else la.attention_weights(q, k, key_mask, AttentionContext(key_mask, n, prefix, grid)))
            if head_mask is not None:
                weights = weights * head_mask.to(weights.dtype)
        return out.transpose(1, 2).reshape(b, n, -1), weights


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, N, H*d] -> [B, H, N, d]"""
    b, n, _ = x.shape
    return x.view(b, n, -1, head_dim).transpose(1, 2)


def check_self_attention(call: dict) -> None:
    if call.get("encoder_hidden_states") is not None:
        raise ConversionError("linear attention replaces self-attention only; cross-attention inputs were given")


def has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def is_self_attention(module: nn.Module) -> bool:
    return not getattr(module, "is_causal", False) and not getattr(module, "is_decoder", False)


def forward_params(cls: type, positional: bool = True) -> tuple[str, ...]:
    """Names of ``cls.forward``'s parameters after ``self`` and the hidden states: those that
    can be passed positionally, or (``positional=False``) every named one (``*args``/``**kwargs`` excluded)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    leading = [p.name for p in params if p.kind in kinds]
    keyword = [] if positional else [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return tuple(leading[2:] + keyword)


# Arguments a plain softmax self-attention may take besides the hidden states. A forward
# with any other input (rotary ``sinusoidal_pos``/``position_embeddings``, relative-position
# biases, layout boxes, ...) uses information linear attention would silently drop.
PLAIN_HF_ARGS = frozenset({
    "attention_mask", "head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value",
    "past_key_values", "cache", "output_attentions", "cache_position", "use_cache",
})


def plain_hf_forward(module: nn.Module, also: frozenset[str] = frozenset()) -> bool:
    """``module``'s forward takes nothing but the plain arguments (and ``also``, which its adapter handles)."""
    return set(forward_params(type(module), positional=False)) <= PLAIN_HF_ARGS | also


def config_position_embedding_type(module: nn.Module) -> str:
    """BERT-family position embedding type of an attention module: v4 keeps it on the module, v5 only
    in the config (v5 no longer implements relative positions, so a relative checkpoint loads without them)."""
    kind = getattr(module, "position_embedding_type", None) or getattr(getattr(module, "config", None),
                                                                       "position_embedding_type", None)
    return kind or "absolute"
