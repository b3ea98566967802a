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
from fnmatch import fnmatchcase  # noqa: E402
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
    parser.addoption("--record-fast-tier", action="store_true",
                     help="write the fast tier's test functions to tests/fast_tier.txt (with --collect-only)")


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


# ------------------------------------------------------------------ the fast tier
# ``pytest -m "not slow"``: the tests a developer runs after each change, under 2 minutes on 2 cores. The ``slow``
# marker comes from the tables below, not from each file. Patterns are fnmatch patterns on node ids
# (``tests/test_x.py::test_name[params]``); one that matches nothing (its file gone) is simply unused.
# tests/fast_tier.txt records the fast tier's test functions; tests/test_fast_tier.py fails when the fast tier
# selects one not recorded there, or more than FAST_TIER_BUDGET tests: a test joins the fast tier on purpose.

FAST_TIER_RECORD = Path(__file__).with_name("fast_tier.txt")
FAST_TIER_BUDGET = 770  # tests (parametrised cases one by one) the fast tier may select

# Whole files: end-to-end runs and resumes, every architecture, fuzzing, export, the numerics matrix, compiled
# graphs, the native kernels' and operators' tests, installs and subprocess runs.
SLOW_FILES = frozenset({
    # whole runs, resumes, recipes, reports of real runs
    "test_pipeline.py", "test_run_stages.py", "test_resume.py", "test_teachers.py", "test_demo.py",
    "test_lra_run.py", "test_layer_selection.py", "test_hybrid_check.py", "test_lora.py", "test_integration.py",
    "test_tool_integrations.py", "test_quality_levers.py", "test_audit_loading.py", "test_bench.py",
    # every architecture family, saved model files in every form
    "test_architectures.py", "test_modernbert.py", "test_model_files.py",
    # fuzzing, installs and pytest run in a subprocess, the GPU
    "test_fuzz_loaders.py", "test_properties.py", "test_install.py", "test_ci_skips.py", "test_cuda.py",
    # export, compiled graphs, the numerics matrix, the native kernels and their operators
    "test_export.py", "test_compile.py", "test_numerics.py", "test_operators.py", "test_linear_attention.py",
    "test_kernels.py", "test_luna_native.py",
    "test_produced_rows.py", "test_token_products.py", "test_method_operators.py", "test_operator_references.py",
    "test_code_size.py", "test_piecewise.py",
})

# Single tests or parametrised cases in otherwise fast files (each takes a second or more).
SLOW_TESTS = (
    # every architecture x every method (one tiny BERT stays fast: KEEP_FAST)
    "tests/test_convert.py::*[[]*]",
    "tests/test_serialization.py::test_round_trip_is_exact[[]*]",
    "tests/test_serialization.py::test_round_trip_of_unconverted_model[[]*]",
    # runs of the whole pipeline or the command line on a tiny model
    "tests/test_run_config.py::test_saved_config_json_keeps_its_layout_and_reads_back_unchanged",
    "tests/test_run_results.py::test_a_run_writes_its_record_once_and_it_reads_back_equal",
    "tests/test_results_view.py::test_a_pipeline_run_writes_its_card_and_curves_and_overwrite_replaces_them",
    "tests/test_results_view.py::test_report_command_html_option",
    "tests/test_results_view.py::test_html_report_is_self_contained_with_the_report_s_table",
    "tests/test_report.py::test_a_run_records_when_it_finished",
    "tests/test_own_data.py::test_regression_end_to_end",
    "tests/test_own_data.py::test_cli_pair_classification_end_to_end_and_errors",
    "tests/test_input_checks.py::test_max_steps_0_means_no_finetuning",
    "tests/test_input_checks.py::test_a_csv_in_another_encoding_names_the_line_and_encoding_reads_it",
    "tests/test_input_checks.py::test_above_the_decode_limit_a_bad_image_is_named_when_read_and_the_run_resumes",
    "tests/test_input_checks.py::test_skip_unreadable_images_leaves_them_out_and_says_how_many",
    "tests/test_input_checks.py::test_a_glue_tsv_in_latin1",
    "tests/test_input_checks.py::test_a_folder_saved_before_the_digest_loads_with_a_note",
    "tests/test_bad_input.py::test_real_cli_prints_exactly_one_line_and_debug_shows_the_traceback",
    "tests/test_bad_input.py::test_existing_run_folder_is_kept_unless_overwrite",
    "tests/test_embedding.py::test_a_cli_run_writes_the_headline_and_eval_reproduces_it[[]*]",
    "tests/test_embedding.py::test_a_run_trains_to_the_teachers_embeddings_and_saves_a_sentence_model",
    "tests/test_embedding.py::test_metric_chooses_within_what_the_data_gives_and_refuses_the_rest",
    "tests/test_embedding.py::test_the_saved_folder_loads_in_sentence_transformers_and_encodes_the_same",
    "tests/test_embedding.py::test_the_real_minilm_loads_as_sentence_transformers_encodes_it",
    "tests/test_embedding.py::test_the_pooled_embedding_ignores_padding_after_conversion",
    "tests/test_embedding.py::test_a_sentence_model_folder_runs_only_as_the_embedding_task",
    # the QA and NER tests on a teacher finetuned first (qa_setup, ner_setup)
    "tests/test_question_answering.py::test_logits_distillation_runs_on_start_and_end_rows",
    "tests/test_question_answering.py::test_answer_tokens_truncation_and_the_cls_label",
    "tests/test_question_answering.py::test_a_question_too_long_for_max_length_is_one_line",
    "tests/test_question_answering.py::test_task_loss_is_the_models_own_span_loss",
    "tests/test_question_answering.py::test_predict_pads_start_and_end_rows_of_batches_of_different_lengths",
    "tests/test_question_answering.py::test_qa_run_through_the_cli_and_eval_of_its_folder",
    "tests/test_question_answering.py::test_bad_data_fails_before_the_run_folder",
    "tests/test_token_classification.py::test_first_sub_token_gets_the_word_label",
    "tests/test_token_classification.py::test_truncation_is_counted_and_keeps_the_first_words",
    "tests/test_token_classification.py::test_every_word_is_scored_once_across_batches_of_different_lengths",
    "tests/test_token_classification.py::test_ner_run_saves_a_model_that_scores_the_same",
    "tests/test_token_classification.py::test_bad_data_fails_before_the_run_folder[[]*]",
    "tests/test_token_classification.py::test_mismatched_head_or_slow_tokenizer_is_refused",
    "tests/test_token_classification.py::test_cli_malformed_file_one_line_and_exit_2",
    "tests/test_attention_map.py::test_teacher_softmax_row_is_the_original_models_attention",
    "tests/test_attention_map.py::test_image_rows_match_the_formulas_and_png",
    "tests/test_attention_map.py::test_cli_writes_png_and_refuses_to_overwrite",
    "tests/test_attention_map.py::test_text_rows_match_the_formulas_and_png[[]*]",
    "tests/test_attention_map.py::test_compute_attention_map_takes_a_loaded_model_and_a_pil_image",
    "tests/test_method_options.py::test_a_run_validates_its_options_once_and_converts_with_that_object",
    "tests/test_gpu_check.py::test_low_precision_checks_pass_on_the_cpu",
    # the import graph in a fresh interpreter per module, a kernel method's whole model
    "tests/test_layout.py::test_every_module_imports_in_a_fresh_interpreter",
    "tests/test_layout.py::test_methods_details_lists_options_with_defaults",
    "tests/test_layout.py::test_converting_with_a_kernel_method_keeps_the_logits",
    # gradient checks in float64 and random-feature estimates over many samples
    "tests/test_classic_methods.py::test_gradcheck_through_the_layer[[]*]",
    "tests/test_sorting.py::test_gradcheck_float64[[]*]",
    "tests/test_sorting.py::test_native_*",
    "tests/test_flexformer_llops.py::test_flexformer_init_is_the_gaussian_rff_estimate_of_softmax[[]*]",
    "tests/test_flexformer_llops.py::test_output_gradients_and_padding_equal_the_explicit_kernel_attention[[]*]",
    "tests/test_flexformer_llops.py::test_gradcheck_including_the_method_parameters[[]*]",
    "tests/test_flexformer_llops.py::test_llops_init_sketches_the_exp_matching_polynomial",
    "tests/test_window_hybrid.py::test_fast_op_equals_reference_values_and_gradients[[]*]",
    "tests/test_lra_data.py::test_pathfinder_labels_agree_with_a_flood_fill[[]*]",
    "tests/test_lra_data.py::test_the_shared_cifar_folder_reads_as_ten_classes_of_1024_pixels",
    "tests/test_audit_adapters.py::test_dwc_grid_survives_copy_and_reload",
    "tests/test_audit_adapters.py::test_*vit_dwc_gets_the_grid_of_the_input[[]*]",
)

# Kept fast although a pattern in SLOW_TESTS matches: one tiny model's (BERT's) conversion and save + load.
KEEP_FAST = (
    "tests/test_convert.py::test_every_attention_replaced_and_weights_kept[[]*-hf-bert]",
    "tests/test_convert.py::test_converted_model_gives_finite_logits[[]*-hf-bert]",
    "tests/test_convert.py::test_bert_padding_invariance[[]*-eager-bert]",
    "tests/test_convert.py::test_distill_mode_reproduces_original_logits[[]luna-hf-bert]",
    "tests/test_convert.py::test_training_step_reaches_original_and_new_weights[[]hf-bert]",
    "tests/test_convert.py::test_output_attentions_still_runs[[]hf-bert]",
    "tests/test_convert.py::test_report_fields[[]*]",
    "tests/test_serialization.py::*[[]*hf-bert]",
)


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` belongs to the slow tier (the tables above)."""
    if any(fnmatchcase(nodeid, pattern) for pattern in KEEP_FAST):
        return False
    return Path(nodeid.split("::", 1)[0]).name in SLOW_FILES or any(fnmatchcase(nodeid, p) for p in SLOW_TESTS)


def function_id(nodeid: str) -> str:
    """A test's node id without its parameters: what tests/fast_tier.txt records."""
    return nodeid.split("[", 1)[0]


def recorded_fast_tier() -> set[str]:
    """The test functions tests/fast_tier.txt records as the fast tier's."""
    lines = FAST_TIER_RECORD.read_text().splitlines() if FAST_TIER_RECORD.is_file() else []
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def fast_tier_growth(fast_nodeids: list[str], record: set[str], budget: int) -> list[str]:
    """What makes a collection's fast tier outgrow the record: test functions not recorded, and more tests than
    ``budget``. Recorded functions that were not collected (a file gone, a run of a few files) are no problem."""
    problems = [f"{f} is in the fast tier but not in tests/fast_tier.txt: mark it slow (SLOW_TESTS in "
                "tests/conftest.py) or record it (pytest -m 'not slow' --collect-only -q --record-fast-tier)"
                for f in sorted({function_id(n) for n in fast_nodeids} - record)]
    if len(fast_nodeids) > budget:
        problems.append(f"the fast tier selects {len(fast_nodeids)} tests, over its budget of {budget} "
                        "(FAST_TIER_BUDGET): mark the slowest slow")
    return problems


FAST_ITEMS = pytest.StashKey[list]()


def pytest_ignore_collect(collection_path, config):
    """Under ``-m "not slow"`` a whole slow file is not even imported (its imports cost the fast tier seconds)."""
    if (config.getoption("markexpr", "") or "").strip() == "not slow" and collection_path.name in SLOW_FILES:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the guard sees the fast tier's part of the collection
def pytest_collection_modifyitems(config, items):
    """Mark what the tables call slow; keep the rest's node ids for the guard (and for --record-fast-tier)."""
    fast = []
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("slow") is None:
            fast.append(item.nodeid)
    config.stash[FAST_ITEMS] = fast
    if config.getoption("--record-fast-tier"):
        FAST_TIER_RECORD.write_text("# the fast tier's test functions (pytest -m 'not slow'), written by\n"
                                    "# pytest -m 'not slow' --collect-only -q --record-fast-tier\n"
                                    + "".join(f"{f}\n" for f in sorted({function_id(n) for n in fast})))
