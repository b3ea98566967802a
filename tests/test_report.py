"""``luna-convert report``: runs gathered into a methods x tasks table of % recovered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luna_convert.tools.report import build_report


def write_run(folder, **fields):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"run_dir": str(folder), **fields}))


def test_report_keeps_error_metrics_out_of_the_ratio_of_means(tmp_path):
    runs = [("sst2", "accuracy", 0.90, 0.80, 100 * 0.8 / 0.9), ("my-regression", "mse", 0.20, 0.25, 80.0)]
    for i, (task, metric, teacher, converted, pct) in enumerate(runs):
        write_run(tmp_path / f"run{i}", method="luna", task=task, headline_metric=metric, teacher_score=teacher,
                  converted_score=converted, recovered_pct=pct)
    (row,) = build_report([tmp_path])["rows"]
    assert row["ratio_of_means_pct"] == pytest.approx(100 * 0.8 / 0.9)
    assert row["mean_of_ratios_pct"] == pytest.approx((100 * 0.8 / 0.9 + 80.0) / 2)


def test_report_gives_each_own_data_set_its_own_column(tmp_path):
    for i, data in enumerate(["reviews", "tickets", "reviews"]):
        write_run(tmp_path / f"run{i}", method="luna", task="text-classification", headline_metric="accuracy",
                  teacher_score=0.9, converted_score=0.8 + i / 100, recovered_pct=100 * (0.8 + i / 100) / 0.9,
                  config={"data_dir": f"/data/{data}/"})
    rep = build_report([tmp_path])
    assert rep["tasks"] == ["reviews (text-classification)", "tickets (text-classification)"]
    assert rep["rows"][0]["tasks"]["reviews (text-classification)"]["converted"] == pytest.approx(0.82)  # latest run


def _runs_for_one_cell(tmp_path, named_and_finished):
    """Runs of one (method, task) cell: folder name -> finish time (None: an old run, no finished_at)."""
    for i, (name, finished) in enumerate(named_and_finished):
        extra = {} if finished is None else {"finished_at": finished}
        write_run(tmp_path / name, method="luna", task="sst2", headline_metric="accuracy", teacher_score=0.9,
                  converted_score=0.80 + i / 100, recovered_pct=100 * (0.80 + i / 100) / 0.9, **extra)
    return build_report([tmp_path])["rows"][0]["tasks"]["sst2"]["converted"]


def test_report_latest_run_is_the_last_finished_not_the_last_name(tmp_path):
    # A newer run whose folder name sorts first (another model's recipe name) still wins.
    converted = _runs_for_one_cell(tmp_path, [("distilbert-sst2-luna-20240101-120000", "2024-01-01T13:00:00+00:00"),
                                              ("bert-base-sst2-luna-20250101-120000", "2025-01-01T13:00:00+00:00")])
    assert converted == pytest.approx(0.81)


def test_report_latest_run_orders_numbered_folders_by_time(tmp_path):
    # Two runs started in the same second: "-10" (finished later) sorts before "-2" by name.
    converted = _runs_for_one_cell(tmp_path, [("sst2-luna-20250101-120000-2", "2025-01-01T12:05:00+01:00"),
                                              ("sst2-luna-20250101-120000-10", "2025-01-01T11:06:00+00:00")])
    assert converted == pytest.approx(0.81)


def test_report_old_runs_without_finish_time_use_the_results_file_time(tmp_path):
    import os

    runs = [("z-old", None), ("a-new", None)]
    _runs_for_one_cell(tmp_path, runs)
    os.utime(tmp_path / "z-old" / "results.json", (1_700_000_000, 1_700_000_000))
    os.utime(tmp_path / "a-new" / "results.json", (1_800_000_000, 1_800_000_000))
    assert build_report([tmp_path])["rows"][0]["tasks"]["sst2"]["converted"] == pytest.approx(0.81)


def test_report_refuses_an_unreadable_finish_time(tmp_path):
    from luna_convert.errors import LunaConvertError

    with pytest.raises(LunaConvertError, match="finished_at"):
        _runs_for_one_cell(tmp_path, [("run", "yesterday")])


def test_report_refuses_an_unreadable_results_file(tmp_path):
    from luna_convert.errors import LunaConvertError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"method": "luna", ')  # cut short
    with pytest.raises(LunaConvertError, match="cannot read .*results.json"):
        build_report([tmp_path])


def test_a_run_records_when_it_finished(tmp_path):
    from datetime import datetime

    from luna_convert.run.pipeline import run_conversion
    from builders import config_for, write_bert_checkpoint, write_sst2

    config = config_for(write_bert_checkpoint(tmp_path / "bert"), write_sst2(tmp_path / "SST-2"), "sst2", "t2r",
                        tmp_path / "out", max_steps=1)
    before = datetime.now().astimezone()
    results = run_conversion(config)
    after = datetime.now().astimezone()
    saved = json.loads((tmp_path / "out" / Path(results["run_dir"]).name / "results.json").read_text())
    assert before <= datetime.fromisoformat(saved["finished_at"]) <= after
