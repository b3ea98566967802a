"""transformers' Auto classes load a converted model's folder as the converted model.

A converted model's config.json names the model type ``luna_convert`` and the original one (``base_model_type``;
see ``adapters/hf_config.py``). ``import luna_convert`` registers :class:`LunaConvertConfig` under that type as
soon as transformers' ``AutoConfig`` is imported (``luna_convert/__init__.py`` waits for it, so that importing
luna_convert alone loads neither transformers nor torch). Reading such a config gives ``Linear<Config>`` and
registers, in every Auto model mapping that knows the original config class, a class that converts itself as
the record says when it is built; transformers' own ``from_pretrained`` then loads every weight (hub downloads,
dtype, device map, shards) into the converted model, which it returns as the original class (a
``BertForSequenceClassification``, exactly what :func:`luna_convert.convert` gives). Without luna-convert,
transformers refuses the unknown model type instead of loading a softmax model and dropping the linear weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..adapters import BASE_TYPE_KEY, MODEL_TYPE, RECORD_KEY, linearized_config_class
from ..conversion import convert_as_recorded, linear_attention_modules
from ..errors import LunaConvertError
from ..layers.attention import LinearAttention


class LunaConvertConfig(PretrainedConfig):
    """What ``AutoConfig`` finds under the model type ``luna_convert``: reading a config.json gives the original
    config class's ``Linear<Config>`` (a ``BertConfig`` holding the conversion record)."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        base_type = config_dict.get(BASE_TYPE_KEY)
        if RECORD_KEY not in config_dict or base_type not in CONFIG_MAPPING:
            raise LunaConvertError(f"this luna_convert config.json names base_model_type {base_type!r}"
                                   f"{'' if RECORD_KEY in config_dict else f' and has no {RECORD_KEY!r} record'}; "
                                   "save the converted model again, or install the transformers version that wrote it")
        config_class = linearized_config_class(CONFIG_MAPPING[base_type])
        register_model_classes(config_class)
        return config_class.from_dict(config_dict, **kwargs)


class ConvertingModel:
    """Mixin over a transformers model class: built from a ``Linear<Config>``, the model converts itself as the
    config's record says, so that ``from_pretrained`` loads the linear-attention weights into their modules."""

    _original_class: type

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # from_pretrained builds the model on the meta device; the methods' own set-up computes real values,
        # so the new modules are built on the CPU first (then placed beside the model's weights)
        with torch.device("cpu"):
            convert_as_recorded(self, getattr(config, RECORD_KEY))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return _as_original(cls, super().from_pretrained(*args, **kwargs))

    @classmethod
    def _from_config(cls, config, **kwargs):
        return _as_original(cls, super()._from_config(config, **kwargs))


def _as_original(cls: type, loaded):
    """The loaded model re-classed to the original class (``from_pretrained`` may return it with loading info),
    with the buffers no file holds made again."""
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.__class__ = cls._original_class
    restore_unsaved_buffers(model)
    return loaded


def restore_unsaved_buffers(model: nn.Module) -> None:
    """Set every linear-attention buffer that is not saved (index tables and the like, fixed by the options) to the
    value a new layer computes: transformers' loading leaves such buffers of a model built on the meta device
    empty (it re-creates only those of its own modules)."""
    for layer in linear_attention_modules(model):
        saved = set(layer.state_dict())
        unsaved = [name for name, _ in layer.named_buffers() if name not in saved]
        if not unsaved:
            continue
        with torch.device("cpu"):
            fresh = LinearAttention(layer.method, layer.head_dim, layer.num_heads, layer.softmax_scale,
                                    spatial=layer.spatial, options=layer.options)
        for name in unsaved:
            owner_name, _, buffer_name = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            current = owner.get_buffer(buffer_name)
            owner.register_buffer(buffer_name, fresh.get_buffer(name).to(device=current.device, dtype=current.dtype),
                                  persistent=False)


_MODEL_CLASSES: dict[type, type] = {}


def converting_model_class(base: type) -> type:
    """``base`` converting itself on construction (cached); named as ``base``, which the Auto classes match against
    ``config.architectures``."""
    if base not in _MODEL_CLASSES:
        _MODEL_CLASSES[base] = type(base.__name__, (ConvertingModel, base),
                                    {"__module__": __name__, "__qualname__": base.__name__, "_original_class": base})
    return _MODEL_CLASSES[base]


def register_model_classes(config_class: type) -> None:
    """Map ``config_class`` (a ``Linear<Config>``) in every Auto model mapping that maps its original class."""
    from transformers.models.auto import auto_factory, modeling_auto

    base = config_class._original_class
    for mapping in vars(modeling_auto).values():
        if not isinstance(mapping, auto_factory._LazyAutoMapping) or config_class in mapping or base not in mapping:
            continue
        models = mapping[base]
        converting = (tuple(converting_model_class(m) for m in models) if isinstance(models, (tuple, list))
                      else converting_model_class(models))
        mapping.register(config_class, converting, exist_ok=True)


def register() -> None:
    """Register the model type ``luna_convert`` with ``AutoConfig`` (once)."""
    if MODEL_TYPE not in CONFIG_MAPPING:
        CONFIG_MAPPING.register(MODEL_TYPE, LunaConvertConfig)


register()
