"""The conversion methods, one file each, and their registry.

Each method file registers its methods (``registry.register``) as it is imported, and the registry
imports every module here on its first read; ``METHODS``, ``methods()``, the CLI, bench and the
parametrised tests read the registry. Adding a method is one new file here (see CONTRIBUTING.md);
nothing else needs to name it. Importing this package imports no torch: a method's options (in its
torch-free ``<file>_options.py``) are read and validated without it.
"""

from __future__ import annotations

import importlib

from .options import AttentionOptions
from .registry import FEATURE_MAPS, METHODS, Method, build_feature_map, get_method, methods, register

_CORES = {"FeatureMap": "base", "KernelAttention": "base"}  # torch: imported on first use


def __getattr__(name: str):
    if name in _CORES:
        return getattr(importlib.import_module(f"{__name__}.{_CORES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionOptions", "FEATURE_MAPS", "FeatureMap", "KernelAttention", "METHODS", "Method",
           "build_feature_map", "get_method", "methods", "register"]
