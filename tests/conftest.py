"""Shared fixtures: tiny, offline models built from configs (no downloads).

Every model is built fresh per test (so in-place conversion cannot leak
between tests) with a fixed seed, in eval mode.
"""

from __future__ import annotations

import os
import tempfile

# Before anything imports huggingface_hub / transformers / timm: no network look-ups.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Native kernels (ops.native) compile into a cache of this test session, not the user's ~/.cache.
os.environ.setdefault("LUNA_CONVERT_CACHE_DIR", tempfile.mkdtemp(prefix="luna-convert-cache-"))

import platform  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SEED = 1234
HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 32, 2, 4, 64, 99
IMAGE, PATCH, NUM_LABELS = 32, 8, 3
# Larger than the libraries' 0.02 so that attention is far from uniform and logits are
# O(1): comparisons of logits (softmax vs linear, padded vs not) are then meaningful.
INIT_STD = 0.2


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch's deps here
        pass


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def vit_has_proj_layout() -> bool:
    """transformers ViT with ViTAttention owning q_proj/k_proj/v_proj/o_proj (v5.10+)."""
    from transformers.models.vit import modeling_vit

    return hasattr(modeling_vit, "ViTAttention") and "q_proj" in modeling_vit.ViTAttention.__init__.__code__.co_names


# --------------------------------------------------------------------------- builders
def make_bert(attn_implementation: str | None = None, num_labels: int = NUM_LABELS, layers: int = LAYERS):
    from transformers import BertConfig, BertForSequenceClassification

    seed_everything()
    config = BertConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
        vocab_size=VOCAB, max_position_embeddings=64, num_labels=num_labels, initializer_range=INIT_STD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return BertForSequenceClassification(config).eval()


def make_distilbert(attn_implementation: str | None = None, num_labels: int = NUM_LABELS):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    seed_everything()
    config = DistilBertConfig(
        dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=INTERMEDIATE, vocab_size=VOCAB,
        max_position_embeddings=64, num_labels=num_labels, initializer_range=INIT_STD, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0,
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return DistilBertForSequenceClassification(config).eval()


def make_hf_vit(attn_implementation: str | None = None, layers: int = LAYERS):
    from transformers import ViTConfig, ViTForImageClassification

    seed_everything()
    config = ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
        image_size=IMAGE, patch_size=PATCH, num_channels=3, num_labels=NUM_LABELS, initializer_range=INIT_STD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return ViTForImageClassification(config).eval()


def make_timm_vit(**extra):
    from luna_convert.model_building import create_timm_model

    seed_everything()
    model = create_timm_model(
        "vit_tiny_patch16_224", img_size=IMAGE, patch_size=PATCH, embed_dim=HIDDEN, depth=LAYERS,
        num_heads=HEADS, num_classes=NUM_LABELS, **extra,
    ).eval()
    with torch.no_grad():  # same spread as the transformers models (see INIT_STD)
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(("cls_token", "reg_token", "pos_embed")):
                p.normal_(0.0, INIT_STD)
    return model


def make_timm_vit_reg():
    """qk_norm + register tokens: 1 CLS + 2 registers = 3 prefix tokens before the 4x4 patch grid."""
    return make_timm_vit(qk_norm=True, reg_tokens=2)


ARCHITECTURES = {
    "hf-bert": make_bert,
    "hf-distilbert": make_distilbert,
    "hf-vit": make_hf_vit,
    "timm-vit": make_timm_vit,
    "timm-vit-reg": make_timm_vit_reg,
}


def example_inputs(arch: str, batch: int = 2, seq: int = 7) -> dict:
    """Deterministic model inputs as keyword arguments (BERT gets a padded batch)."""
    g = torch.Generator().manual_seed(SEED + 1)
    if arch in ("hf-bert", "hf-distilbert"):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq - 3:] = 0  # first row: 3 pads at the end
        ids = ids.masked_fill(mask == 0, 0)
        return {"input_ids": ids, "attention_mask": mask}
    images = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    return {"pixel_values": images} if arch == "hf-vit" else {"x": images}


def logits_of(model, inputs: dict) -> torch.Tensor:
    if "x" in inputs:
        return model(inputs["x"])
    return model(**inputs).logits


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _seeded():
    seed_everything()
    yield


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request) -> str:
    return request.param


# --------------------------------------------------------------------------- real data
# The development setup's read-only data sets (GLUE TSVs, ...): ../shared/data beside the checkout,
# or wherever LUNA_SHARED_DATA points. Never part of an install: only tests and benchmarks read it.
SHARED_DATA = Path(os.environ.get("LUNA_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def shared_data(*parts: str) -> Path:
    """A folder of the shared data, or a skip naming where it was looked for."""
    folder = SHARED_DATA.joinpath(*parts)
    if not folder.is_dir():
        pytest.skip(f"real data not found at {folder} (set LUNA_SHARED_DATA to the shared data folder)")
    return folder


# --------------------------------------------------------------------------- skips in CI
# Skips accepted under --fail-on-skip (as .ci/run runs pytest): reason prefix -> why the test is optional.
# Any other skip fails the run: a test CI is meant to run did not run.
OPTIONAL_SKIPS = {
    "Inductor compiles C++ for minutes": "opt-in (LUNA_TEST_INDUCTOR=1): minutes of C++ compilation on a CPU",
    "transformers v4 API": "version-gated: runs in CI's transformers 4.57 stage",
    "transformers v5 API": "version-gated: runs in CI's current-transformers stage",
    "needs the transformers >= 5.10 ViT layout": "version-gated: runs in CI's current-transformers stage",
    "needs a CUDA device": "hardware-gated: no GPU in CI; scripts/gpu_check.sh runs tests/test_cuda.py on a lent device",
    "seqeval is not installed": "optional cross-check: seqeval is no dependency; hand-computed cases test entity F1",
}
if os.environ.get("LUNA_CHROMIUM_UNAVAILABLE"):  # set by .ci/run only when installing chromium failed
    OPTIONAL_SKIPS["needs Debian's chromium"] = "the machine could not install chromium (.ci/run warned)"


def pytest_addoption(parser):
    parser.addoption("--fail-on-skip", action="store_true",
                     help="fail the run if a test skips for a reason not in tests/conftest.py OPTIONAL_SKIPS")


class SkipGuard:
    """Collects skips whose reason is not allow-listed; turns a passing run into a failing one."""

    def __init__(self):
        self.unexpected: list[str] = []

    def _check(self, report) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(tuple(OPTIONAL_SKIPS)):
            self.unexpected.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report):
        self._check(report)

    def pytest_collectreport(self, report):
        self._check(report)

    def pytest_sessionfinish(self, session):
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.unexpected:
            terminalreporter.section("skips not in OPTIONAL_SKIPS (tests/conftest.py)", red=True)
            for line in self.unexpected:
                terminalreporter.line(line)


def pytest_configure(config):
    if config.getoption("--fail-on-skip"):
        config.pluginmanager.register(SkipGuard(), "luna-skip-guard")


NATIVE_BUILDS = ["this CPU", "AVX2"]


def this_cpu_or_avx2(build: str, monkeypatch, module, loader: str, status, source: Path, lanes: str):
    """A native library for tests of both vector widths. ``build`` "this CPU": what ``module.<loader>()`` hands
    out (the test is skipped, saying ``status()``, where there is none). "AVX2": ``source`` built for AVX2 with
    FMA (what a CPU without AVX-512 runs; ``ops.native.build_variant``), its ``lanes()`` checked to be 8, and
    put in place of ``module.<loader>`` for the test; skipped where this CPU cannot run it."""
    from luna_convert.ops import native

    if build == "this CPU":
        lib = getattr(module, loader)()
        if lib is None:
            pytest.skip(status())
        return lib
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        pytest.skip("the AVX2 build needs an x86 CPU with AVX2 and FMA")
    if native.compiler() is None:
        pytest.skip("no C compiler")
    lib = native.build_variant(source, ("-mavx2", "-mfma"))
    assert getattr(lib, lanes)() == 8
    monkeypatch.setattr(module, loader, lambda: lib)
    return lib


@pytest.fixture(params=NATIVE_BUILDS)
def exp_rows_library(request, monkeypatch):
    """``ops.exp_rows``' library: the build for this CPU, then the AVX2 build (8 lanes) in its place."""
    from luna_convert.ops import exp_rows

    return this_cpu_or_avx2(request.param, monkeypatch, exp_rows, "library", exp_rows.status, exp_rows.SOURCE,
                            "exp_rows_lanes")
