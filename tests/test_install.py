"""A normal (non-editable) install is a working tool: the wheel ships every recipe and the
installed package finds them from any working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_RECIPES = sorted(p.relative_to(ROOT / "luna_convert" / "recipes").as_posix()
                         for p in (ROOT / "luna_convert" / "recipes").rglob("*.yaml"))  # lra/ too
# What never belongs in a build: an old build/ folder would leak stale files into the wheel.
NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "outputs", "__pycache__", ".venv*",
                                    ".pytest_cache", ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)  # a clean copy: the checkout gets no build/ or egg-info
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (root / "dist").glob("luna_convert-*.whl")
    return built


def test_the_repository_ships_recipes():
    assert "digits-vit.yaml" in SHIPPED_RECIPES and len(SHIPPED_RECIPES) >= 10


def test_wheel_contains_every_recipe(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "luna_convert/recipes/digits-vit.yaml" in names  # the recipe behind `luna-convert demo`
    assert sorted(n.removeprefix("luna_convert/recipes/") for n in names
                  if n.startswith("luna_convert/recipes/") and n.endswith(".yaml")) == SHIPPED_RECIPES
    # the demo's teacher checkpoint
    assert {"luna_convert/builtin_teachers/digits-vit/model.safetensors",
            "luna_convert/builtin_teachers/digits-vit/linear_attention.json"} <= set(names)
    assert "luna_convert/linear_methods/luna_channels.c" in names  # LUNA's native kernel, compiled on first use
    assert "luna_convert/linear_methods/sorting_sums.c" in names  # the sorting kernel's native pass
    assert "luna_convert/ops/token_products.c" in names  # the linear-attention core's native products


def test_installed_wheel_finds_recipes_and_teacher_from_another_folder(wheel, tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The installed copy first on the path (dependencies from this environment), run away from the checkout.
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    code = ("import luna_convert, luna_convert.run.recipes as r, luna_convert.run.teachers as t; print(luna_convert.__file__); "
            "print(*sorted(r.available_recipes())); print(t.shipped_teacher('digits-vit'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, listed, teacher = proc.stdout.splitlines()
    assert Path(where).is_relative_to(target)
    assert Path(teacher).is_relative_to(target)  # installed, and its checksums match
    assert "digits-vit" in listed.split()
    assert listed.split() == [Path(n).stem for n in SHIPPED_RECIPES if "/" not in n]  # lra/ recipes: `lra --protocol`
