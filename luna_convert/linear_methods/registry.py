"""The one registry of methods: each method file calls :func:`register` at import."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..errors import unknown_name
from .base import FEATURE_MAP_KIND, FeatureMap, Method

METHODS: dict[str, Method] = {}
ALIASES: dict[str, str] = {}  # a former method name -> the name it is registered under now


def register(method: Method) -> Method:
    for name in (method.name, *method.aliases):
        if name in METHODS or name in ALIASES:
            raise ValueError(f"method {name!r} is registered twice")
    METHODS[method.name] = method
    ALIASES.update(dict.fromkeys(method.aliases, method.name))
    return method


def canonical_name(name: str) -> str:
    """The registered name of ``name`` (itself, or the method an alias names); unknown names stay as given."""
    return ALIASES.get(name, name)


def get_method(name: str) -> Method:
    """The method registered as ``name`` or under a former name (an alias)."""
    name = canonical_name(name)
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
