"""The layout: the two kinds of attention core, the per-call context, the method
registry and its options, folders saved before the options dataclasses, and the import graph."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import luna_convert
from luna_convert.cli import app
from luna_convert.conversion import convert, linear_attention_modules, resolve_options
from luna_convert.errors import ConversionError
from luna_convert.layers.attention import AttentionMode, LinearAttention
from luna_convert.linear_methods import METHODS, AttentionOptions, FeatureMap, KernelAttention, Method, register
from luna_convert.linear_methods.base import option, option_table
from luna_convert.linear_methods.luna import LunaOptions
from luna_convert.ops.context import AttentionContext
from luna_convert.ops.reference import softmax_attention_weights
from luna_convert.serialization import CONVERSION_FILE, load, save

from conftest import example_inputs, logits_of, make_bert

PACKAGE = Path(luna_convert.__file__).parent


# ------------------------------------------------------------------ a test-only kernel method
class SoftmaxKernel(KernelAttention):
    """k(q, k) = exp(q.k / sqrt(d)): a kernel with no finite feature map; its attention is softmax's."""

    def weights(self, q, k, key_mask=None, context=None):
        scores = torch.einsum("bhnd,bhmd->bhnm", q.double(), k.double()) * self.head_dim**-0.5
        scores = scores - scores.amax(-1, keepdim=True)  # stable: exp of at most 0
        kernel = scores.exp()
        if key_mask is not None:
            kernel = kernel * key_mask[:, None, None, :]
        return kernel / kernel.sum(-1, keepdim=True)

    def forward(self, q, k, v, key_mask=None, context=None):
        return (self.weights(q, k, key_mask, context) @ v.double()).to(v.dtype)


@pytest.fixture
def softmax_kernel_method():
    method = register(Method(name="test-softmax-kernel", core=SoftmaxKernel, description="test only",
                             paper="none", details="test only"))
    yield method.name
    del METHODS[method.name]


def test_kernel_method_equals_softmax_attention_and_ignores_padding(softmax_kernel_method):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    layer = LinearAttention(softmax_kernel_method, 8, 3, 8**-0.5)
    assert layer.kernel is not None and layer.phi_q is None and layer.dwc is None
    want = softmax_attention_weights(q.double(), k.double(), 8**-0.5, mask)
    torch.testing.assert_close(layer.attention_weights(q, k, mask), want, rtol=0, atol=1e-14)  # measured 1e-16
    torch.testing.assert_close(layer(q, k, v, mask), (want @ v.double()).float(), rtol=0, atol=1e-6)  # measured 0
    # The second example alone (its real tokens only) gives the same rows as inside the padded batch.
    alone = layer(q[1:, :, :4], k[1:, :, :4], v[1:, :, :4])
    torch.testing.assert_close(layer(q, k, v, mask)[1, :, :4], alone[0], rtol=0, atol=1e-6)  # measured 0
    # Distillation compares the method's own explicit weights with softmax: here they are the same rows.
    layer.set_mode(AttentionMode.DISTILL_ATTENTION)
    layer(q, k, v, mask)
    entropy = -(want * torch.log(want + layer.eps)).sum(-1)[mask[:, None, :].expand(-1, 3, -1)].mean()
    # measured 2.2e-8: the layer's teacher is computed in float32, this one in float64
    torch.testing.assert_close(layer.distill_loss, entropy, rtol=0, atol=1e-7)


def test_converting_with_a_kernel_method_keeps_the_logits(softmax_kernel_method):
    model = make_bert()
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        before = logits_of(model, inputs)
        report = convert(model, softmax_kernel_method)
        after = logits_of(model, inputs)
    assert report.options == METHODS[softmax_kernel_method].options() and report.modules[0].feature_dim == 0
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)  # measured 2.4e-7: softmax as a kernel is softmax


# ------------------------------------------------------------------ the per-call context
def test_context_positions_count_real_tokens_only():
    mask = torch.tensor([[True, True, True, False, False], [True, False, True, True, False]])
    ctx = AttentionContext(mask, 5)
    assert ctx.positions().tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 2]]
    assert ctx.lengths.tolist() == [3, 3]
    chunk = ctx.rows(slice(2, 4))
    assert (chunk.start, chunk.stop) == (2, 4) and chunk.positions().tolist() == [[2, 2], [1, 2]]
    assert chunk.rows(slice(1, None)).positions().tolist() == [[2], [2]]
    assert AttentionContext(None, 4).rows(slice(1, 3)).positions().tolist() == [[1, 2]]


@dataclass
class PositionOptions(AttentionOptions):
    period: float = option(5.0, "positions are read modulo this")


class PositionMap(FeatureMap):
    """A token-wise map that also reads each token's position among real tokens (as cosFormer will)."""

    options_class = PositionOptions

    @property
    def feature_dim(self) -> int:
        return 2 * self.head_dim

    def forward(self, x, context=None):
        pos = torch.zeros(x.shape[0], x.shape[2]) if context is None else context.positions().float()
        angle = (pos / self.options.period)[:, None, :, None].to(x.dtype)
        return torch.cat([torch.relu(x) * torch.cos(angle).abs(), torch.relu(-x) * torch.sin(angle).abs()], -1)


@pytest.fixture
def position_method():
    method = register(Method(name="test-positions", core=PositionMap, description="test only", paper="none",
                             details="test only"))
    yield method.name
    del METHODS[method.name]


def test_feature_maps_see_positions_on_the_plain_and_the_streamed_path(position_method):
    g = torch.Generator().manual_seed(1)
    layer = LinearAttention(position_method, 4, 2, 0.5).train()
    q, k, v = (torch.randn(2, 2, 40, 4, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.arange(40)[None] < torch.tensor([[40], [23]])
    outs = []
    for min_bytes in (1 << 62, 1000):  # plain, then chunks of 16 tokens
        layer.stream_min_bytes, layer.stream_chunk_bytes = min_bytes, 1
        out = layer(q, k, v, mask)
        outs.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    (plain, plain_grads), (streamed, streamed_grads) = outs
    torch.testing.assert_close(streamed, plain, rtol=0, atol=1e-6)  # measured 1.8e-7
    for a, b in zip(streamed_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)  # measured 5.4e-7 (gradients up to 3.3)
    # Positions over real tokens: the padded example equals itself alone, so the map really saw the mask.
    alone = layer(q[1:, :, :23], k[1:, :, :23], v[1:, :, :23])
    torch.testing.assert_close(plain[1, :, :23], alone[0], rtol=0, atol=1e-6)  # measured 1.8e-7
    layer.stream_min_bytes = 1 << 62
    shifted = layer(q, k, v, torch.roll(mask, 5, 1))  # the same real count, other places: other positions
    assert (shifted - plain).abs().max() > 0.1  # measured 0.95


# ------------------------------------------------------------------ registry and options
def test_every_method_has_options_a_paper_details_and_its_tests_parametrised():
    assert {"luna", "t2r", "t2r-hh", "hedgehog"} <= set(METHODS)
    for name, spec in METHODS.items():
        assert issubclass(spec.options, AttentionOptions) and spec.defaults == spec.options().to_dict()
        assert spec.paper and spec.details and spec.description
        assert all(help_text for _, _, help_text in option_table(spec.options)), name
    assert METHODS["t2r"].core is METHODS["t2r-hh"].core and METHODS["t2r-hh"].distill and not METHODS["t2r"].distill


@pytest.mark.parametrize("bad,message", [
    ({"projections": 0}, "projections must be a positive integer"),
    ({"channel_init": "gaussian"}, "unknown channel_init"),
    ({"channel_bank": "fourier", "channels": 3}, "even number of channels"),
    ({"dwc_kernel": 4}, "dwc_kernel must be a positive odd integer"),
    ({"eps": 0}, "eps must be a positive number"),
])
def test_options_are_validated_before_any_model_is_built(bad, message):
    with pytest.raises(ValueError, match=message):
        LunaOptions(**bad)
    with pytest.raises(ConversionError, match=f"invalid options for method 'luna'.*{message}"):
        resolve_options("luna", bad)


def test_methods_details_lists_options_with_defaults():
    result = CliRunner().invoke(app, ["methods", "--details"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name, spec in METHODS.items():
        assert name in result.output and spec.paper in result.output
        for option_name, default, _ in option_table(spec.options):
            assert option_name in result.output and repr(default) in result.output
    assert "Derived" in result.output and "Confirmed" in result.output
    plain = CliRunner().invoke(app, ["methods"]).output
    assert "Confirmed" not in plain and all(name in plain for name in METHODS)


# ------------------------------------------------------------------ folders saved before the options dataclasses
OLD_OPTIONS = {  # linear_attention.json "options" as saved before channel_init & co. and before eps was recorded
    "luna": {"projections": 8, "channels": 8, "hidden": 64, "shared_channels": False, "envelope": False,
             "channel_bank": "mlp", "dwc": True, "dwc_kernel": 3},
    "t2r": {"feature_dim": 64, "dwc": False},
    "hedgehog": {"dwc": False},
}


@pytest.mark.parametrize("method", sorted(OLD_OPTIONS))
def test_a_folder_saved_in_the_old_format_still_loads(method, tmp_path):
    model = make_bert()
    # converted as it was then: the old options, with what the old version used for keys it did not save
    convert(model, method, **METHODS[method].options.with_saved_defaults(OLD_OPTIONS[method]))
    with torch.no_grad():
        for la in linear_attention_modules(model):
            for p in la.parameters():
                p.add_(0.05 * torch.randn_like(p))
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, inputs)
    folder = save(model, tmp_path / "model")
    meta = json.loads((folder / CONVERSION_FILE).read_text())
    meta["conversion"]["options"] = OLD_OPTIONS[method]
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    loaded = load(folder)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)
    # keys the old version did not save: its values where the defaults changed since (LUNA), else the defaults
    want = {**METHODS[method].defaults, **METHODS[method].options.saved_before, **OLD_OPTIONS[method]}
    assert getattr(loaded, "linear_attention_config").options == METHODS[method].options(**want)


# ------------------------------------------------------------------ imports
# cli.py is the top: it imports its commands' modules inside the commands, so that --help does not load torch.
LAZY_TOP = "luna_convert.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, node) -> list[str]:
    """The luna_convert modules an import statement names (relative or absolute; "from . import x": x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "luna_convert"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").split(".")[0] == "luna_convert":
        target = node.module
    else:
        return []
    names = [f"{target}.{a.name}" for a in node.names]
    return [n if n in package_modules() else target for n in names]


@functools.lru_cache(maxsize=None)
def package_modules() -> frozenset[str]:
    """Every module of the package, listed once for all the import statements read."""
    return frozenset(module_name(p) for p in PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """A package file's syntax tree, parsed once for all the layout checks (they only read it)."""
    return ast.parse(path.read_text())


def import_edges() -> dict[str, set[str]]:
    """module -> the luna_convert modules it imports anywhere in its file (module level or in a function)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        targets = edges.setdefault(module_name(path), set())
        for node in ast.walk(parsed(path)):
            targets.update(package_imports(path, node))
    return edges


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_package_has_no_import_cycle_no_private_imports_and_no_hidden_imports():
    edges = import_edges()
    state: dict[str, str] = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert {m for m, ts in edges.items() if LAZY_TOP in ts} <= {"luna_convert.__main__"}  # cli imports down only
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        tree = parsed(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and package_imports(path, node):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports private names {private}"
        if name == LAZY_TOP:
            continue
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            hidden = [n for n in ast.walk(func) if package_imports(path, n)]
            assert not hidden, f"{name}:{func.name} imports a package module inside a function"


def test_only_the_command_line_imports_tools():
    """tools/ sits above run/ and the library (``cli.py`` -> ``tools/``, ``run/`` -> ...): nothing outside it but
    cli.py imports it, which is why a tool timed with the bench's clock (tools/layer_selection.py) stays there."""
    outside = {m: ts for m, ts in import_edges().items() if m.split(".")[:2] != ["luna_convert", "tools"]}
    importers = sorted(m for m, ts in outside.items() if any(t.split(".")[:2] == ["luna_convert", "tools"] for t in ts))
    assert importers == [LAZY_TOP]


# The stated import order, top (the command line) to bottom (tensor math and plain helpers): a module
# imports only from tiers below its own. Each top-level module or package of luna_convert has a tier.
IMPORT_TIERS = (
    ("__main__",),
    ("cli",),
    ("tools",),
    ("lra",),
    ("run", "integrations"),
    ("task_kinds",),
    ("engine", "data", "serialization", "export"),
    ("conversion",),
    ("adapters",),
    ("model_building",),
    ("layers",),
    ("linear_methods",),
    ("ops",),
    ("metrics", "sentence_embedding", "fileio", "folder_layout"),
    ("tasks",),
    ("errors",),
)


def test_imports_point_down_the_stated_order():
    """CONTRIBUTING.md's order, whole: an import up a tier (or across one) would let the layers tangle."""
    tier = {name: rank for rank, names in enumerate(IMPORT_TIERS) for name in names}
    edges = {m: ts for m, ts in import_edges().items() if m != "luna_convert"}  # __init__ imports lazily, by name
    untiered = sorted({m.split(".")[1] for m in edges} - set(tier))
    assert not untiered, f"give these a tier in IMPORT_TIERS (and the package map): {untiered}"
    upward = [f"{module} -> {target}" for module, targets in edges.items() for target in targets
              if target != "luna_convert" and target.split(".")[1] != module.split(".")[1]
              and tier[target.split(".")[1]] <= tier[module.split(".")[1]]]
    assert not upward, "imports against the stated order:\n" + "\n".join(sorted(upward))


def test_the_rest_of_the_package_uses_data_through_its_front():
    """luna_convert.data re-exports what other modules use; its sub-modules are its own business."""
    outside = {m: ts for m, ts in import_edges().items() if m.split(".")[:2] != ["luna_convert", "data"]}
    reaching = {m: sorted(t for t in ts if t.startswith("luna_convert.data.")) for m, ts in outside.items()}
    assert not {m: ts for m, ts in reaching.items() if ts}
    assert "luna_convert.data" in outside["luna_convert.run.task_data"]  # the edges do see data's users

def test_no_module_reads_a_private_name_of_a_package_module_it_imports():
    """``from .. import data`` then ``data._cache`` reaches into a private name as surely as importing it."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        tree = parsed(path)
        bound = set()  # local names bound to a luna_convert module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and package_imports(path, node):
                bound.update(a.asname or a.name for a, target in zip(node.names, package_imports(path, node))
                             if target in modules and target.rpartition(".")[2] == a.name)
            elif isinstance(node, ast.Import):
                bound.update(a.asname for a in node.names if a.asname and a.name in modules)
        private = sorted({f"{n.value.id}.{n.attr}" for n in ast.walk(tree)
                          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
                          and n.attr.startswith("_") and not n.attr.startswith("__")})
        assert not private, f"{module_name(path)} reads private names {private}"
