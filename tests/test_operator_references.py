"""Every registered native operator has its PyTorch reference beside it, found by name: ``<name>_reference`` in
the module that registers ``luna_convert::<name>`` (the tests of each operator compare the two). Backward
operators are checked through autograd of their forward's reference; the made-rows products through the
products of the features each map computes in PyTorch (tests/test_operators.py)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "luna_convert"
REGISTRATION = re.compile(r'custom_op\("luna_convert::(\w+)"')
# Operators whose reference is not one function of the same inputs, and where it is.
REFERENCED_ELSEWHERE = {
    "produced_product": "ops.products.product of the map's PyTorch features (its rows are a C maker)",
    "produced_transposed_product": "ops.products.transposed_product of the map's PyTorch features",
}


def registered_operators() -> dict[str, str]:
    """Each operator name -> the module that registers it."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in REGISTRATION.findall(path.read_text()):
            found[name] = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return found


def test_every_operator_has_its_reference_beside_it():
    operators = registered_operators()
    assert len(operators) >= 7, operators  # the scan found the registrations
    missing = []
    for name, module_name in operators.items():
        if name.endswith("_backward") or name in REFERENCED_ELSEWHERE:
            continue
        module = importlib.import_module(module_name)
        if not callable(getattr(module, f"{name}_reference", None)):
            missing.append(f"{module_name}.{name}_reference")
    assert not missing, f"operators without a reference beside them: {missing}"
    orphans = [name for name in operators if name.endswith("_backward")
               and not any(other.startswith(name.removesuffix("_backward")) for other in operators if other != name)]
    assert not orphans, f"backward operators without their forward: {orphans}"


def test_every_maker_in_ops_is_tested_against_its_reference_by_name():
    """A maker of rows in ops/ (a public function returning ``ProducedRows``: a method's map made natively inside
    the products) is compared by name in tests/test_produced_rows.py against its PyTorch reference (the same
    function on stored inputs, a formula or the map's own ``forward``)."""
    tests = (Path(__file__).parent / "test_produced_rows.py").read_text()
    makers = [f"{path.stem}.{node.name}" for path in sorted((PACKAGE / "ops").glob("*.py"))
              for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.returns is not None
              and "ProducedRows" in ast.unparse(node.returns)]
    assert len(makers) >= 1, makers  # the scan found them
    untested = [name for name in makers if not re.search(rf"\b{name.split('.')[1]}\b", tests)]
    assert not untested, f"makers no test in tests/test_produced_rows.py names: {untested}"
