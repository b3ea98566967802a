"""A C kernel ships only where it earned its place: each source in the package is one of the kernels
docs/benchmarks.md (*Which native kernels stay*) kept by measurement, and its loader is imported by the test
that checks it against its reference. A new or revived kernel fails here until it is measured and tested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "luna_convert"

# kernel source -> (the module that loads it, the test file that checks it against its reference)
KEPT = {
    "luna_channels.c": ("luna_native", "test_luna_native.py"),
    "sorting_sums.c": ("sorting_native", "test_sorting.py"),
    "token_products.c": ("products", "test_token_products.py"),
    "pair_rows.c": ("pair_rows", "test_token_products.py"),
}


def kept_section() -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    return text.split("## Which native kernels stay", 1)[1].split("\n## ", 1)[0]


def test_every_c_source_is_a_kernel_kept_by_the_benchmark_and_tested():
    sources = {path.name for path in PACKAGE.rglob("*.c")}
    assert sources == set(KEPT), (
        f"C sources {sorted(sources)} against the kept kernels {sorted(KEPT)}: a native kernel stays only where "
        "`python benchmarks/native_kernels.py` shows it 1.5x faster or 2x smaller than the best standard path "
        "(docs/benchmarks.md, Which native kernels stay), with a test against its reference")
    section = kept_section()
    for source, (loader, test_file) in KEPT.items():
        assert f"`{source}`" in section, f"{source} is not among the kernels docs/benchmarks.md keeps"
        assert re.search(rf"with_name\(\"{re.escape(source)}\"\)",
                         "".join(p.read_text() for p in PACKAGE.rglob(f"{loader}.py"))), (source, loader)
        assert re.search(rf"\b{loader}\b", (ROOT / "tests" / test_file).read_text()), (source, test_file)
