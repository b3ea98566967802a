"""The adapter registry: each family file registers the attention it converts (``register``) and the
attention it refuses, with the reason (``register_refusal``); ``convert`` asks here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..layers.attention import LinearAttention
from ..errors import ConversionError
from .base import LinearizedAttention, forward_params
from .grid import PatchGrid


@dataclass(frozen=True)
class Adapter:
    name: str
    mixin: type
    matches: Callable[[nn.Module], bool]
    heads: Callable[[nn.Module], tuple[int, int, float]]  # (num_heads, head_dim, softmax scale)
    members: frozenset[str]  # the submodules its forward reads (dropouts aside); anything else is refused
    # Sliding-window (local) attention: its banded mask is lost in linear attention, which attends to every
    # key, so such a module is converted only on request (``convert(..., convert_local_layers=True)``).
    local: Callable[[nn.Module], bool] = lambda module: False


@dataclass(frozen=True)
class Refusal:
    """Attention of a known family that cannot be converted faithfully; ``reason(module)`` says why
    (None: this module is fine, e.g. BERT with absolute positions)."""

    family: str
    reason: Callable[[nn.Module], str | None]


ADAPTERS: list[Adapter] = []
REFUSALS: list[Refusal] = []


def register(adapter: Adapter) -> Adapter:
    ADAPTERS.append(adapter)
    return adapter


def register_refusal(refusal: Refusal) -> Refusal:
    REFUSALS.append(refusal)
    return refusal


def refusal_message(module: nn.Module) -> str | None:
    """Why ``module`` (of a family some adapter file knows) cannot be converted, or None."""
    for refusal in REFUSALS:
        reason = refusal.reason(module)
        if reason:
            return f"{refusal.family} ({type(module).__name__}) cannot be converted to linear attention: {reason}"
    return None


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


def find_adapter(module: nn.Module) -> Adapter | None:
    """The adapter for a softmax self-attention module, None for any other module; raises
    ConversionError for attention that is refused or that an adapter matches but cannot convert faithfully."""
    if isinstance(module, LinearizedAttention):
        return None
    refused = refusal_message(module)
    if refused:
        raise ConversionError(refused)
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
POSITION_BIAS_NAMES = ("relative_position", "rel_pos", "relative_attention_bias")


def position_biases(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(tensor name, owning module: the nearest attention-named one) of every relative-position bias in ``model``."""
    modules = dict(model.named_modules())
    found = []
    for name, _ in (*model.named_parameters(), *model.named_buffers()):
        if not any(part in name.rsplit(".", 1)[-1] for part in POSITION_BIAS_NAMES):
            continue
        path = name.split(".")[:-1]
        owners = [modules[".".join(path[:i])] for i in range(len(path), -1, -1)]  # nearest first
        found.append((name, next((m for m in owners if "attention" in type(m).__name__.lower()), owners[0])))
    return found


def check_no_position_biases(model: nn.Module) -> None:
    """Refuse a model whose attention adds relative-position biases: linear attention cannot apply them."""
    found = [f"{name} in {type(owner).__name__}" for name, owner in position_biases(model)]
    if found:
        raise ConversionError(f"{type(model).__name__} adds relative-position biases to attention ({', '.join(found[:2])}"
                              f"{', ...' if len(found) > 2 else ''}), which linear attention cannot apply; only "
                              "attention with absolute positions can be converted")


def check_supported(model: nn.Module) -> None:
    """Refuse, before anything changes, a model holding attention of a refused family (the message names
    the family, why, and the first relative-position tensors found) or an unclaimed relative-position bias."""
    for module in model.modules():
        if isinstance(module, LinearizedAttention):
            continue
        refused = refusal_message(module)
        if refused:
            biases = [name for name, _ in position_biases(model)]
            held = f" (holds {', '.join(biases[:2])}{', ...' if len(biases) > 2 else ''})" if biases else ""
            raise ConversionError(refused + held)
    check_no_position_biases(model)


_LINEAR_CLASSES: dict[tuple[type, type], type] = {}


def linearized_class(base: type, mixin: type) -> type:
    """``Linear<Base>``: the mixin's forward over the original class (cached).

    The class is made at run time, so pickle cannot find it by name: an instance pickles as
    ``rebuild_linearized(base, mixin)`` (two classes pickle finds) plus its state (``__reduce_ex__``)."""
    key = (base, mixin)
    if key not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[key] = type(f"Linear{base.__name__}", (mixin, base),
                                    {"__module__": __package__, "_original_class": base, "_mixin": mixin,
                                     "_original_forward_params": forward_params(base),
                                     "__reduce_ex__": _reduce_linearized})
    return _LINEAR_CLASSES[key]


def rebuild_linearized(base: type, mixin: type) -> nn.Module:
    """An empty ``Linear<Base>`` instance, which unpickling then fills with the saved state."""
    cls = linearized_class(base, mixin)
    return cls.__new__(cls)


def _reduce_linearized(self, protocol: int):
    return rebuild_linearized, (self._original_class, self._mixin), self.__getstate__()


def linearize(module: nn.Module, adapter: Adapter, linear_attn: LinearAttention,
              patch_grid: PatchGrid | None = None) -> None:
    """Re-class ``module`` in place and attach ``linear_attn``; parameters are untouched."""
    if linear_attn.uses_patch_layout:
        patch_grid.attach()  # may refuse (no patch embedding found): before the module changes
    module.__class__ = linearized_class(type(module), adapter.mixin)
    module.linear_attn = linear_attn
    module.patch_grid = patch_grid


def attention_like_classes(model: nn.Module) -> list[str]:
    """Names of classes that look like attention but no adapter supports (for error messages)."""
    return sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})

