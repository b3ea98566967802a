"""luna-convert: post-hoc conversion of finetuned softmax Transformers to linear attention.

    import luna_convert
    report = luna_convert.convert(model, method="luna")   # in place, weights kept
    luna_convert.save(model, "outputs/my-model", tokenizer=tok)
    model = luna_convert.load("outputs/my-model")

Names are imported on first use so that the command line starts fast. Importing the package also teaches
transformers the model type of a converted model's folder (``AutoModel*.from_pretrained`` then rebuilds it
converted): at once if transformers' AutoConfig is loaded, else as soon as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "convert": "conversion", "is_converted": "conversion", "ConversionConfig": "conversion",
    "ConversionReport": "conversion",
    "methods": "linear_methods", "METHODS": "linear_methods", "FEATURE_MAPS": "linear_methods",
    "save": "serialization", "load": "serialization", "export_model": "export", "create_timm_model": "model_building",
    "LunaConvertError": "errors", "ConversionError": "errors", "UnknownNameError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)


# transformers' AutoConfig module: once it is imported, integrations/transformers_auto.py registers the model
# type of converted models with it (importing transformers here would slow every start of the command line).
_AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_AUTO_REGISTRATION = ".integrations.transformers_auto"


class _RegisterWithTransformers:
    """A meta-path finder that finds nothing itself: when transformers' AutoConfig module is imported, it has the
    module's own loader run it, then imports the registration (once; it then leaves ``sys.meta_path``)."""

    def find_spec(self, name, path=None, target=None):
        if name != _AUTO_CONFIG_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module

            def run_then_register(module):
                run_module(module)
                importlib.import_module(_AUTO_REGISTRATION, __name__)

            spec.loader.exec_module = run_then_register
        return spec


if _AUTO_CONFIG_MODULE in sys.modules:
    importlib.import_module(_AUTO_REGISTRATION, __name__)
elif not any(isinstance(finder, _RegisterWithTransformers) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithTransformers())
