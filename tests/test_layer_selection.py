"""``--keep-softmax-layers auto`` (tools/layer_selection.py): the held-out part of the training data, the greedy
search and its full-run check (with a stand-in for the runs), a real search end to end on a tiny BERT and a tiny
timm ViT, resuming, and the one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from luna_convert.folder_layout import CONFIG_FILE, RESULTS_FILE, SELECTION_DIR, SELECTION_FILE, SELECTION_TABLE
from luna_convert.run.config import RunConfig
from luna_convert.run.models import load_model
from luna_convert.run.results import ConversionSummary, RunResults
from luna_convert.run.task_data import HOLDOUT_SPLIT, TaskData
from luna_convert.tasks import get_task
from luna_convert.tools import layer_selection
from luna_convert.tools.layer_selection import Selection, restored_layer_scores
from luna_convert.run.pipeline import evaluate_model
from builders import (cli_error_line, config_for, invoke_cli, write_bert_checkpoint, write_image_folder, write_sst2,
                      write_timm_checkpoint)


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


# ------------------------------------------------------------------ the held-out part
def test_a_candidate_trains_on_the_training_data_less_a_seeded_part_and_scores_on_that_part(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    config = config_for(model_dir, data_dir, "sst2", "elu", tmp_path)
    loaded = load_model(str(model_dir), 2)
    plain = TaskData(config, loaded, get_task("sst2"))
    train, _ = plain.split("train", None, False, 8)
    config.selection = {"role": "candidate", "holdout": 0.25}
    data = TaskData(config, loaded, get_task("sst2"))
    assert list(data.eval_loaders()) == [HOLDOUT_SPLIT]  # never the dev split the run reports
    fit, _ = data.split("train", None, False, 8)
    held, _ = data.split(HOLDOUT_SPLIT, None, False, 8)
    assert (len(fit), len(held)) == (36, 12) and len(train) == 48
    rows = lambda ds: [(s, y) for s, y in zip(ds["sentence"], ds["label"])]
    assert sorted(rows(fit) + rows(held)) == sorted(rows(train))  # the two parts are the training split
    again = TaskData(config, loaded, get_task("sst2")).split(HOLDOUT_SPLIT, None, False, 8)[0]
    assert rows(again) == rows(held)  # seeded: a resumed search scores the same examples
    config.seed += 1
    assert rows(TaskData(config, loaded, get_task("sst2")).split(HOLDOUT_SPLIT, None, False, 8)[0]) != rows(held)


# ------------------------------------------------------------------ the search, runs stood in for
class FakeRuns:
    """Runs that score a set of kept layers from a table, writing results.json (and the final run's config)
    as a real run does; ``calls`` lists what ran."""

    def __init__(self, held_out: dict, full: dict, layers: int = 4):
        self.held_out, self.full, self.layers, self.calls = held_out, full, layers, []

    def __call__(self, cfg: RunConfig | None, resume):
        assert resume is None
        run_dir = Path(cfg.run_dir)
        control = cfg.method == "softmax"
        kept = tuple(cfg.keep_softmax_layers)
        held = (cfg.selection or {}).get("role") == "candidate"
        score = (self.held_out if held else self.full)["control" if control else kept]
        self.calls.append(("control" if control else kept, "held-out" if held else "full"))
        conversion = None if control else ConversionSummary(
            method=cfg.method, modules=[{"name": f"layer.{i}"} for i in range(self.layers) if i not in kept],
            kept_softmax=[f"layer.{i}" for i in kept])
        results = RunResults(method=cfg.method, task="sst2", headline_metric="accuracy", teacher_score=0.8,
                             converted_score=score, run_dir=str(run_dir), conversion=conversion, config=cfg.to_dict())
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
        results.write(run_dir / RESULTS_FILE)
        return results


HELD_OUT = {"control": 0.80, (): 0.60, (2,): 0.75, (0, 2): 0.795, (0, 2, 3): 0.80}
FULL = {"control": 0.80, (0, 2): 0.78, (0, 2, 3): 0.80}
RESTORED = {0: 0.65, 1: 0.61, 2: 0.70, 3: 0.62}  # the all-linear model's held-out score, one layer softmax


def _selection(tmp_path, runs, target=99.0):
    config = RunConfig(model="m", task="sst2", method="elu", keep_softmax_layers="auto", run_dir=str(tmp_path))
    config.layer_selection.target_pct = target
    lines = []
    return Selection(config, tmp_path, lambda *a, **k: lines.append(" ".join(map(str, a))), runs), lines


def test_the_search_grows_the_kept_set_in_rank_order_and_the_full_run_adds_a_layer_when_it_misses(tmp_path,
                                                                                                   monkeypatch):
    scored = []

    def restored(run_dir, max_examples=None, inspect=None):
        scored.append(Path(run_dir).name)
        assert inspect is restored_layer_scores
        return {"inspected": RESTORED}

    monkeypatch.setattr(layer_selection, "evaluate_model", restored)
    runs = FakeRuns(HELD_OUT, FULL)
    selection, lines = _selection(tmp_path, runs)
    record = selection.search()
    assert [row["kept"] for row in record["frontier"]] == [[], [2], [0, 2]]  # stops at the first >= 99 %
    assert record["chosen"] == [0, 2] and record["reached_on_held_out"]
    assert [round(row["pct_of_control"], 2) for row in record["frontier"]] == [75.0, 93.75, 99.38]
    assert all(where == "held-out" for _, where in runs.calls)
    assert [r["layer"] for r in record["ranking"]] == [2, 0, 3, 1] and scored == ["keep-none"]
    assert "up to L + 1 (L: the model's attention layers) candidate runs" in lines[0]  # the cost, before any run
    assert any("4 attention layers, 4 converted: at most 3 more candidate runs" in line for line in lines)
    assert any("the original model scores 0.8000 on the held-out part" in line for line in lines)
    results = selection.verify(record["chosen"])
    assert runs.calls[-3:] == [("control", "full"), ((0, 2), "full"), ((0, 2, 3), "full")]
    assert any("below the target on the reported split" in line and "adding layer 3" in line for line in lines)
    assert selection.record["chosen"] == [0, 2, 3] and selection.record["verified"]
    assert results.converted_score == 0.80 and [a["kept"] for a in selection.record["attempts"]] == [[0, 2], [0, 2, 3]]
    table = (tmp_path / SELECTION_TABLE).read_text()
    assert "| [0, 2] | 0.7950 | 99.4 % |" in table and "reaches the target" in table
    # Run again on the same folder: every finished run is read back, nothing runs.
    again = FakeRuns(HELD_OUT, FULL)
    selection, lines = _selection(tmp_path, again)
    selection.search()
    selection.verify(selection.record["chosen"])
    assert again.calls == [] and selection.record["chosen"] == [0, 2, 3] and scored == ["keep-none"]


def test_a_search_that_reaches_the_target_with_every_layer_linear_keeps_none(tmp_path):
    runs = FakeRuns({"control": 0.8, (): 0.8}, {"control": 0.8, (): 0.8})
    selection, _ = _selection(tmp_path, runs, target=99.0)
    record = selection.search()
    assert record["chosen"] == [] and [row["kept"] for row in record["frontier"]] == [[]] and "ranking" not in record
    selection.verify([])
    assert selection.record["verified"] and runs.calls == [("control", "held-out"), ((), "held-out"),
                                                            ("control", "full"), ((), "full")]


# ------------------------------------------------------------------ real runs
def _auto_run(model, data, run_dir, *extra, steps=2):
    return invoke_cli("run", "--model", model, "--data-dir", data, "--method", "elu", "--max-steps", steps,
                      "--batch-size", "8", "--run-dir", run_dir, "--keep-softmax-layers", "auto",
                      "--set", "train.score_stages=false",
                      "--set", "layer_selection.holdout=0.25", "--set", "layer_selection.time_lengths=[96]", *extra)


def test_a_real_search_chooses_verifies_records_and_resumes(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    run_dir = tmp_path / "run"
    result = _auto_run(model_dir, data_dir, run_dir, "--task", "sst2", "--target-pct", "100")
    assert result.exit_code == 0, result.output[-3000:]
    assert "layer selection, target 100 % of the softmax control" in result.output
    record = json.loads((run_dir / SELECTION_FILE).read_text())
    results = json.loads((run_dir / RESULTS_FILE).read_text())
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    chosen = record["chosen"]
    assert results["layer_selection"]["chosen"] == chosen == saved["keep_softmax_layers"]
    assert results["layer_selection"]["target_pct"] == 100.0 and saved["selection"]["role"] == "final"
    assert results["conversion"]["kept_softmax"] == [f"bert.encoder.layer.{i}.attention.self" for i in chosen]
    control = RunResults.read(run_dir / SELECTION_DIR / "softmax" / RESULTS_FILE)
    assert control.eval_examples == 12 and record["control_score"] == control.converted_score  # the held-out part
    full_control = RunResults.read(run_dir / SELECTION_DIR / "softmax-full" / RESULTS_FILE)
    assert full_control.eval_examples == 20 and results["eval_examples"] == 20  # the dev split
    for row in record["frontier"]:
        assert row["pct_of_control"] == pytest.approx(100 * row["score"] / record["control_score"])
    tokens = [t["tokens"] for t in record["timing"]]
    tried = {"keep-" + "-".join(map(str, r["kept"])) if r["kept"] else "keep-none"
             for r in record["frontier"] + record["attempts"]}
    assert tokens == [128, 96] and all(set(t["sets"]) == tried for t in record["timing"])
    assert (f"keep-{'-'.join(map(str, chosen))}" if chosen else "keep-none") in tried  # the chosen set is timed
    assert f"layers kept softmax: {chosen or 'none'}, chosen" in (run_dir / "README.md").read_text()
    # Resume after losing the final run and the all-linear candidate: the rest is read back.
    (run_dir / RESULTS_FILE).unlink()
    shutil.rmtree(run_dir / SELECTION_DIR / "keep-none")
    record.pop("verified"), record.pop("trying"), record.pop("attempts")
    (run_dir / SELECTION_FILE).write_text(json.dumps(record))
    again = invoke_cli("run", "--resume", run_dir)
    assert again.exit_code == 0, again.output[-3000:]
    assert "[1] control (softmax): finished earlier" in again.output
    assert "keep softmax none -> " in again.output  # the lost candidate runs again
    assert json.loads((run_dir / RESULTS_FILE).read_text())["layer_selection"]["chosen"] == chosen
    done = invoke_cli("run", "--resume", run_dir)
    assert "already finished" in cli_error_line(done)


def test_the_ranking_scores_the_all_linear_candidate_on_the_held_out_part_one_layer_restored_at_a_time(
        text_setup, tmp_path):
    model_dir, data_dir = text_setup
    from luna_convert.run.pipeline import run_conversion

    config = config_for(model_dir, data_dir, "sst2", "elu", tmp_path, max_steps=1)
    config.selection = {"role": "candidate", "holdout": 0.25}
    candidate = run_conversion(config)
    out = evaluate_model(candidate.run_dir, inspect=restored_layer_scores)
    assert out["eval_examples"] == 12 and out["metrics"]["accuracy"] == candidate.converted_score
    assert sorted(out["inspected"]) == [0, 1] and all(0 <= s <= 1 for s in out["inspected"].values())


def test_an_image_search_runs_and_times_long_copies_of_a_timm_vit(tmp_path):
    model_dir = write_timm_checkpoint(tmp_path / "vit")
    data_dir = write_image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    result = _auto_run(model_dir, data_dir, run_dir, "--target-pct", "1", steps=1)
    assert result.exit_code == 0, result.output[-3000:]
    record = json.loads((run_dir / SELECTION_FILE).read_text())
    assert record["chosen"] == [] and record["verified"]
    # 32 px images of 8 px patches: 16 patches + the class token; 96 asked: a 10 x 10 grid + the class token
    assert [t["tokens"] for t in record["timing"]] == [17, 101] and set(record["timing"][1]["sets"]) == {"keep-none"}
    assert "forward at 101 tokens" in (run_dir / SELECTION_TABLE).read_text()


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("args, message", [
    (["--method", "softmax", "--keep-softmax-layers", "auto"], "keep_softmax_layers auto needs a linear method"),
    (["--keep-softmax-layers", "auto,1"], "auto chooses the layers itself; pass auto or a list"),
    (["--keep-softmax-layers", "1", "--target-pct", "95"], "--target-pct goes with --keep-softmax-layers auto"),
    (["--keep-softmax-layers", "auto", "--target-pct", "120"], "layer_selection.target_pct must be a percentage"),
    (["--keep-softmax-layers", "auto", "--set", "layer_selection.holdout=1"], "layer_selection.holdout must be"),
])
def test_bad_auto_requests_are_one_line_errors(text_setup, tmp_path, args, message):
    model_dir, data_dir = text_setup
    result = invoke_cli("run", "--model", model_dir, "--data-dir", data_dir, "--task", "sst2", "--run-dir",
                        tmp_path / "run", *(["--method", "elu"] if "--method" not in args else []), *args)
    assert message in cli_error_line(result)
    assert not (tmp_path / "run").exists()


def test_compare_refuses_auto_in_one_line(text_setup, tmp_path):
    model_dir, data_dir = text_setup
    result = invoke_cli("compare", "--model", model_dir, "--data-dir", data_dir, "--task", "sst2", "--methods", "elu",
                        "--keep-softmax-layers", "auto", "--dir", tmp_path / "cmp")
    assert "chooses the layers in `luna-convert run`" in cli_error_line(result)


def test_restoring_a_layer_to_softmax_is_the_model_converted_with_that_layer_kept(monkeypatch):
    import torch

    from luna_convert.conversion import convert
    from conftest import example_inputs, logits_of, make_bert

    inputs = example_inputs("hf-bert")
    monkeypatch.setattr(layer_selection, "score", lambda accelerator, model, loaders, task, kind: (
        {"accuracy": logits_of(model, inputs).double().sum().item()}, 0))
    model = make_bert()
    convert(model, "elu")  # no parameters: the same weights in every conversion
    restored = restored_layer_scores(None, model, {}, get_task("sst2"))
    for layer, value in restored.items():
        kept = make_bert()
        convert(kept, "elu", keep_softmax_layers=[layer])
        assert value == pytest.approx(logits_of(kept, inputs).double().sum().item(), rel=1e-4)
    linear = logits_of(model, inputs).double().sum().item()
    assert sorted(restored) == [0, 1] and all(v != pytest.approx(linear, rel=1e-2) for v in restored.values())


def test_the_control_and_the_timed_hybrids_take_the_runs_validated_options(tmp_path, monkeypatch):
    """The control is the config's own control copy; the timed hybrids get the run's one options object
    (``RunConfig.attention_options()``) and convert's keywords, never the option dict to validate again."""
    from luna_convert.conversion import convert
    from conftest import make_bert

    config = RunConfig(model="m", task="sst2", method="luna", keep_softmax_layers="auto",
                       method_options={"projections": 4, "convert_local_layers": True})
    config.layer_selection.time_lengths = []
    control = Selection(config, tmp_path, print, None).candidate_config(None, "softmax")
    assert (control.method, control.method_options, control.keep_softmax_layers) == ("softmax", {}, [])
    assert control.attention_options() is None and config.method_options["projections"] == 4
    given = []

    def spy(model, method, **kwargs):
        given.append(kwargs)
        return convert(model, method, **kwargs)

    monkeypatch.setattr(layer_selection, "convert", spy)
    monkeypatch.setattr(layer_selection, "load", lambda path: make_bert())
    rows = layer_selection.time_frontier(config, {"frontier": [{"kept": [0], "run_dir": str(tmp_path)}]},
                                         repeats=1, warmup=0)
    assert [set(r["sets"]) for r in rows] == [{"keep-0"}]
    assert len(given) == 1 and given[0]["options"] is config.attention_options()
    assert given[0]["options"].projections == 4 and "projections" not in given[0]
    assert given[0]["convert_local_layers"] is True and given[0]["keep_softmax_layers"] == [0]
