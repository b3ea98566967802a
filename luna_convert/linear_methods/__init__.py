"""The conversion methods, one file each, and their registry.

Importing this package imports every module in it, and each method file registers its
methods (``registry.register``) as it is imported; ``METHODS``, ``methods()``, the CLI, bench
and the parametrised tests read the registry. Adding a method is one new file here (see
CONTRIBUTING.md); nothing else needs to name it.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import AttentionOptions, FeatureMap, KernelAttention, Method
from .registry import FEATURE_MAPS, METHODS, build_feature_map, get_method, methods, register

# Discovery, not a circle: method files import base and registry, never this package's names.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["AttentionOptions", "FEATURE_MAPS", "FeatureMap", "KernelAttention", "METHODS", "Method",
           "build_feature_map", "get_method", "methods", "register"]
