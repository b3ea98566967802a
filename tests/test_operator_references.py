"""Every registered native operator has its PyTorch reference beside it, found by name: ``<name>_reference`` in
the module that registers ``luna_convert::<name>`` (the tests of each operator compare the two). Backward
operators are checked through autograd of their forward's reference; the made-rows products through the
products of the features each map computes in PyTorch (tests/test_operators.py)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "luna_convert"
REGISTRATION = re.compile(r'custom_op\("luna_convert::(\w+)"')
# Operators whose reference is not one function of the same inputs, and where it is.
REFERENCED_ELSEWHERE = {
    "produced_product": "product_reference of the map's PyTorch features (its rows are C makers)",
    "produced_transposed_product": "transposed_product_reference of the map's PyTorch features",
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
    assert len(operators) >= 14, operators  # the scan found the registrations
    missing = []
    for name, module_name in operators.items():
        if name.endswith("_backward") or name in REFERENCED_ELSEWHERE:
            continue
        module = importlib.import_module(module_name)
        if not callable(getattr(module, f"{name}_reference", None)):
            missing.append(f"{module_name}.{name}_reference")
    assert not missing, f"operators without a reference beside them: {missing}"
    orphans = [name for name in operators if name.endswith("_backward")  # dwc_tokens_backward: dwc_tokens_plus's
               and not any(other.startswith(name.removesuffix("_backward")) for other in operators if other != name)]
    assert not orphans, f"backward operators without their forward: {orphans}"
