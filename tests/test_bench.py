"""Smoke test of the benchmark: a quick run writes the JSON and the PNG with the expected contents."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from rich.console import Console

from luna_convert.tools.bench import run_benchmark


def _bench_targets():
    """benchmarks/bench_targets.py, the targets checked on a bench run (a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_targets.py"
    spec = importlib.util.spec_from_file_location("bench_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_benchmark_writes_json_and_png(tmp_path):
    console = Console(file=io.StringIO(), width=140)
    results = run_benchmark(tmp_path, lengths=(32, 64), methods=("luna", "t2r"), quick=True, console=console)

    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data) >= {"meta", "layers", "models"} and "targets" not in data  # targets: benchmarks/bench_targets.py
    assert data["layers"]["config"]["methods"] == ["softmax", "softmax-eager", "luna", "t2r"]
    rows = data["layers"]["results"]
    assert {(r["method"], r["n"]) for r in rows} == {(m, n) for m in ("softmax", "softmax-eager", "luna", "t2r") for n in (32, 64)}
    ops = {(r["method"], r["n"]): r["fwd_ops"] for r in rows}
    for m in ("luna", "t2r"):  # counted per forward; the same at every length
        assert isinstance(ops[(m, 32)], int) and ops[(m, 32)] >= 5 and ops[(m, 32)] == ops[(m, 64)]  # t2r 10
    views = {(r["method"], r["n"]): r["fwd_view_ops"] for r in rows}
    for key in views:  # the core's reshapes and transposes are views; its products and division are not
        assert 0 < views[key] < ops[key] or key[0].startswith("softmax"), (key, views[key], ops[key])
    for r in rows:
        assert _positive(r["fwd_ms"]) and _positive(r["fwd_bwd_ms"]), r
        assert _positive(r["fwd_bwd_peak_mb"]), r
        assert r["fwd_peak_mb"] >= 0
        if r["method"] != "softmax":
            assert _positive(r["fwd_speedup_vs_softmax"]) and _positive(r["fwd_bwd_speedup_vs_softmax"])
    assert set(data["layers"]["slopes"]) == {"softmax", "softmax-eager", "luna", "t2r"}
    for s in data["layers"]["slopes"].values():
        assert math.isfinite(s["fwd"]) and math.isfinite(s["fwd_bwd"])

    models = data["models"]
    assert models["method"] == "luna"
    assert len(models["vit"]) == 2 and len(models["bert"]) == 2
    for r in [*models["vit"], *models["bert"], models["bert_train"]]:
        assert _positive(r["original_ms"]) and _positive(r["converted_ms"]) and _positive(r["ratio"])
    targets = _bench_targets().evaluate(data)
    assert targets and all({"target", "value", "threshold", "met"} <= set(t) for t in targets)
    assert "| target | measured | needed | met |" in _bench_targets().markdown(targets)

    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 1_000 < png.stat().st_size < 300_000
    assert results["layers"]["results"][0]["fwd_ms"] == rows[0]["fwd_ms"]
    assert "Attention layer forward time" in console.file.getvalue()
    assert "| N |" in (tmp_path / "bench.md").read_text()
    assert "aten operator calls per forward" in (tmp_path / "bench.md").read_text()


def test_cpu_timer_layers_only(tmp_path):
    import torch

    threads = torch.get_num_threads()
    console = Console(file=io.StringIO(), width=140)
    results = run_benchmark(tmp_path, lengths=(16, 32), methods=["t2r"], models=False, quick=True, timer="cpu",
                            memory=False, device="cpu", console=console)
    assert torch.get_num_threads() == threads  # restored
    assert results["meta"]["timer"] == "thread CPU time" and results["meta"]["threads"] == 1
    assert results["models"] is None
    assert all(_positive(r["fwd_ms"]) and "fwd_peak_mb" not in r for r in results["layers"]["results"])
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.png").exists()


def test_bench_cli_options(tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    out = tmp_path / "b"
    result = CliRunner().invoke(app, ["bench", "--output-dir", str(out), "--quick", "--no-models", "--lengths", "16,32",
                                      "--methods", "t2r,luna:dwc=true,hedgehog:window=4", "--repeats", "2",
                                      "--timer", "cpu"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["timer"] == "thread CPU time" and data["meta"]["threads"] == 1
    assert {r["method"] for r in data["layers"]["results"]} == {"softmax", "softmax-eager", "t2r", "luna:dwc=true",
                                                                "hedgehog:window=4"}
    assert all(len(r["fwd_runs_ms"]) == 2 for r in data["layers"]["results"])


def test_bench_cli_bad_input_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    cases = [(["--methods", "lunaa"], "unknown method 'lunaa'. Did you mean luna"),
             (["--methods", "hedgehog:windo=4"], "unknown option"),
             (["--methods", "sorting:window=4"], "window must be 0 for 'sorting'"),
             (["--methods", "hedgehog:window"], "give options as METHOD:NAME=VALUE"),
             (["--timer", "gpu"], "timer must be 'wall' or 'cpu'"),
             (["--timer", "cpu", "--threads", "2"], "use --threads 1"),
             (["--lengths", "1k"], "comma-separated integers")]
    for args, message in cases:
        out = tmp_path / "never"
        result = CliRunner().invoke(app, ["bench", "--output-dir", str(out), "--quick", "--no-models", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
        assert not out.exists()


def test_background_load_runs_during_the_busy_timing_and_stops(tmp_path):
    import multiprocessing

    from typer.testing import CliRunner

    from luna_convert.cli import app

    out = tmp_path / "busy"
    result = CliRunner().invoke(app, ["bench", "--output-dir", str(out), "--quick", "--no-models", "--lengths", "16",
                                      "--methods", "t2r", "--background-load", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    busy = data["layers_busy"]
    assert busy["background"]["processes"] == 1 and busy["background"]["matmuls"] > 0  # the worker really ran
    assert {(r["method"], r["n"]) for r in busy["results"]} == {(r["method"], r["n"]) for r in data["layers"]["results"]}
    assert all(_positive(r["fwd_ms"]) and _positive(r["fwd_bwd_ms"]) for r in busy["results"])
    assert "background process(es)" in (out / "bench.md").read_text()
    assert multiprocessing.active_children() == []  # stopped and joined


def test_background_load_refuses_a_negative_count(tmp_path):
    import pytest

    from luna_convert.errors import LunaConvertError

    with pytest.raises(LunaConvertError, match="background_load must be 0 or a number of processes"):
        run_benchmark(tmp_path / "x", lengths=(16,), methods=["t2r"], models=False, quick=True, background_load=-1)
    assert not (tmp_path / "x").exists()


def test_bf16_layers_are_timed_in_bf16(tmp_path, monkeypatch):
    import pytest
    import torch

    from luna_convert.errors import LunaConvertError
    from luna_convert.tools.bench import layers as bench_module

    seen = []
    build = bench_module.layer_modules

    def spied(*args, **kwargs):  # the bench's own layers, with a hook recording what dtypes they see
        layers, modules = build(*args, **kwargs)
        for module in modules.values():
            module.register_forward_hook(lambda _m, inputs, out: seen.append((inputs[0].dtype, out.dtype)))
        return layers, modules

    monkeypatch.setattr(bench_module, "layer_modules", spied)
    results = run_benchmark(tmp_path, lengths=(16,), methods=["t2r"], models=False, quick=True, memory=False,
                            dtype="bf16", device="cpu", console=Console(file=io.StringIO()))
    assert results["layers"]["config"]["dtype"] == "bf16"
    assert all(_positive(r["fwd_ms"]) and _positive(r["fwd_bwd_ms"]) for r in results["layers"]["results"])
    # bf16 inputs, and under autocast bf16 outputs (the sums inside accumulate in float32)
    assert seen and all(x == (torch.bfloat16, torch.bfloat16) for x in seen)
    with pytest.raises(LunaConvertError, match="unknown dtype 'fp8'"):
        run_benchmark(tmp_path / "never", lengths=(16,), methods=["t2r"], models=False, dtype="fp8")
    assert not (tmp_path / "never").exists()


def test_long_model_rows_compare_three_variants_with_the_same_weights(tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    out = tmp_path / "long"
    result = CliRunner().invoke(app, ["bench", "--output-dir", str(out), "--quick", "--no-models", "--lengths", "16",
                                      "--methods", "t2r", "--long-models", "--long-lengths", "32,64"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    long = data["long_models"]
    assert long["method"] == "luna" and [r["tokens"] for r in long["rows"]] == [32, 64]
    for r in long["rows"]:
        assert set(r) >= {"original", "converted global", "converted all"}
        for variant in ("original", "converted global", "converted all"):
            x = r[variant]
            assert _positive(x["fwd_ms"]) and _positive(x["train_ms"]) and _positive(x["train_peak_mb"])
            assert x["fwd_ms_ratio"] == (1.0 if variant == "original" else x["fwd_ms"] / r["original"]["fwd_ms"])
    assert "ModernBERT (tiny)" in (out / "bench.md").read_text() and "ModernBERT (tiny)" in result.output
    assert [r["image_size"] for r in long["dinov2"]] == [28, 56, 84]  # 56 px native; 28 and 84 interpolate
    assert all(_positive(r["original_ms"]) and _positive(r["converted_ms"]) for r in long["dinov2"])
    assert "DINOv2 (tiny) inference" in (out / "bench.md").read_text()
    assert any("log-log slope of train-step peak memory" in t["target"] for t in _bench_targets().evaluate(data))


def test_long_model_training_step_that_would_not_fit_is_skipped_and_said(tmp_path, monkeypatch):
    from luna_convert.tools.bench import long_models as bench

    # The first length measures its step (no estimate yet); the next one's extrapolated peak exceeds what is
    # "free", so every variant skips it instead of training into an out-of-memory kill.
    monkeypatch.setattr(bench, "_available_memory_bytes", lambda device: 1)
    results = run_benchmark(tmp_path / "long", lengths=(16,), methods=["t2r"], models=False, quick=True,
                            long_models=True, long_lengths=(32, 64), device="cpu", console=Console(file=io.StringIO()))
    first, second = results["long_models"]["rows"]
    for variant in ("original", "converted global", "converted all"):
        assert _positive(first[variant]["train_ms"]) and _positive(first[variant]["train_peak_mb"])
        assert "train_ms" not in second[variant] and "GiB free" in second[variant]["train_skipped"]
        assert _positive(second[variant]["fwd_ms"])
    assert second["converted all"]["fwd_ms_ratio"] == second["converted all"]["fwd_ms"] / second["original"]["fwd_ms"]
    md = (tmp_path / "long" / "bench.md").read_text()
    assert "Training steps skipped" in md and "64 tokens, converted all: needs about" in md
    # one measured length: no slope
    assert not any("peak memory" in t["target"] for t in _bench_targets().evaluate(results))
