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

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..adapters import BASE_TYPE_KEY, MODEL_TYPE, RECORD_KEY, linearized_config_class
from ..errors import LunaConvertError
from ..serialization import converting_model_class


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
