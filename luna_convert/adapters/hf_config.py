"""The transformers config of a converted model: ``Linear<Config>``, a subclass of the model's own config class.

It carries the conversion record (``linear_attention``: method, options, targets) and, whenever it is written
out (``save_pretrained``, ``push_to_hub``, ``luna_convert.save``), names the model type ``luna_convert`` and the
original type (``base_model_type``). transformers then never reads such a folder as a softmax model: without
luna-convert the model type is unknown to it, and ``import luna_convert`` registers the type with its Auto classes
(``integrations/transformers_auto.py``). In memory nothing changes: ``config.model_type`` and ``config.to_dict()``
keep the original type, which other libraries read (peft picks its default LoRA targets by it).
"""

from __future__ import annotations

import json

MODEL_TYPE = "luna_convert"  # the model type a converted model's config.json names
BASE_TYPE_KEY = "base_model_type"  # the original model type, beside it
RECORD_KEY = "linear_attention"  # the conversion record (ConversionConfig.to_dict())


class LinearizedConfig:
    """Mixin over a transformers config class; see the module docstring."""

    _original_class: type

    def to_json_string(self, use_diff: bool = True) -> str:
        fields = json.loads(super().to_json_string(use_diff=use_diff))
        fields.update({"model_type": MODEL_TYPE, BASE_TYPE_KEY: self._original_class.model_type})
        return json.dumps(fields, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """The fields of a written config.json read back: the model type is the original one again."""
        fields = {k: v for k, v in config_dict.items() if k != BASE_TYPE_KEY}
        fields["model_type"] = cls._original_class.model_type
        return super().from_dict(fields, **kwargs)


_CONFIG_CLASSES: dict[type, type] = {}


def linearized_config_class(base: type) -> type:
    """``Linear<Base>`` for a transformers config class (cached; ``base`` itself for one already linearized).
    Made at run time: an instance pickles as ``rebuild_linearized_config(base)`` plus its state."""
    if issubclass(base, LinearizedConfig):
        return base
    if base not in _CONFIG_CLASSES:
        _CONFIG_CLASSES[base] = type(f"Linear{base.__name__}", (LinearizedConfig, base),
                                     {"__module__": __name__, "_original_class": base,
                                      "__reduce_ex__": _reduce_config})
    return _CONFIG_CLASSES[base]


def rebuild_linearized_config(base: type):
    """An empty ``Linear<Base>`` config, which unpickling then fills with the saved state."""
    cls = linearized_config_class(base)
    return cls.__new__(cls)


def _reduce_config(self, protocol: int):
    return rebuild_linearized_config, (self._original_class,), self.__getstate__()


def is_transformers_config(config) -> bool:
    return hasattr(config, "to_json_string") and isinstance(getattr(type(config), "model_type", None), str)


def mark_converted(config, record: dict) -> None:
    """Make ``config`` (in place) the config of a converted model holding ``record``."""
    config.__class__ = linearized_config_class(type(config))
    setattr(config, RECORD_KEY, record)


def original_config(config):
    """A copy of ``config`` as its original (softmax) class, without the conversion record."""
    fields = {k: v for k, v in config.to_dict().items() if k != RECORD_KEY}
    cls = config._original_class if isinstance(config, LinearizedConfig) else type(config)
    return cls.from_dict(fields)
