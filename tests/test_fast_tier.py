"""The fast tier (``pytest -m "not slow"``) cannot grow by accident: every test it selects is recorded in
tests/fast_tier.txt, and it selects at most FAST_TIER_BUDGET tests (tests/conftest.py)."""

from __future__ import annotations

import pytest

from conftest import FAST_ITEMS, FAST_TIER_BUDGET, fast_tier_growth, function_id, is_slow, recorded_fast_tier


def test_the_fast_tier_selects_only_recorded_tests_within_its_budget(request):
    fast = request.config.stash[FAST_ITEMS]
    assert request.node.nodeid in fast  # this guard is itself in the fast tier
    problems = fast_tier_growth(fast, recorded_fast_tier(), FAST_TIER_BUDGET)
    assert not problems, "\n".join(problems)


def test_the_guard_fails_when_the_fast_tier_grows():
    record = {"tests/test_a.py::test_one", "tests/test_a.py::test_two"}
    assert not fast_tier_growth(["tests/test_a.py::test_one[x]", "tests/test_a.py::test_one[y]"], record, 2)
    assert not fast_tier_growth(["tests/test_a.py::test_one"], record | {"tests/test_gone.py::test_old"}, 2)
    new = fast_tier_growth(["tests/test_a.py::test_one", "tests/test_b.py::test_new"], record, 5)
    assert len(new) == 1 and "tests/test_b.py::test_new is in the fast tier" in new[0]
    over = fast_tier_growth(["tests/test_a.py::test_one[x]", "tests/test_a.py::test_one[y]",
                             "tests/test_a.py::test_two"], record, 2)
    assert over == ["the fast tier selects 3 tests, over its budget of 2 (FAST_TIER_BUDGET): mark the slowest slow"]


def test_the_tables_mark_whole_pipelines_slow_and_keep_one_tiny_models_conversion_fast():
    assert is_slow("tests/test_resume.py::test_killed_during_finetune_resumes_to_identical_result")
    assert is_slow("tests/test_pipeline.py::test_cli_run_and_report")
    assert is_slow("tests/test_convert.py::test_every_attention_replaced_and_weights_kept[luna-timm-vit]")
    assert not is_slow("tests/test_convert.py::test_every_attention_replaced_and_weights_kept[luna-hf-bert]")
    assert not is_slow("tests/test_feature_map_formulas.py::test_feature_map_equals_its_formula[luna]")
    assert not is_slow("tests/test_docs.py::test_readme_is_short_and_keeps_the_test_command_and_the_links")
    assert function_id("tests/test_a.py::test_one[x-y]") == "tests/test_a.py::test_one"


@pytest.mark.slow
def test_a_test_marked_slow_in_its_file_stays_out_of_the_fast_tier(request):
    assert request.node.nodeid not in request.config.stash[FAST_ITEMS]
