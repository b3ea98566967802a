"""Named YAML recipes and ``key=value`` overrides, read into a :class:`~.config.RunConfig`.

A recipe is a nested mapping with the sections of :class:`~.config.RunConfig`; a file
states only what differs. Overrides use dotted keys (``train.lr=3e-5``);
values are parsed as YAML scalars (``3e-5``, ``true``, ``null``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LunaConvertError, unknown_name
from .config import RunConfig, coerce_setting

# Shipped inside the package (package-data), so an installed tool finds them from any working directory.
RECIPE_DIRS = [Path(__file__).resolve().parents[1] / "recipes"]  # package data: luna_convert/recipes/*.yaml


def available_recipes() -> dict[str, str]:
    """Recipe name -> one-line description."""
    out = {}
    for folder in RECIPE_DIRS:
        for path in sorted(folder.glob("*.yaml")):
            out.setdefault(path.stem, _read_yaml(path).get("description", ""))
    return out


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LunaConvertError(f"recipe file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise LunaConvertError(f"recipe file {path} must hold a mapping of settings")
    return data


def load_recipe(name_or_path: str | None) -> RunConfig:
    """The defaults updated by a named recipe or a YAML file (None: defaults only), validated."""
    if name_or_path is None:
        return RunConfig()
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = [folder / f"{name_or_path}.yaml" for folder in RECIPE_DIRS]
        path = next((p for p in found if p.is_file()), None)
        if path is None:
            raise unknown_name("recipe", str(name_or_path), available_recipes())
    data = _read_yaml(path)
    return RunConfig.from_recipe({**data, "name": data.get("name") or path.stem})


def parse_override(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        raise LunaConvertError(f"--set expects key=value (e.g. train.lr=3e-5), got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def apply_overrides(config: RunConfig, overrides: dict[str, object]) -> RunConfig:
    """``config`` with dotted keys set (``train.lr``, ``method_options.projections``), validated; unknown keys
    are an error. ``config`` itself is left as it was."""
    data, defaults = config.to_dict(), RunConfig().to_dict()
    for key, value in overrides.items():
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            if part not in node or not isinstance(node[part], dict):
                raise unknown_name("setting", key, RunConfig.setting_names())
            node = node[part]
        leaf = parts[-1]
        if leaf not in node and parts[0] != "method_options":
            raise unknown_name("setting", key, RunConfig.setting_names())
        node[leaf] = coerce_setting(key, value, _lookup(defaults, parts))
    return RunConfig.from_dict(data)


def _lookup(tree: dict, parts: list[str]):
    for part in parts:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree
