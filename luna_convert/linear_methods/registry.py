"""The one registry of methods, and the one place their options are validated; no torch here.

Each method file calls :func:`register` at import. A method whose options dataclass lives in a torch-free
``<file>_options.py`` declares it there too (:func:`declare_options`), so :func:`resolve_options` finds and
validates a method's options without importing torch (a run config is checked before any model code loads).
A method without one (Hedgehog, ELU and ReLU take the shared ``AttentionOptions``) is found through its file.
The method files themselves are imported on the registry's first read (:func:`discover`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import ConversionError, unknown_name
from .options import FEATURE_MAP_KIND, KERNEL_KIND, AttentionOptions

OPTIONS_MODULE_SUFFIX = "_options"  # luna_options.py: LUNA's options, without torch


def check_options_fit(name: str, kind: str, options_class: type[AttentionOptions],
                      options: AttentionOptions) -> AttentionOptions:
    """``options`` if they are method ``name``'s (``options_class``) and fit its ``kind``; ValueError / TypeError
    if not. The dataclass validated its own values when it was made."""
    if type(options) is not options_class:
        raise TypeError(f"{name!r} takes {options_class.__name__}, not {type(options).__name__}")
    if options.window and kind != FEATURE_MAP_KIND:
        # the window's complement is subtracted as phi(q) . phi(k) terms, which a kernel method does not have
        raise ValueError(f"window must be 0 for {name!r}: only feature-map methods support a sliding "
                         f"window, and {name!r} is a {kind} method")
    return options


@dataclass(frozen=True)
class DeclaredOptions:
    """A method's options as its ``<file>_options.py`` declares them: what validating them needs, no core."""

    name: str
    options: type[AttentionOptions]
    kind: str = FEATURE_MAP_KIND

    def check_options(self, options: AttentionOptions) -> AttentionOptions:
        return check_options_fit(self.name, self.kind, self.options, options)


@dataclass(frozen=True)
class Method:
    """A registered conversion method.

    name         what ``--method`` takes
    core         its FeatureMap or KernelAttention class (whose ``options_class`` are its options)
    description  one line for ``luna-convert methods``
    paper        the paper it follows
    details      what is confirmed from the paper / code and what is derived (``methods --details``)
    distill      its recipe distils attention (Hedgehog stage 1) before finetuning
    recipe       further run settings the method recommends (e.g. ``{"train.added_lr": ...}``)
    aliases      former names: ``get_method`` and ``load`` accept them, so folders saved under an old name
                 still load (a renamed method lists its old name here)
    """

    name: str
    core: type
    description: str
    paper: str
    details: str
    distill: bool = False
    recipe: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    aliases: tuple[str, ...] = ()

    @property
    def options(self) -> type[AttentionOptions]:
        return self.core.options_class

    @property
    def kind(self) -> str:
        return self.core.kind

    @property
    def defaults(self) -> dict:
        """Every option with its default, as saved."""
        return asdict(self.options())

    def make_options(self, **given) -> AttentionOptions:
        """The options object (defaults filled in, validated); ValueError / TypeError on a bad value or name."""
        return self.check_options(self.options(**given))

    def check_options(self, options: AttentionOptions) -> AttentionOptions:
        """``options`` if they are this method's (its options class) and fit its kind; ValueError / TypeError
        if not. The dataclass validated its own values when it was made."""
        return check_options_fit(self.name, self.kind, self.options, options)


class MethodRegistry(MutableMapping):
    """Method name -> :class:`Method`, every method file's: reading it imports them first (:func:`discover`).
    Iterated in file order (a file's methods in the order it registers them), then methods registered
    from elsewhere (tests) in their order."""

    def __init__(self):
        self._methods: dict[str, Method] = {}

    def __getitem__(self, name: str) -> Method:
        discover()
        return self._methods[name]

    def __iter__(self) -> Iterator[str]:
        discover()
        rank = {module: i for i, module in enumerate(method_modules())}
        return iter(sorted(self._methods, key=lambda name: rank.get(self._methods[name].core.__module__, len(rank))))

    def __len__(self) -> int:
        discover()
        return len(self._methods)

    def __setitem__(self, name: str, method: Method) -> None:
        self._methods[name] = method

    def __delitem__(self, name: str) -> None:
        del self._methods[name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)})"

    def registered(self, name: str) -> bool:
        """Whether ``name`` is registered so far (no discovery: what ``register`` checks against)."""
        return name in self._methods


METHODS = MethodRegistry()
ALIASES: dict[str, str] = {}  # a former method name -> the name it is registered under now
OPTIONS: dict[str, DeclaredOptions] = {}  # method name -> its options, declared without torch
_discovery = {"methods": "not started", "options": "not started"}


@functools.cache
def method_modules() -> tuple[str, ...]:
    """This package's modules, by name (sorted): the method files and what they import."""
    package = __name__.rpartition(".")[0]
    return tuple(f"{package}.{m.name}" for m in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]),
                                                       key=lambda m: m.name))


def discover() -> None:
    """Import every module of the package once, so that each method file has registered its methods.
    Discovery, not a circle: method files import this module, never the other way round at import time."""
    if _discovery["methods"] == "not started":
        _discovery["methods"] = "running"  # a method file imported now reads the registry as it stands
        for module in method_modules():
            importlib.import_module(module)
        _discovery["methods"] = "done"


def declare_options(options_class: type[AttentionOptions], *names: str, kind: str = FEATURE_MAP_KIND) -> None:
    """Methods ``names`` take ``options_class`` (and are of ``kind``): called by a torch-free options module,
    so that their options are validated without importing the method's file; ``register`` checks the match."""
    if kind not in (FEATURE_MAP_KIND, KERNEL_KIND):
        raise ValueError(f"unknown method kind {kind!r}")
    for name in names:
        if name in OPTIONS and OPTIONS[name].options is not options_class:
            raise ValueError(f"the options of method {name!r} are declared twice")
        OPTIONS[name] = DeclaredOptions(name, options_class, kind)


def register(method: Method) -> Method:
    discover()  # the names taken are every method file's
    for name in (method.name, *method.aliases):
        if METHODS.registered(name) or name in ALIASES:
            raise ValueError(f"method {name!r} is registered twice")
    declared = OPTIONS.get(method.name)
    if declared is not None and (declared.options is not method.options or declared.kind != method.kind):
        raise ValueError(f"method {method.name!r} is declared with {declared.options.__name__} ({declared.kind}) "
                         f"but registered with {method.options.__name__} ({method.kind})")
    METHODS[method.name] = method
    ALIASES.update(dict.fromkeys(method.aliases, method.name))
    return method


def canonical_name(name: str) -> str:
    """The registered name of ``name`` (itself, or the method an alias names); unknown names stay as given."""
    return ALIASES.get(name, name)


def get_method(name: str) -> Method:
    """The method registered as ``name`` or under a former name (an alias)."""
    discover()
    name = canonical_name(name)
    if name not in METHODS:
        raise unknown_name("method", name, METHODS)
    return METHODS[name]


def options_of(name: str) -> DeclaredOptions | Method:
    """Method ``name``'s options class and kind: from its torch-free options module where it has one, else from
    its file (which imports torch); an unknown name is an UnknownNameError."""
    if name not in OPTIONS and _discovery["options"] == "not started":
        _discovery["options"] = "done"
        for module in method_modules():
            if module.endswith(OPTIONS_MODULE_SUFFIX):
                importlib.import_module(module)
    return OPTIONS[name] if name in OPTIONS else get_method(name)


def resolve_options(method: str, options: Mapping[str, Any] | AttentionOptions) -> AttentionOptions:
    """The options object of ``method`` (its options dataclass): its defaults updated with ``options`` and
    validated, or ``options`` itself when it already is one; an unknown key, a bad value or another method's
    options object is a ConversionError. The one place options given by name are validated."""
    spec = options_of(method)
    if isinstance(options, AttentionOptions):
        try:
            return spec.check_options(options)
        except (ValueError, TypeError) as e:
            raise ConversionError(f"invalid options for method {method!r} ({e})") from None
    valid = sorted(f.name for f in fields(spec.options))
    unknown = set(options) - set(valid)
    if unknown:
        # closest first (get_close_matches' order), each once
        close = list(dict.fromkeys(c for name in sorted(unknown) for c in difflib.get_close_matches(name, valid, n=2)))
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConversionError(f"unknown option(s) {sorted(unknown)} for method {method!r}.{hint} Valid: {valid}")
    try:
        return spec.check_options(spec.options(**options))
    except (ValueError, TypeError) as e:
        raise ConversionError(f"invalid options for method {method!r} ({e}); see `luna-convert methods --details`"
                              ) from None


def methods() -> dict[str, str]:
    """Method name -> one-line description."""
    return {name: m.description for name, m in METHODS.items()}


class FeatureMapView(Mapping):
    """Read-only view: method name -> FeatureMap class, for the feature-map methods of METHODS."""

    def _names(self) -> list[str]:
        return [name for name, m in METHODS.items() if m.kind == FEATURE_MAP_KIND]

    def __getitem__(self, name: str) -> type:
        if name not in self._names():
            raise KeyError(name)
        return METHODS[name].core

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


FEATURE_MAPS = FeatureMapView()


def build_feature_map(name: str, head_dim: int, num_heads: int, **options):
    """The feature map of method ``name`` with its defaults updated by ``options``."""
    return FEATURE_MAPS[name](head_dim, num_heads, **options)
