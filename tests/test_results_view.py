"""What people look at: the run's model card and curves.png, the HTML report (in a real headless
Chromium where installed), and progress lines where output is not a terminal."""

from __future__ import annotations

import base64
import io
import json
import os
import shlex
import shutil
import subprocess
import types
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from luna_convert.metrics import recovered_pct
from luna_convert.run.model_card import MODEL_CARD_FILE, reproduce_command, write_model_card
from luna_convert.run.config import RunConfig
from luna_convert.run.plots import CURVES_FILE, loss_series, write_curves
from luna_convert.run.recipes import apply_overrides, load_recipe
from luna_convert.tools.report_html import write_html_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ fixtures
def fake_run(folder: Path, method: str, task: str, teacher: float, converted: float, model: str = "bert-base-uncased",
             distill: int = 4, finetune: int = 6) -> dict:
    """A finished run folder as the pipeline leaves it (results.json with its config, the step log),
    with made-up scores: what the views read, without training anything."""
    config = apply_overrides(load_recipe(None), {"model": model, "task": task, "method": method, "seed": 3,
                                                 "train.max_steps": finetune, "distill.steps": distill})
    folder.mkdir(parents=True)
    lines = [{"stage": "distill", "step": i, "loss": 1.0 / i} for i in range(1, distill + 1)]
    lines += [{"stage": "finetune", "step": i, "loss": 0.7 - 0.05 * i, "lr": 1e-5} for i in range(1, finetune + 1)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps({"time": 0.0, **x}) + "\n" for x in lines))
    results = {
        "recipe": None, "method": method, "task": task, "model": model, "headline_metric": "accuracy",
        "teacher_score": teacher, "converted_score": converted,
        "recovered_pct": recovered_pct(converted, teacher, "accuracy"),
        "teacher_metrics": {"accuracy": teacher, "f1": teacher - 0.01},
        "converted_metrics": {"accuracy": converted, "f1": converted - 0.02},
        "eval_examples": 872, "steps": {"distill": distill, "finetune": finetune}, "seed": 3,
        "conversion": {"method": method, "options": {"feature_dim": 16}, "params_added": 1234,
                       "modules": [{"name": "layer.0"}, {"name": "layer.1"}]},
        "config": config.to_dict(), "run_dir": str(folder),
    }
    (folder / "results.json").write_text(json.dumps(results))
    return results


@pytest.fixture
def runs(tmp_path):
    """Two methods x two tasks under one folder, each with its curves.png."""
    root = tmp_path / "outputs"
    made = []
    for i, (method, task, teacher, converted) in enumerate([("luna", "sst2", 0.92, 0.90), ("luna", "mrpc", 0.85, 0.80),
                                                            ("hedgehog", "sst2", 0.92, 0.88),
                                                            ("hedgehog", "mrpc", 0.85, 0.86)]):
        folder = root / f"run{i}-{method}-{task}"
        made.append(fake_run(folder, method, task, teacher, converted))
        write_curves(folder, folder / "train_log.jsonl")
    return root, made


def expected_table(results: list[dict]) -> list[list[str]]:
    """The report's table as results.json says it should read (computed here, not by report.py)."""
    tasks = sorted({r["task"] for r in results})
    methods = sorted({r["method"] for r in results})
    by = {(r["method"], r["task"]): r for r in results}
    rows = [["original"] + [f"{100 * next(r['teacher_score'] for r in results if r['task'] == t):.1f}" for t in tasks]
            + ["", ""]]
    for m in methods:
        cells = [m] + [f"{100 * by[m, t]['converted_score']:.1f} ({by[m, t]['recovered_pct']:.1f}%)" for t in tasks]
        ratio_of_means = 100 * sum(by[m, t]["converted_score"] for t in tasks) / sum(by[m, t]["teacher_score"]
                                                                                      for t in tasks)
        mean_of_ratios = sum(by[m, t]["recovered_pct"] for t in tasks) / len(tasks)
        rows.append(cells + [f"{ratio_of_means:.1f}", f"{mean_of_ratios:.1f}"])
    return rows


class TableAndImages(HTMLParser):
    """The cells of the page's results table, every <img> src and every attribute that points outside."""

    def __init__(self):
        super().__init__()
        self.rows, self.images, self.external, self._in_body, self._cell = [], [], [], False, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.external += [v for k, v in attrs.items() if k in ("src", "href") and v and not v.startswith("data:")]
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "tbody":
            self._in_body = True
        if self._in_body and tag == "tr":
            self.rows.append([])
        if self._in_body and tag == "td":
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False
        if tag == "td" and self._cell is not None:
            self.rows[-1].append(self._cell.strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def parse_page(text: str) -> TableAndImages:
    parser = TableAndImages()
    parser.feed(text)
    return parser


# ----------------------------------------------------------------- model card
def test_model_card_loads_with_huggingface_hub_and_carries_the_measured_results(tmp_path):
    from huggingface_hub import ModelCard

    results = fake_run(tmp_path / "run", "hedgehog", "sst2", teacher=0.92, converted=0.90)
    path = write_model_card(tmp_path / "run")
    assert path == tmp_path / "run" / MODEL_CARD_FILE
    card = ModelCard.load(path)
    data = card.data
    assert data.base_model == "bert-base-uncased"
    assert data.pipeline_tag == "text-classification" and data.library_name == "luna-convert"
    assert {"linear-attention", "hedgehog"} <= set(data.tags)
    assert set(data.metrics) == {"accuracy", "f1"}
    measured = {r.metric_type: r.metric_value for r in data.eval_results}
    assert measured == results["converted_metrics"]
    assert {r.dataset_type for r in data.eval_results} == {"nyu-mll/glue"}
    ours = data.to_dict()["luna_convert"]
    assert ours["method"] == "hedgehog" and ours["method_options"] == {"feature_dim": 16}
    assert (ours["teacher_score"], ours["converted_score"], ours["recovered_pct"]) == (
        results["teacher_score"], results["converted_score"], results["recovered_pct"])
    assert f"{results['recovered_pct']:.1f}% of the original recovered" in card.text
    assert reproduce_command(RunConfig.from_dict(results["config"])) in card.text
    assert ModelCard(path.read_text()).data.to_dict() == data.to_dict()  # the text parses as it loads


@pytest.mark.parametrize("model, base", [("timm:vit_small_patch16_224", "timm/vit_small_patch16_224"),
                                         ("builtin:digits-vit", None), ("/models/my-bert", None)])
def test_model_card_names_a_base_model_only_for_hub_models(tmp_path, model, base):
    from huggingface_hub import ModelCard

    fake_run(tmp_path / "run", "luna", "sst2", teacher=0.9, converted=0.9, model=model)
    data = ModelCard.load(write_model_card(tmp_path / "run")).data
    assert data.base_model == base


@pytest.mark.parametrize("recipe, overrides", [
    ("bert-base-sst2", {"method": "hedgehog", "train.lr": 1e-5, "method_options.dwc_kernel": 5,
                        "distill.steps": 7, "train.mixed_precision": "bf16", "data_dir": "/data/my glue/SST-2"}),
    (None, {"model": "/models/bert", "data_dir": "/data/reviews", "task": "text-classification",
            "columns.text": "review", "train.max_steps": 40, "train.augment": False, "eval_split": "dev"}),
])
def test_the_card_s_command_rebuilds_the_run_s_config(monkeypatch, recipe, overrides):
    """Parsed by the real command line, the card's command gives the same settings the run had."""
    import luna_convert.run.pipeline
    from luna_convert.cli import app

    config = apply_overrides(load_recipe(recipe), overrides)
    captured = {}
    monkeypatch.setattr(luna_convert.run.pipeline, "run_conversion",
                        lambda config, resume=None, console=None: captured.setdefault("config", config) and None)
    command = reproduce_command(config)
    words = shlex.split(command)
    assert words[0] == "luna-convert"
    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, result.output
    for key in set(RunConfig().to_dict()) - {"name", "description", "output_dir"}:
        assert getattr(captured["config"], key) == getattr(config, key), key


# ----------------------------------------------------------------- curves
def test_loss_series_is_the_logged_steps_per_stage(tmp_path):
    log = tmp_path / "train_log.jsonl"
    entries = [{"stage": "distill", "step": 1, "loss": 0.5}, {"stage": "distill", "step": 2, "loss": 0.25},
               {"stage": "finetune", "step": 1, "loss": 0.7, "lr": 1e-5}, {"event": "no loss here"},
               {"stage": "finetune", "step": 2, "loss": 0.6, "lr": 1e-5}]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"stage": "finetune", "st')  # a torn last line
    assert loss_series(log) == {"distill": ([1, 2], [0.5, 0.25]), "finetune": ([1, 2], [0.7, 0.6])}


def test_curves_png_is_a_real_picture_written_whole(tmp_path):
    from PIL import Image

    fake_run(tmp_path / "run", "hedgehog", "sst2", teacher=0.92, converted=0.90)
    path = write_curves(tmp_path / "run", tmp_path / "run" / "train_log.jsonl")
    assert path == tmp_path / "run" / CURVES_FILE
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = Image.open(path).convert("RGB")
    assert image.width > 600 and len(image.getcolors(maxcolors=1 << 20)) > 10  # two panels of lines and text, not a blank
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_no_curves_without_logged_steps(tmp_path):
    (tmp_path / "train_log.jsonl").write_text("")
    assert write_curves(tmp_path, tmp_path / "train_log.jsonl") is None
    assert not (tmp_path / CURVES_FILE).exists()


def test_a_pipeline_run_writes_its_card_and_curves_and_overwrite_replaces_them(tmp_path):
    from huggingface_hub import ModelCard
    from builders import config_for, write_bert_checkpoint, write_sst2

    from luna_convert.run.pipeline import run_conversion

    model_dir, data_dir = write_bert_checkpoint(tmp_path / "bert"), write_sst2(tmp_path / "SST-2")
    config = replace(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "out"), run_dir=str(tmp_path / "r"))
    for overwrite in (False, True):  # the second run replaces the first, README.md and curves.png included
        results = run_conversion(replace(config, overwrite=overwrite))
    run_dir = Path(results["run_dir"])
    on_disk = json.loads((run_dir / "results.json").read_text())
    ours = ModelCard.load(run_dir / MODEL_CARD_FILE).data.to_dict()["luna_convert"]
    assert ours["converted_score"] == on_disk["converted_score"] and ours["method"] == "hedgehog"
    assert (run_dir / CURVES_FILE).read_bytes()[:8] == PNG_SIGNATURE
    assert set(loss_series(run_dir / "train_log.jsonl")) == {"distill", "finetune"}


# ----------------------------------------------------------------- HTML report
def write_bench(folder: Path) -> bytes:
    from PIL import Image

    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps({"meta": {"device": "cpu", "threads": 2}, "layers": []}))
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(buffer, format="PNG")
    (folder / "bench.png").write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_html_report_is_self_contained_with_the_report_s_table(runs, tmp_path):
    root, made = runs
    bench_png = write_bench(tmp_path / "bench-1")
    page = write_html_report([root, tmp_path / "bench-1"], tmp_path / "report.html")
    parsed = parse_page(page.read_text())
    assert parsed.rows == expected_table(made)
    assert parsed.external == []  # nothing to fetch when viewed
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in parsed.images]
    curves = [(Path(r["run_dir"]) / CURVES_FILE).read_bytes() for r in made]
    assert embedded == curves + [bench_png]
    text = page.read_text()
    for r in made:  # one bar per (method, task), at its % recovered
        assert f'data-method="{r["method"]}" data-task="{r["task"]}" data-value="{r["recovered_pct"]:.1f}"' in text


def test_report_command_html_option(runs, tmp_path):
    from luna_convert.cli import app

    root, made = runs
    out = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["report", str(root), "-o", str(tmp_path / "rep"), "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert parse_page(out.read_text()).rows == expected_table(made)
    refused = CliRunner().invoke(app, ["report", str(root), "-o", str(tmp_path / "rep2"), "--html", str(tmp_path)])
    assert refused.exit_code == 2 and "is a folder" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "rep2").exists()  # nothing half-written


CHROMIUM = shutil.which("chromium")
# CI sets this after installing chromium: there the browser test must run, not skip.
REQUIRE_CHROMIUM = bool(os.environ.get("LUNA_REQUIRE_CHROMIUM"))


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    return subprocess.run([CHROMIUM, *flags, *args, page.resolve().as_uri()], capture_output=True, text=True,
                          timeout=120, check=True)


@pytest.mark.skipif(CHROMIUM is None and not REQUIRE_CHROMIUM, reason="needs Debian's chromium for the "
                    "headless-browser test (apt-get install -y chromium)")
def test_html_report_renders_in_headless_chromium(runs, tmp_path):
    from PIL import Image

    assert CHROMIUM is not None, "LUNA_REQUIRE_CHROMIUM is set but chromium is not on PATH (apt-get install -y chromium)"
    root, made = runs
    write_bench(tmp_path / "bench-1")
    page = write_html_report([root, tmp_path / "bench-1"], tmp_path / "report.html")
    dom = chromium(page, tmp_path / "profile", "--dump-dom").stdout
    rendered = parse_page(dom)
    assert rendered.rows == expected_table(made)  # the table as the browser built it
    shot = tmp_path / "shot.png"
    chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,2000")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2000)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # text, bars and embedded plots; a blank page is one colour
    bar_blue = (0x1F, 0x77, 0xB4)  # the first method's bar colour in the SVG chart
    assert any(c == bar_blue for _, c in colours)


# ----------------------------------------------------------------- progress
def test_progress_prints_plain_lines_where_output_is_not_a_terminal():
    from luna_convert.engine.training import progress_bar

    stream = io.StringIO()  # not a tty
    now = [0.0]
    bar, task = progress_bar(types.SimpleNamespace(is_main_process=True), "finetune", 10, file=stream, every=5.0)
    bar.clock = lambda: now[0]
    with bar:
        for step in range(1, 11):
            now[0] += 2.0  # 2 s a step: a line every third step (>= 5 s since the last), and one at the end
            bar.update(task, advance=1, info=f"loss {1 / step:.4f}")
    lines = stream.getvalue().splitlines()
    assert lines == ["finetune 3/10 loss 0.3333 elapsed 0:00:06 eta 0:00:14",
                     "finetune 6/10 loss 0.1667 elapsed 0:00:12 eta 0:00:08",
                     "finetune 9/10 loss 0.1111 elapsed 0:00:18 eta 0:00:02",
                     "finetune 10/10 loss 0.1000 elapsed 0:00:20 eta 0:00:00"]


def test_progress_of_a_resumed_stage_counts_speed_from_the_resume_point():
    from luna_convert.engine.training import progress_bar

    stream, now = io.StringIO(), [100.0]
    bar, task = progress_bar(types.SimpleNamespace(is_main_process=True), "finetune", 100, file=stream, every=0)
    bar.clock = lambda: now[0]
    bar.update(task, completed=50)  # resumed at step 50: not progress made now
    with bar:
        now[0] += 10.0
        bar.update(task, advance=10)
    assert stream.getvalue().splitlines()[0] == "finetune 60/100 elapsed 0:00:10 eta 0:00:40"


def test_evaluation_through_the_one_progress_helper_prints_to_a_non_terminal(capsys):
    """predict (evaluation, teacher scoring) uses progress_bar: under a captured (non-tty) stderr it prints a
    line there, and nothing on stdout, which carries results alone."""
    import torch
    from accelerate import Accelerator

    from luna_convert.engine.training import predict

    class Tiny(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids.float()

    batches = [{"input_ids": torch.ones(2, 3), "labels": torch.zeros(2, dtype=torch.long)} for _ in range(3)]
    predict(Accelerator(cpu=True), Tiny(), batches, "eval validation")
    captured = capsys.readouterr()
    assert any(line.startswith("eval validation 3/3 ") and "eta 0:00:00" in line
               for line in captured.err.splitlines())
    assert captured.out == ""


def test_other_processes_print_nothing():
    from luna_convert.engine.training import progress_bar

    stream = io.StringIO()
    bar, task = progress_bar(types.SimpleNamespace(is_main_process=False), "distil", 3, file=stream, every=0)
    with bar:
        for _ in range(3):
            bar.update(task, advance=1, info="loss 0.1")
    assert stream.getvalue() == ""
