"""``luna-convert report``: runs gathered into a methods x tasks table of % recovered."""

from __future__ import annotations

import json

import pytest

from luna_convert.report import build_report


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
