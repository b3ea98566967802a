"""Architecture adapters: find softmax self-attention modules and linearise them in place.

A supported attention module keeps its class's identity: it is re-classed to
a subclass of its own class (``Linear<Original>``) whose ``forward`` reads
the original Q/K/V (and output) projections and calls the ``linear_attn``
submodule added next to them. Weights are the very same tensors; state-dict
keys of the original parameters do not change; ``isinstance`` checks in the
host library (e.g. transformers' attention-output hooks) still hold.

Adapters, chosen by class name and attributes (never by module path):
  hf-separate  transformers BERT-family ``*SelfAttention`` and ViT up to 5.7
               (query/key/value; output projection lives in the parent)
  hf-proj      transformers ViT since 5.10 (q_proj/k_proj/v_proj/o_proj)
  hf-lin       transformers DistilBERT (q_lin/k_lin/v_lin/out_lin), v5 and v4
  timm         timm ``Attention`` (fused qkv, q_norm/k_norm, norm, proj)
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import ConversionError
from .layers.attention import LinearAttention
from .ops.context import AttentionContext
from .ops.reference import softmax_attention_weights


# An additive mask value at or below this removes the key from softmax exactly
# (exp(-1000) is 0 in every float format): v4 eager (finfo.min), the -10000
# convention of older code and -inf all count as padding.
_ADDITIVE_DROP = -1000.0


def key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise any attention mask reaching self-attention to bool [B, N] (True = real key).

    Accepts [B, N] 0/1 or bool masks, and [B, 1|H, 1|N, N] (or [B, 1|N, N]) bool
    (True = keep) or additive float masks (0 = keep, very negative = drop), as
    built by transformers v4 (eager: [B,1,1,N] additive; sdpa: [B,1,N,N]
    additive) and v5 (eager: [B,1,N,N] additive; sdpa: [B,1,N,N] bool).
    An all-real mask becomes None.

    Linear attention can only drop keys, so a mask whose real query rows do
    not all share one key pattern (causal, block or per-query masks) is
    refused instead of being silently approximated. Query rows that keep
    nothing or everything (how some libraries treat pad queries) are allowed.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):  # e.g. a flex-attention BlockMask
        raise ValueError(
            f"linear attention cannot read a {type(mask).__name__} attention mask; load the model with "
            "attn_implementation='eager' or 'sdpa'"
        )
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.dim() == 2 and not bool((mask < 0).any()):
        keep = mask > 0  # 0/1 (or 0/positive) key-padding mask
    else:  # additive
        keep = mask > _ADDITIVE_DROP
        if bool((keep & (mask != 0)).any()):  # neither keep (0) nor drop: a score bias
            raise ValueError("the attention mask adds biases to the scores (e.g. a relative-position bias), not only "
                             "key padding; linear attention cannot apply them")
    if keep.dim() == 4:
        keep = keep[:, 0]  # the head axis is 1 (or repeats the same pattern)
    if keep.dim() == 3:
        # Bidirectional padding masks repeat the key pattern on every query row;
        # pick the row that keeps the fewest (but some) keys as the pattern.
        n = keep.shape[-1]
        counts = keep.sum(-1)
        counts = counts.masked_fill(counts == 0, n + 1)
        row = counts.argmin(-1)
        pattern = keep[torch.arange(keep.shape[0], device=keep.device), row]  # [B, N]
        if keep.shape[1] > 1:
            full_or_empty = keep.all(-1) | ~keep.any(-1)
            same = (keep == pattern[:, None, :]).all(-1)
            if not bool((same | full_or_empty).all()):
                raise ValueError(
                    "linear attention supports key-padding masks only; this attention mask varies across query "
                    "rows (causal or structured masks cannot be linearised)"
                )
        keep = pattern
    elif keep.dim() != 2:
        raise ValueError(f"unsupported attention mask shape {tuple(mask.shape)}")
    return None if bool(keep.all()) else keep


class PatchGrid:
    """The patch grid of the image a ViT is running on, for the DWC branch of its converted attention.

    A forward hook on the model's patch-embedding convolution records the grid of every input, so
    another resolution (transformers' ``interpolate_pos_encoding``, timm's ``dynamic_img_size``) and
    non-square images get their true grid; the model's converted attention modules share this
    object. Tokens before the grid (CLS, registers, distillation token) are the prefix.
    """

    def __init__(self, configured: tuple[int, int], source: nn.Module | None):
        self.configured = configured
        self.current: tuple[int, int] | None = None  # the grid of the latest input
        self._source = source  # hooked on ``attach`` (then dropped, so copies do not hook it twice)
        self._attached = False

    def attach(self) -> None:
        if self._attached:
            return
        if self._source is None:
            raise ConversionError("cannot find the patch-embedding convolution of this vision model, which tells the "
                                  "DWC branch (and cosformer's prefix tokens) the patch grid of each image; convert "
                                  "with dwc=False (cosformer: prefix_neutral=False)")
        self._source.register_forward_hook(self._record)
        self._source, self._attached = None, True

    def _record(self, module, inputs, output) -> None:
        self.current = (int(output.shape[-2]), int(output.shape[-1]))

    def layout(self, num_tokens: int) -> tuple[tuple[int, int], int]:
        """(grid, number of prefix tokens) of a sequence of ``num_tokens`` tokens."""
        gh, gw = self.current or self.configured
        prefix = num_tokens - gh * gw
        if prefix < 0:
            raise ValueError(f"DWC: {num_tokens} tokens cannot hold the {gh}x{gw} patch grid of this input (tokens "
                             "dropped, e.g. by patch dropout?); the depthwise convolution needs every patch")
        return (gh, gw), prefix


class LinearizedAttention:
    """Marker mixin shared by every converted attention class."""

    linear_attn: LinearAttention
    patch_grid: PatchGrid | None = None
    _original_forward_params: tuple[str, ...] = ()  # set per class by ``linearized_class``

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
            # The weights that produced the output: softmax while distilling, else the linear ones.
            weights = (softmax_attention_weights(q, k, la.softmax_scale, key_mask) if la.distill
                       else la.attention_weights(q, k, key_mask, AttentionContext(key_mask, n, prefix, grid)))
            if head_mask is not None:
                weights = weights * head_mask.to(weights.dtype)
        return out.transpose(1, 2).reshape(b, n, -1), weights


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.view(b, n, -1, head_dim).transpose(1, 2)


def _check_self_attention(call: dict) -> None:
    if call.get("encoder_hidden_states") is not None:
        raise ConversionError("linear attention replaces self-attention only; cross-attention inputs were given")


class HFSeparateQKV(LinearizedAttention):
    """transformers ``BertSelfAttention``-style (query/key/value; v4 BERT eager and SDPA, ViT up
    to 5.7 and v4 ``ViTSelfAttention``). Returns (context, attention weights or None) like the
    original on both v4 and v5."""

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        _check_self_attention(call)
        d = self.attention_head_size
        q, k, v = (_heads(proj(hidden_states), d) for proj in (self.query, self.key, self.value))
        return self._attend(q, k, v, call.get("attention_mask"), call.get("head_mask"),
                            bool(call.get("output_attentions")))


class HFProjQKVO(LinearizedAttention):
    """transformers ViT >= 5.10 ``ViTAttention`` (q_proj/k_proj/v_proj/o_proj); returns (output, weights or None)."""

    def forward(self, hidden_states, *args, **kwargs):
        call = self._call_arguments(args, kwargs)
        _check_self_attention(call)
        d = self.head_dim
        q, k, v = (_heads(proj(hidden_states), d) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out, weights = self._attend(q, k, v, call.get("attention_mask"), call.get("head_mask"),
                                    bool(call.get("output_attentions")))
        return self.o_proj(out), weights


class HFLinQKVO(LinearizedAttention):
    """transformers DistilBERT attention (q_lin/k_lin/v_lin/out_lin). v5 ``DistilBertSelfAttention``:
    ``(hidden_states, attention_mask)`` -> (output, weights or None); v4 ``MultiHeadSelfAttention``
    and its SDPA/flash subclasses: ``(query, key, value, mask, head_mask, output_attentions)`` ->
    ``(output,)`` or ``(output, weights)``."""

    def forward(self, *args, **kwargs):
        v4 = "mask" in self._original_forward_params
        first = "query" if v4 else "hidden_states"
        call = {**dict(zip((first, *self._original_forward_params), args)), **kwargs}
        hidden_states = call[first]
        if v4 and any(call.get(name, hidden_states) is not hidden_states for name in ("key", "value")):
            raise ConversionError("linear attention replaces self-attention only; different key/value inputs were given")
        d = self.attention_head_size
        q, k, v = (_heads(proj(hidden_states), d) for proj in (self.q_lin, self.k_lin, self.v_lin))
        output_attentions = bool(call.get("output_attentions"))
        out, weights = self._attend(q, k, v, call.get("mask" if v4 else "attention_mask"), call.get("head_mask"),
                                    output_attentions)
        out = self.out_lin(out)
        if v4:
            return (out, weights) if output_attentions else (out,)
        return out, weights


class TimmFusedQKV(LinearizedAttention):
    """timm ``Attention``: fused qkv, q_norm/k_norm, optional gate and scale-norm."""

    def forward(self, x, attn_mask=None, is_causal: bool = False, **kwargs):
        if is_causal:
            raise ConversionError("causal attention is not supported by bidirectional linear attention")
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out, _ = self._attend(q, k, v, attn_mask)
        out = self.norm(out)
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))


@dataclass(frozen=True)
class Adapter:
    name: str
    mixin: type
    matches: Callable[[nn.Module], bool]
    heads: Callable[[nn.Module], tuple[int, int, float]]  # (num_heads, head_dim, softmax scale)
    members: frozenset[str]  # the submodules its forward reads (dropouts aside); anything else is refused


def unknown_members(module: nn.Module, adapter: Adapter) -> list[str]:
    """What ``module`` holds that ``adapter``'s forward would ignore: its own parameters and buffers,
    and the tensors (or, if it has none, the names) of submodules other than the adapter's and dropouts.
    A relative-position bias table, for one, would silently stop taking part in attention."""
    names = [name for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
    for child_name, child in module.named_children():
        if child_name in adapter.members or isinstance(child, (nn.Dropout, nn.Identity)):
            continue
        tensors = [f"{child_name}.{name}" for name, _ in (*child.named_parameters(), *child.named_buffers())]
        names += tensors or [child_name]
    return names


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _is_self_attention(module: nn.Module) -> bool:
    return not getattr(module, "is_causal", False) and not getattr(module, "is_decoder", False)


def _forward_params(cls: type, positional: bool = True) -> tuple[str, ...]:
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
_PLAIN_HF_ARGS = frozenset({
    "attention_mask", "head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value",
    "past_key_values", "cache", "output_attentions", "cache_position", "use_cache",
})


def _plain_hf_forward(module: nn.Module) -> bool:
    return set(_forward_params(type(module), positional=False)) <= _PLAIN_HF_ARGS


def _absolute_positions(module: nn.Module) -> bool:
    """v4 BERT-family self-attention can add relative-position scores inside attention."""
    return getattr(module, "position_embedding_type", "absolute") in (None, "absolute")


def _is_plain_timm_attention(module: nn.Module) -> bool:
    """Exactly timm's ``Attention`` computation (subclasses that keep its forward included).

    Other timm attention classes with the same attributes add rotary embeddings (EVA,
    ``AttentionRope``) or relative-position biases (SAM, relpos ViT) inside forward.
    """
    attention_module = sys.modules.get("timm.layers.attention")
    timm_attention = getattr(attention_module, "Attention", None)
    return (timm_attention is not None and isinstance(module, timm_attention)
            and type(module).forward is timm_attention.forward)


ADAPTERS = [
    Adapter(
        "hf-separate",
        HFSeparateQKV,
        lambda m: type(m).__name__.endswith("SelfAttention")
        and _has_linears(m, "query", "key", "value")
        and hasattr(m, "attention_head_size")
        and _is_self_attention(m)
        and _absolute_positions(m)
        and _plain_hf_forward(m),
        lambda m: (m.num_attention_heads, m.attention_head_size, m.attention_head_size**-0.5),
        frozenset({"query", "key", "value"}),
    ),
    Adapter(
        "hf-proj",
        HFProjQKVO,
        lambda m: type(m).__name__.endswith("Attention")
        and _has_linears(m, "q_proj", "k_proj", "v_proj", "o_proj")
        and hasattr(m, "num_attention_heads")
        and hasattr(m, "head_dim")
        and not getattr(m, "is_causal", True)
        and _plain_hf_forward(m),
        lambda m: (m.num_attention_heads, m.head_dim, m.scaling),
        frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
    ),
    Adapter(
        "hf-lin",
        HFLinQKVO,
        lambda m: _has_linears(m, "q_lin", "k_lin", "v_lin", "out_lin")
        and hasattr(m, "n_heads")
        and hasattr(m, "attention_head_size")
        and _is_self_attention(m)
        and set(_forward_params(type(m), positional=False)) <= _PLAIN_HF_ARGS | {"key", "value", "mask"},
        lambda m: (m.n_heads, m.attention_head_size, m.attention_head_size**-0.5),
        frozenset({"q_lin", "k_lin", "v_lin", "out_lin"}),
    ),
    Adapter(
        "timm",
        TimmFusedQKV,
        lambda m: _is_plain_timm_attention(m) and _has_linears(m, "qkv", "proj"),
        lambda m: (m.num_heads, m.head_dim, m.scale),
        frozenset({"qkv", "q_norm", "k_norm", "norm", "proj", "gate"}),
    ),
]

_LINEAR_CLASSES: dict[tuple[type, type], type] = {}


def find_adapter(module: nn.Module) -> Adapter | None:
    """The adapter for a softmax self-attention module, None for any other module; raises
    ConversionError for attention an adapter matches but cannot convert faithfully."""
    if isinstance(module, LinearizedAttention):
        return None
    adapter = next((a for a in ADAPTERS if a.matches(module)), None)
    unknown = unknown_members(module, adapter) if adapter is not None else []
    if unknown:
        raise ConversionError(
            f"{type(module).__name__} holds {', '.join(unknown[:4])}, which linear attention would ignore (its "
            f"{adapter.name} adapter reads only {', '.join(sorted(adapter.members))}); this attention (e.g. with a "
            "relative-position bias) cannot be converted faithfully")
    return adapter


# Parameter and buffer names of relative-position biases, wherever a model keeps them (BEiT on
# transformers 5 computes its bias in the layer and passes it to attention as an additive mask).
_POSITION_BIAS_NAMES = ("relative_position", "rel_pos", "relative_attention_bias")


def check_no_position_biases(model: nn.Module) -> None:
    """Refuse a model whose attention adds relative-position biases: linear attention cannot apply them."""
    modules = dict(model.named_modules())
    found = []
    for name, _ in (*model.named_parameters(), *model.named_buffers()):
        if not any(part in name.rsplit(".", 1)[-1] for part in _POSITION_BIAS_NAMES):
            continue
        path = name.split(".")[:-1]
        owners = [modules[".".join(path[:i])] for i in range(len(path), -1, -1)]  # nearest first
        owner = next((m for m in owners if "attention" in type(m).__name__.lower()), owners[0])
        found.append(f"{name} in {type(owner).__name__}")
    if found:
        raise ConversionError(f"{type(model).__name__} adds relative-position biases to attention ({', '.join(found[:2])}"
                              f"{', ...' if len(found) > 2 else ''}), which linear attention cannot apply; only "
                              "attention with absolute positions can be converted")


def linearized_class(base: type, mixin: type) -> type:
    """``Linear<Base>``: the mixin's forward over the original class (cached)."""
    key = (base, mixin)
    if key not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[key] = type(f"Linear{base.__name__}", (mixin, base),
                                    {"__module__": __name__, "_original_forward_params": _forward_params(base)})
    return _LINEAR_CLASSES[key]


def linearize(module: nn.Module, adapter: Adapter, linear_attn: LinearAttention,
              patch_grid: PatchGrid | None = None) -> None:
    """Re-class ``module`` in place and attach ``linear_attn``; parameters are untouched."""
    if linear_attn.uses_patch_layout:
        patch_grid.attach()  # may refuse (no patch embedding found): before the module changes
    module.__class__ = linearized_class(type(module), adapter.mixin)
    module.linear_attn = linear_attn
    module.patch_grid = patch_grid


def vision_grid(model: nn.Module) -> tuple[int, int] | None:
    """The patch grid of a ViT (timm or transformers) at its configured image size, or None for a text model."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "grid_size", None) is not None:
        return tuple(patch_embed.grid_size)
    config = getattr(model, "config", None)
    image_size, patch_size = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if image_size is None or patch_size is None:
        return None
    pair = lambda x: tuple(x) if isinstance(x, (list, tuple)) else (x, x)  # noqa: E731
    (ih, iw), (ph, pw) = pair(image_size), pair(patch_size)
    return ih // ph, iw // pw


def _patch_embedding_conv(model: nn.Module) -> nn.Module | None:
    """The convolution that cuts a ViT's image into patches (its output is the patch grid)."""
    timm_proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    if isinstance(timm_proj, nn.Conv2d):
        return timm_proj
    return next((m for name, m in model.named_modules()
                 if isinstance(m, nn.Conv2d) and "embed" in name and m.stride == m.kernel_size), None)


def patch_grid(model: nn.Module) -> PatchGrid | None:
    """What tells a vision model's DWC branch the patch grid of each input; None for a text model."""
    configured = vision_grid(model)
    return None if configured is None else PatchGrid(configured, _patch_embedding_conv(model))


def attention_like_classes(model: nn.Module) -> list[str]:
    """Names of classes that look like attention but no adapter supports (for error messages)."""
    return sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})
