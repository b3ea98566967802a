"""``luna-convert lra``: the encoder's attention and pooling against explicit float64 formulas, the command end
to end on a tiny generated set (softmax and LUNA), its run folder read by ``report``, resume after a crash
landing exactly where an uninterrupted run lands, LUNA's paper form pinned in every LRA recipe, and bad input
refused on one line with exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import luna_convert.engine.training as training
from luna_convert.cli import app
from luna_convert.linear_methods.luna import PAPER_OPTIONS
from luna_convert.linear_methods.luna_options import LunaOptions
from luna_convert.lra.config import RECIPE_DIR, LRAConfig, load_lra_config
from luna_convert.lra.model import Attention, EncoderSettings, LRAEncoder, sinusoidal_table
from luna_convert.lra.train import build_model
from luna_convert.tools.report import build_report

TINY = ["--set", "data.train_examples=24", "--set", "data.dev_examples=8", "--set", "data.test_examples=8",
        "--set", "data.min_length=20", "--set", "data.max_length=60", "--batch-size", "8", "--seed", "0"]


# ------------------------------------------------------------------ the encoder
def test_softmax_attention_is_the_explicit_formula_and_ignores_padded_keys():
    torch.manual_seed(0)
    layer = Attention(hidden=8, heads=2, method="softmax", options=None, dropout=0.0).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    q, k, v = (x @ layer.qkv.weight.T + layer.qkv.bias).split(8, -1)
    heads = [t.view(2, 5, 2, 4).transpose(1, 2) for t in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-1, -2) / 2.0  # d = 4: 1 / sqrt(d)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want = (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(2, 5, 8) @ layer.out.weight.T + layer.out.bias
    torch.testing.assert_close(layer(x, mask), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method, options", [("softmax", None), ("luna", LunaOptions(**PAPER_OPTIONS))])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_changes_no_logit(method, options, pooling):
    """An example scores the same alone and padded inside a batch: the mask reaches attention and pooling."""
    torch.manual_seed(0)
    model = LRAEncoder(EncoderSettings(hidden=16, heads=2, ffn=32, pooling=pooling), vocab=20, num_classes=3,
                       max_length=12, method=method, options=options).eval()
    ids = torch.randint(1, 20, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        batch = model(ids, mask)
        alone = model(ids[1:, :7], mask[1:, :7])
    torch.testing.assert_close(batch[1:], alone, rtol=0, atol=1e-5)  # float32 sums in another order


def test_luna_runs_in_the_papers_form_through_the_projects_layer():
    config = LRAConfig(method="luna", method_options={"luna": dict(PAPER_OPTIONS)})
    model = LRAEncoder(EncoderSettings(), vocab=16, num_classes=10, max_length=8, method="luna",
                       options=config.attention_options())
    layer = model.blocks[0].attention.linear
    assert type(layer).__name__ == "LinearAttention" and layer.feature_dim == 64  # D = M L = 8 x 8
    assert {k: model.attention_options()[k] for k in PAPER_OPTIONS} == dict(PAPER_OPTIONS)


def test_the_config_resolves_the_methods_options_once_and_the_encoder_takes_only_that_object(monkeypatch):
    import luna_convert.lra.config as lra_config
    from luna_convert.linear_methods.registry import resolve_options

    calls = []
    monkeypatch.setattr(lra_config, "resolve_options", lambda *a: calls.append(a) or resolve_options(*a))
    config = load_lra_config("listops", overrides={"method": "luna", "method_options.luna.projections": 4})
    options = config.attention_options()
    assert type(options) is LunaOptions and options.projections == 4 and len(calls) == 1
    model = build_model(config, vocab=16, num_classes=10, max_length=8, pair=False)
    assert len(calls) == 1  # validated once, in the config
    assert all(block.attention.linear.options is options for block in model.blocks)
    config.method_options["luna"]["projections"] = 2  # a changed setting is validated again
    assert config.attention_options().projections == 2 and len(calls) == 2
    assert load_lra_config("listops").attention_options() is None  # softmax
    with pytest.raises(TypeError, match="options object"):
        LRAEncoder(EncoderSettings(), vocab=16, num_classes=10, max_length=8, method="luna",
                   options=dict(PAPER_OPTIONS))


def test_sinusoidal_positions_are_the_textbook_table():
    table = sinusoidal_table(6, 4).double()
    pos, i = 5, 1  # column 2i: sin(pos / 10000^(2i/d)), column 2i+1: cos of the same
    assert table[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(pos / 10000 ** (2 * i / 4))).item(), abs=1e-7)
    assert table[pos, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(pos / 10000 ** (2 * i / 4))).item(), abs=1e-7)


# ------------------------------------------------------------------ recipes
@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
def test_every_lra_recipe_pins_lunas_paper_form_and_loads(recipe):
    task, protocol = recipe.rsplit("-", 1)
    config = load_lra_config(task, protocol)
    assert config.method_options["luna"] == dict(PAPER_OPTIONS)
    assert (config.encoder.layers, config.encoder.hidden, config.encoder.heads, config.encoder.ffn) == (2, 64, 2, 128)
    assert config.data.dev_examples != 0  # the budget is chosen on a dev split held out of training


def test_all_ten_recipes_exist():
    assert len(list(RECIPE_DIR.glob("*.yaml"))) == 10


# ------------------------------------------------------------------ the command
def run_cli(*args):
    return CliRunner().invoke(app, ["lra", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lra")
    runs = {}
    for method in ("softmax", "luna"):
        result = run_cli("listops", "--method", method, "--max-steps", "2", *TINY, "--cache-dir", str(root / "cache"),
                         "--run-dir", str(root / method))
        assert result.exit_code == 0, result.output
        runs[method] = root / method
    return runs


def test_the_command_writes_a_run_folder_that_report_reads(finished_runs):
    for method, folder in finished_runs.items():
        assert {"config.json", "results.json", "train_log.jsonl", "curves.png", "model"} <= {p.name for p in folder.iterdir()}
        results = json.loads((folder / "results.json").read_text())
        assert results["method"] == method and results["task"] == "lra-listops" and results["steps"]["finetune"] == 2
        assert 0 <= results["converted_score"] <= 1 and "dev_accuracy" in results["stage_scores"]
        assert results["lra"]["data"]["train"]["examples"] == 24
        assert results["config"]["encoder"] == {"layers": 2, "hidden": 64, "heads": 2, "ffn": 128, "dropout": 0.1,
                                                "pooling": "mean", "positions": "learned"}
        assert len((folder / "train_log.jsonl").read_text().splitlines()) == 2
    luna = json.loads((finished_runs["luna"] / "results.json").read_text())
    assert {k: luna["lra"]["attention_options"][k] for k in PAPER_OPTIONS} == dict(PAPER_OPTIONS)
    report = build_report(list(finished_runs.values()))
    assert report["tasks"] == ["lra-listops"] and {r["method"] for r in report["rows"]} == {"softmax", "luna"}


def test_resume_after_a_crash_ends_where_an_uninterrupted_run_ends(tmp_path, monkeypatch):
    common = ["listops", "--method", "luna", "--max-steps", "4", *TINY, "--set", "train.checkpoint_every=2",
              "--cache-dir", str(tmp_path / "cache")]
    assert run_cli(*common, "--run-dir", str(tmp_path / "whole")).exit_code == 0
    loss, calls = training.task_loss, []

    def crash_at_step_4(logits, labels):  # after step 3 was logged, past the checkpoint at step 2
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return loss(logits, labels)

    monkeypatch.setattr(training, "task_loss", crash_at_step_4)
    crashed = run_cli(*common, "--run-dir", str(tmp_path / "crashed"))
    assert crashed.exit_code == 1 and "killed" in crashed.output  # the command's one line for a failure
    monkeypatch.setattr(training, "task_loss", loss)
    assert not (tmp_path / "crashed" / "results.json").exists()
    result = run_cli("listops", "--resume", str(tmp_path / "crashed"))
    assert result.exit_code == 0 and "from step 2" in result.output, result.output  # not a fresh start
    whole = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "crashed" / "model" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    logged = [json.loads(line)["step"] for line in (tmp_path / "crashed" / "train_log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]  # step 3 of the crashed attempt, after its checkpoint, forgotten


def test_a_method_option_set_on_the_command_line_reaches_the_encoder(tmp_path):
    result = run_cli("listops", "--method", "luna", "--max-steps", "1", *TINY, "--set",
                     "method_options.luna.projections=4", "--cache-dir", str(tmp_path / "cache"),
                     "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["lra"]["attention_options"]["projections"] == 4  # read off the built layers
    assert results["config"]["method_options"]["luna"]["projections"] == 4  # as given, by name


@pytest.mark.parametrize("args, message", [
    (["listopz"], "unknown LRA task 'listopz'"),
    (["text"], "lra text reads your own data: pass --data-dir"),
    (["listops", "--set", "encoder.hiden=3"], "unknown LRA setting 'encoder.hiden'"),
    (["listops", "--set", "encoder.hidden=65"], "must be a multiple of encoder.heads"),
    (["listops", "--method", "no-such-method"], "unknown method"),
    (["listops", "--method", "luna", "--set", "method_options.luna.channels=0"], "method_options.luna"),
    (["retrieval", "--data-dir", "/no/such/folder"], "does not exist"),
    (["pathfinder", "--set", "data.train_examples=null"], "set data.train_examples to a number"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = run_cli(*args, "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"))
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_compare_runs_each_method_in_its_own_process_and_reads_finished_runs_back(tmp_path, finished_runs):
    import shutil

    shutil.copytree(finished_runs["softmax"], tmp_path / "cmp" / "softmax-seed0")  # finished earlier: read back
    args = ["listops", "--methods", "softmax,luna", "--seeds", "0", "--max-steps", "1", *TINY,
            "--cache-dir", str(tmp_path / "cache"), "--dir", str(tmp_path / "cmp")]
    first = run_cli(*args)
    assert first.exit_code == 0 and first.output.count("finished earlier") == 1, first.output
    summary = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["method"] for r in summary["rows"]] == ["softmax", "luna"]
    assert [r["steps"] for r in summary["rows"]] == [2, 1]  # the copied run's 2 steps, the new run's 1
    for row in summary["rows"]:
        results = json.loads((tmp_path / "cmp" / f"{row['method']}-seed0" / "results.json").read_text())
        assert row["accuracy"]["mean"] == results["converted_score"]
        assert row["peak_rss_mib"]["mean"] == results["lra"]["peak_rss_mb"] > 0
    assert "| luna |" in (tmp_path / "cmp" / "compare.md").read_text()


def test_retrieval_runs_on_document_pairs_from_a_folder(tmp_path):
    rows = [f"{i % 2}\tdoc{i}\tdoc{i + 1}\t{'ab' * (i + 3)}\t{'ba' * (i + 5)}" for i in range(12)]
    (tmp_path / "aan").mkdir()
    (tmp_path / "aan" / "train.tsv").write_text("\n".join(rows) + "\n")
    (tmp_path / "aan" / "test.tsv").write_text("\n".join(rows[:4]) + "\n")
    result = run_cli("retrieval", "--method", "luna", "--data-dir", str(tmp_path / "aan"), "--max-steps", "1",
                     "--batch-size", "4", "--set", "data.dev_fraction=0.25", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    data = results["lra"]["data"]
    assert (data["train"]["examples"], data["dev"]["examples"], data["test"]["examples"]) == (9, 3, 4)
    assert data["train"]["max_pair_length"] <= 2 * 16 and results["eval_examples"] == 4
