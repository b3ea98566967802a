"""The one registry of methods: each method file calls :func:`register` at import."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..errors import unknown_name
from .base import FEATURE_MAP_KIND, FeatureMap, Method

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise unknown_name("method", name, METHODS)
    return METHODS[name]


def methods() -> dict[str, str]:
    """Method name -> one-line description."""
    return {name: m.description for name, m in METHODS.items()}


class FeatureMapView(Mapping):
    """Read-only view: method name -> FeatureMap class, for the feature-map methods of METHODS."""

    def _names(self) -> list[str]:
        return [name for name, m in METHODS.items() if m.kind == FEATURE_MAP_KIND]

    def __getitem__(self, name: str) -> type[FeatureMap]:
        if name not in self._names():
            raise KeyError(name)
        return METHODS[name].core

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


FEATURE_MAPS = FeatureMapView()


def build_feature_map(name: str, head_dim: int, num_heads: int, **options) -> FeatureMap:
    """The feature map of method ``name`` with its defaults updated by ``options``."""
    return FEATURE_MAPS[name](head_dim, num_heads, **options)
