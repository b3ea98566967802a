"""The quality levers: exponential channel init, per-head projections, the learning rate of what
conversion added, scores per stage, the softmax control and `compare`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from luna_convert.layers.attention import AttentionMode, LinearAttention
from luna_convert.linear_methods.luna import EXP_INIT_SPAN, LunaFeatureMap, ScalarChannels, exp_rates
from luna_convert.run.pipeline import run_conversion
from luna_convert.engine.training import parameter_groups
from builders import config_for, write_bert_checkpoint, write_sst2


def test_exp_channel_init_interpolates_exponentials():
    psi = ScalarChannels(channels=4, hidden=64, init="exp")
    rates = exp_rates(4)
    assert rates.tolist() == [0.5, -0.5, 1.0, -1.0]
    u = torch.linspace(-EXP_INIT_SPAN, EXP_INIT_SPAN, 301, dtype=torch.float64)
    with torch.no_grad():
        got = psi.double()(u[:, None])[:, 0, :]  # [301, L]
    want = torch.exp(u[:, None] * rates[None, :])
    # Piecewise-linear interpolation of exp(c u) over 64 knots on [-4, 4] (spacing 0.127):
    # the relative error is at most spacing^2 c^2 / 8 = 0.002 for |c| = 1 (measured 0.0020).
    rel = ((got - want).abs() / want).max().item()
    assert rel < 3e-3
    # Beyond the span the channel continues with the last slope (a rising exponential keeps rising).
    with torch.no_grad():
        far = psi.double()(torch.tensor([[EXP_INIT_SPAN + 1.0]], dtype=torch.float64))[0, 0]
    assert far[0] > math.exp(0.5 * EXP_INIT_SPAN) and far[1] == pytest.approx(math.exp(-0.5 * EXP_INIT_SPAN), rel=1e-6)


def test_exp_init_of_a_shared_bank_interpolates_on_the_span():
    psi = ScalarChannels(channels=4, hidden=64, shared=True, init="exp")
    u = torch.linspace(-EXP_INIT_SPAN, EXP_INIT_SPAN, 301, dtype=torch.float64)
    with torch.no_grad():
        got = psi.double()(u[:, None])[:, 0, :]
    want = torch.exp(u[:, None] * exp_rates(4)[None, :])
    assert ((got - want).abs() / want).max().item() < 3e-3  # same interpolation error as unshared (0.0020)


def test_bad_channel_and_projection_inits_are_refused():
    with pytest.raises(ValueError, match="unknown channel_init"):
        ScalarChannels(channels=4, hidden=8, init="gaussian")
    with pytest.raises(ValueError, match="unknown projection_init"):
        LunaFeatureMap(16, 2, projection_init="eye")


def test_per_head_projections_project_each_head_with_its_own_matrix():
    torch.manual_seed(0)
    phi = LunaFeatureMap(8, 3, projections=4, channels=2, hidden=8, per_head_projections=True, projection_init="random",
                         feature_norm="none")
    x = torch.randn(2, 3, 5, 8)
    u = phi.project(x)
    for h in range(3):
        torch.testing.assert_close(u[:, h], x[:, h] @ phi.head_proj_weight[h] + phi.head_proj_bias[h])
    # Same features as the reference bank evaluated on those projections (fast kernel vs plain MLP).
    want = (phi.psi(u) / math.sqrt(4)).flatten(-2)
    torch.testing.assert_close(phi(x), want, atol=1e-5, rtol=1e-5)  # measured 4.8e-7
    ident = LunaFeatureMap(8, 3, projections=8, channels=2, hidden=8, per_head_projections=True,
                           projection_init="identity")
    torch.testing.assert_close(ident.project(x), x)
    fewer = LunaFeatureMap(8, 3, projections=3, channels=2, hidden=8, projection_init="identity")
    torch.testing.assert_close(fewer.project(x), x[..., :3])  # projection i reads coordinate i mod d


def test_luna_defaults_start_at_hedgehog():
    """The conversion defaults: W = I per head, channels at exp(+u), exp(-u), each channel normalised over
    the projections, i.e. Hedgehog's [softmax(x), softmax(-x)] up to the piecewise-linear channels."""
    torch.manual_seed(0)
    phi = LunaFeatureMap(8, 2)
    x = (3 * torch.randn(2, 2, 5, 8)).clamp(-7.5, 7.5)  # inside the channels' interpolation span [-8, 8]
    want = torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)  # Hedgehog with W = I, b = 0
    got = phi(x).reshape(2, 2, 5, 8, 2).transpose(-1, -2).flatten(-2)  # [.., M, L] -> [.., L, M]
    # exp(+-u) interpolated over 64 knots on [-8, 8]: relative error <= spacing^2 / 8 = 0.008 (measured 6.9e-3
    # after normalising)
    torch.testing.assert_close(got, want, rtol=9e-3, atol=1e-6)
    assert phi.shared_qk is False  # keys get their own copy of this map in a layer


def test_parameter_groups_give_what_conversion_added_its_own_learning_rate():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.pretrained = torch.nn.Linear(4, 4)
    model.attn = LinearAttention("t2r", head_dim=4, num_heads=2, softmax_scale=0.5, dwc=True)
    groups = parameter_groups(model, lr=2e-5, weight_decay=0.01, added_lr=1e-3)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert lr_of[id(model.pretrained.weight)] == (2e-5, 0.01)
    assert lr_of[id(model.pretrained.bias)] == (2e-5, 0.0)
    assert lr_of[id(model.attn.phi_q.proj.weight)] == (1e-3, 0.01)
    assert lr_of[id(model.attn.dwc.conv.bias)] == (1e-3, 0.0)
    assert len(lr_of) == sum(1 for _ in model.parameters())
    same = parameter_groups(model, lr=2e-5, weight_decay=0.01, added_lr=None)
    assert {g["lr"] for g in same} == {2e-5}


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    return write_bert_checkpoint(root / "bert"), write_sst2(root / "SST-2")


def test_run_scores_each_stage_and_the_control_is_unconverted(tiny_case, tmp_path):
    model_dir, data_dir = tiny_case
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "h"))
    stages = results["stage_scores"]
    assert set(stages) == {"after_conversion", "after_distillation", "final"}
    assert stages["final"] == results["converted_score"]
    assert json.loads((Path(results["run_dir"]) / "stage_scores.json").read_text()) == {
        k: v for k, v in stages.items() if k != "final"}
    control = run_conversion(config_for(model_dir, data_dir, "sst2", "softmax", tmp_path / "c"))
    assert control["conversion"] is None and control["steps"] == {"distill": 0, "finetune": 3}
    assert set(control["stage_scores"]) == {"final"}
    meta = json.loads((Path(control["run_dir"]) / "model" / "linear_attention.json").read_text())
    assert meta["conversion"] is None  # saved as the original architecture


def test_compare_runs_every_method_and_reads_finished_runs_back(tiny_case, tmp_path):
    from luna_convert.run.compare import COMPARE_FILE, PLOT_FILE, TABLE_FILE, run_compare

    model_dir, data_dir = tiny_case
    config = config_for(model_dir, data_dir, "sst2", "luna", tmp_path / "out")
    folder = tmp_path / "cmp"
    summary = run_compare(config, ["t2r", "t2r-hh"], [0, 1], folder)
    assert [r["method"] for r in summary["rows"]] == ["softmax", "t2r", "t2r-hh"]
    for row in summary["rows"]:
        results = [json.loads((folder / f"{row['method']}-seed{s}" / "results.json").read_text()) for s in (0, 1)]
        finals = [r["converted_score"] for r in results]
        assert row["final"]["mean"] == pytest.approx(sum(finals) / 2)
        assert row["final"]["std"] == pytest.approx(abs(finals[0] - finals[1]) / math.sqrt(2))
        assert row["recovered_pct"]["mean"] == pytest.approx(sum(r["recovered_pct"] for r in results) / 2)
    control = summary["rows"][0]["final"]["mean"]
    t2r_hh = summary["rows"][2]
    assert t2r_hh["after_distillation"]["n"] == 2 and summary["rows"][1]["after_distillation"]["n"] == 0
    # The per-head fit is recorded by every converted run and summarised per method (none for the control).
    assert t2r_hh["attention_kl"]["n"] == 2 and summary["rows"][0]["attention_kl"]["n"] == 0
    assert t2r_hh["attention_kl"]["mean"] == pytest.approx(sum(
        json.loads((folder / f"t2r-hh-seed{s}" / "results.json").read_text())["head_fit"]["mean_kl"] for s in (0, 1)) / 2)
    if control:
        assert t2r_hh["pct_of_control"] == pytest.approx(100 * t2r_hh["final"]["mean"] / control)
    table = (folder / TABLE_FILE).read_text()
    assert table.count("\n| ") == 4 and "| t2r-hh |" in table  # header + 3 rows
    assert (folder / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((folder / COMPARE_FILE).read_text())["rows"] == summary["rows"]
    # Run again: nothing is re-run (the run folders' results are read back unchanged).
    stamp = (folder / "t2r-seed0" / "results.json").stat().st_mtime_ns
    again = run_compare(config, ["t2r", "t2r-hh"], [0, 1], folder)
    assert again["rows"] == summary["rows"]
    assert (folder / "t2r-seed0" / "results.json").stat().st_mtime_ns == stamp


def test_compare_refuses_an_unknown_method_before_running(tiny_case, tmp_path):
    from luna_convert.run.compare import run_compare
    from luna_convert.errors import LunaConvertError

    model_dir, data_dir = tiny_case
    with pytest.raises(LunaConvertError, match="unknown method"):
        run_compare(config_for(model_dir, data_dir, "sst2", "luna", tmp_path), ["luna", "lunar"], [0], tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_compare_gives_shared_layer_options_to_every_method_and_method_options_to_their_own(tiny_case, tmp_path):
    from luna_convert.errors import LunaConvertError
    from luna_convert.run.compare import options_for, run_compare

    model_dir, data_dir = tiny_case
    config = config_for(model_dir, data_dir, "sst2", "luna", tmp_path / "out")
    config.method_options = {"window": 2, "projections": 4, "convert_local_layers": True}
    assert options_for(config, "luna") == config.method_options
    assert options_for(config, "hedgehog") == {"window": 2, "convert_local_layers": True}
    assert options_for(config, "softmax") == {}
    config.method_options = {"window": 2}
    summary = run_compare(config, ["hedgehog"], [0], tmp_path / "cmp", control=False)
    meta = json.loads((tmp_path / "cmp" / "hedgehog-seed0" / "model" / "linear_attention.json").read_text())
    assert meta["conversion"]["options"]["window"] == 2 and summary["rows"][0]["final"]["n"] == 1
    # A method that refuses a shared option fails before any run starts.
    with pytest.raises(LunaConvertError, match="window must be 0 for 'sorting'"):
        run_compare(config, ["hedgehog", "sorting"], [0], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_output_distillation_matches_the_softmax_output_and_trains_the_map():
    """distill.target "output": the layer returns softmax's output, and its loss is the relative squared
    error of its own linear output against it, over real query rows only."""
    from luna_convert.ops.reference import softmax_attention_weights

    torch.manual_seed(0)
    layer = LinearAttention("hedgehog", 8, 2, 8**-0.5)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    layer.set_mode(AttentionMode.DISTILL_OUTPUT)
    out = layer(q, k, v, mask)
    a = softmax_attention_weights(q, k, 8**-0.5, mask)
    teacher = a @ v
    torch.testing.assert_close(out, teacher, rtol=0, atol=1e-6)  # SDPA vs the explicit softmax: measured 2.4e-7
    layer.set_mode(AttentionMode.LINEAR)
    student = layer(q, k, v, mask)
    rows = mask[:, None, :].expand(2, 2, 6)
    want = ((student - teacher) ** 2).sum(-1)[rows].sum() / (teacher**2).sum(-1)[rows].sum()
    torch.testing.assert_close(layer.distill_loss.detach(), want.detach(), rtol=1e-5, atol=0)
    layer.set_mode(AttentionMode.DISTILL_OUTPUT)
    layer(q, k, v, mask)
    layer.distill_loss.backward()
    assert layer.phi_q.weight.grad is not None and layer.phi_q.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("target, bound", [("output", 10), ("logits", 5)])
def test_run_distils_on_the_chosen_target(tiny_case, tmp_path, target, bound):
    """output: a relative error, not a cross-entropy; logits: a KL between 2-class distributions. Both small."""
    model_dir, data_dir = tiny_case
    config = config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path)
    config.distill.target = target
    results = run_conversion(config)
    log = [json.loads(line) for line in (Path(results["run_dir"]) / "train_log.jsonl").read_text().splitlines()]
    distil = [e["loss"] for e in log if e["stage"] == "distill"]
    assert len(distil) == 2 and all(0 <= x < bound for x in distil)
    assert "after_distillation" in results["stage_scores"]
    assert results["config"]["distill"]["target"] == target


def test_method_recipe_sets_the_added_learning_rate_unless_given(tiny_case, tmp_path):
    model_dir, data_dir = tiny_case
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "flexformer", tmp_path / "a"))
    assert results["method_recipe"] == {"train.added_lr": 1e-3}
    assert results["config"]["train"]["added_lr"] == 1e-3 and results["steps"]["distill"] == 2
    given = config_for(model_dir, data_dir, "sst2", "flexformer", tmp_path / "b", added_lr=5e-4)
    results = run_conversion(given)
    assert results["method_recipe"] == {} and results["config"]["train"]["added_lr"] == 5e-4
    # LUNA distils from Hedgehog's kernel and then finetunes everything at train.lr (SST-2 0.8630
    # vs 0.8595 with added_lr 1e-3, 2 seeds): no recipe of its own beyond distilling.
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "luna", tmp_path / "c"))
    assert results["method_recipe"] == {} and results["config"]["train"]["added_lr"] is None
    assert results["steps"]["distill"] == 2


# ----------------------------------------------------------------- hybrids: layers kept softmax
def _attention_outputs(model, inputs) -> list[torch.Tensor]:
    """Each encoder layer's attention-block output, in layer order."""
    outs, handles = [], []
    for layer in model.bert.encoder.layer:
        handles.append(layer.attention.register_forward_hook(
            lambda _m, _a, out: outs.append((out[0] if isinstance(out, tuple) else out).detach())))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return outs


def test_keep_softmax_layers_leaves_those_layers_exact_and_survives_save_load(tmp_path):
    from conftest import example_inputs, make_bert

    from luna_convert import convert, load, save
    from luna_convert.adapters import LinearizedAttention

    original, model = make_bert(), make_bert()
    inputs = example_inputs("hf-bert")
    report = convert(model, "hedgehog", keep_softmax_layers=[-2])  # 2 layers: -2 is layer 0
    names = [r.name for r in report.modules]
    assert report.kept_softmax == ["bert.encoder.layer.0.attention.self"]
    assert names == ["bert.encoder.layer.1.attention.self"]
    assert not isinstance(model.bert.encoder.layer[0].attention.self, LinearizedAttention)
    assert isinstance(model.bert.encoder.layer[1].attention.self, LinearizedAttention)
    want, got = _attention_outputs(original, inputs), _attention_outputs(model, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the kept layer: the same module, same input
    assert (got[1] - want[1]).abs().max() > 1e-3  # the converted one differs
    save(model, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert not isinstance(loaded.bert.encoder.layer[0].attention.self, LinearizedAttention)
    torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_keep_softmax_layers_out_of_range_or_all_is_refused_before_any_change():
    from conftest import make_bert

    from luna_convert import convert
    from luna_convert.conversion import is_converted
    from luna_convert.errors import ConversionError

    model = make_bert()
    with pytest.raises(ConversionError, match=r"keep_softmax_layers \[2\] out of range: the model has 2 attention"):
        convert(model, "luna", keep_softmax_layers=[2])
    with pytest.raises(ConversionError, match="keeps all 2 attention layers"):
        convert(model, "luna", keep_softmax_layers=[0, 1])
    assert not is_converted(model)


def test_run_keeps_softmax_layers_from_the_cli_setting(tiny_case, tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    model_dir, data_dir = tiny_case
    config = config_for(model_dir, data_dir, "sst2", "t2r", tmp_path / "a")
    config.keep_softmax_layers = [0]
    results = run_conversion(config)
    assert results["conversion"]["kept_softmax"] == ["bert.encoder.layer.0.attention.self"]
    assert [m["name"] for m in results["conversion"]["modules"]] == ["bert.encoder.layer.1.attention.self"]
    out = CliRunner().invoke(app, ["run", "--model", str(model_dir), "--task", "sst2", "--data-dir", str(data_dir),
                                   "--method", "t2r", "--keep-softmax-layers", "5", "--max-steps", "1",
                                   "--output-dir", str(tmp_path / "b")])
    assert out.exit_code == 2 and "out of range: the model has 2 attention layers" in out.output, out.output
    assert not (tmp_path / "b").exists()  # refused before any run folder is written


# ----------------------------------------------------------------- per-head fit diagnostic
def test_row_entropy_and_kl_match_scipy_over_real_rows_and_keys():
    from scipy.stats import entropy

    from luna_convert.engine.head_fit import row_entropy_and_kl
    from luna_convert.ops.reference import softmax_attention_weights

    torch.manual_seed(0)
    layer = LinearAttention("hedgehog", 8, 2, 8**-0.5)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    ent, kl, rows = row_entropy_and_kl(layer, {"q": q, "k": k, "key_mask": mask, "grid": None, "num_prefix": 0})
    with torch.no_grad():
        teacher = softmax_attention_weights(q, k, 8**-0.5, mask)[0].double().numpy()
        student = layer.attention_weights(q, k, mask)[0].double().numpy()
    for h in range(2):
        want_ent = sum(entropy(teacher[h, i, :4]) for i in range(4))
        want_kl = sum(entropy(teacher[h, i, :4], student[h, i, :4]) for i in range(4))
        # scipy renormalises the float32 rows (sums 1 +- 1e-7): measured relative differences 2e-9 and 3e-8.
        assert ent[h].item() == pytest.approx(want_ent, rel=1e-6)
        assert kl[h].item() == pytest.approx(want_kl, rel=1e-5)
    assert rows.tolist() == [4.0, 4.0]


def test_head_fit_reports_every_converted_layer_and_the_worst_heads():
    from conftest import HEADS, LAYERS, example_inputs, make_bert

    from luna_convert import convert
    from luna_convert.engine.head_fit import head_fit

    model = make_bert()
    convert(model, "t2r")
    fit = head_fit(model, [example_inputs("hf-bert")])
    assert fit["examples"] == 2 and len(fit["layers"]) == LAYERS
    assert all(len(layer["kl"]) == HEADS and min(layer["kl"]) >= 0 for layer in fit["layers"])
    kls = [d for layer in fit["layers"] for d in layer["kl"]]
    assert fit["mean_kl"] == pytest.approx(sum(kls) / len(kls), abs=1e-3)
    assert fit["worst_heads"][0]["kl"] == pytest.approx(max(kls), abs=1e-4)
    with pytest.raises(ValueError, match="needs a converted model"):
        head_fit(make_bert(), [example_inputs("hf-bert")])


def test_eval_heads_prints_the_per_layer_fit_and_refuses_an_unconverted_model(tiny_case, tmp_path):
    from typer.testing import CliRunner

    from luna_convert.cli import app

    model_dir, data_dir = tiny_case
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "r"))
    out = CliRunner().invoke(app, ["eval", results["run_dir"], "--heads", "--json"])
    assert out.exit_code == 0, out.output
    fit = json.loads(out.stdout)["head_fit"]  # stdout is the JSON alone: progress goes to stderr
    assert len(fit["layers"]) == 2 and fit["mean_kl"] == pytest.approx(results["head_fit"]["mean_kl"], abs=1e-4)
    out = CliRunner().invoke(app, ["eval", str(model_dir), "--task", "sst2", "--data-dir", str(data_dir), "--heads"])
    assert out.exit_code == 2 and "is not converted: --heads compares" in out.output


# ----------------------------------------------------------------- logits distillation
def test_logits_distillation_loss_is_the_class_kl_and_squared_error_for_one_output():
    from scipy.stats import entropy

    from luna_convert.ops.reference import logits_distillation_loss

    torch.manual_seed(0)
    teacher, student = torch.randn(4, 3), torch.randn(4, 3)
    want = sum(entropy(torch.softmax(teacher[i], -1).numpy(), torch.softmax(student[i], -1).numpy())
               for i in range(4)) / 4
    assert logits_distillation_loss(teacher, student).item() == pytest.approx(want, rel=1e-5)  # float32: 1e-7
    assert logits_distillation_loss(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    one_t, one_s = torch.randn(5, 1), torch.randn(5, 1)
    assert logits_distillation_loss(one_t, one_s).item() == pytest.approx(((one_t - one_s) ** 2).mean().item())
    # per token: padded positions do not count
    tok_t, tok_s = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    real = logits_distillation_loss(tok_t[mask.bool()], tok_s[mask.bool()])
    tok_s[1, 2:] += 5.0
    assert logits_distillation_loss(tok_t, tok_s, mask).item() == pytest.approx(real.item(), rel=1e-6)


def test_softmax_logits_of_a_converted_model_are_the_original_models():
    from conftest import example_inputs, make_bert

    from luna_convert import convert
    from luna_convert.conversion import linear_attention_modules
    from luna_convert.engine.training import softmax_logits

    original, model = make_bert(), make_bert()
    convert(model, "luna")  # with its DWC branch: the softmax pass must leave it out too
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        want = original(**inputs).logits
        linear = model(**inputs).logits
    got = softmax_logits(model, linear_attention_modules(model), inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # SDPA vs the original's attention: measured 6e-7
    assert (linear - want).abs().max() > 1e-3
    assert all(layer.mode is AttentionMode.LINEAR for layer in linear_attention_modules(model))


def test_logits_distillation_trains_only_the_maps_and_lowers_the_kl():
    from accelerate import Accelerator

    from conftest import example_inputs, make_bert

    from luna_convert import convert
    from luna_convert.conversion import feature_map_parameters, linear_attention_modules
    from luna_convert.engine.training import distill_attention, forward_logits, softmax_logits
    from luna_convert.ops.reference import logits_distillation_loss

    model = make_bert()
    convert(model, "hedgehog")
    batch = example_inputs("hf-bert")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "phi_" not in n}

    def kl() -> float:
        with torch.no_grad():
            return logits_distillation_loss(softmax_logits(model, linear_attention_modules(model), batch),
                                            forward_logits(model, batch)).item()

    before = kl()
    distill_attention(Accelerator(cpu=True), model, [batch] * 30, steps=30, lr=1e-2, target="logits")
    assert kl() < 0.5 * before  # measured: 0.0117 -> 0.00009 after 30 steps on this batch
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert feature_map_parameters(model) and all(p.requires_grad for p in model.parameters())


def test_a_method_without_parameters_skips_distillation_and_says_so(tiny_case, tmp_path):
    model_dir, data_dir = tiny_case
    config = config_for(model_dir, data_dir, "sst2", "elu", tmp_path)
    config.distill.steps = 2  # as a compare recipe gives every method
    lines = []
    results = run_conversion(config, console=type("Console", (), {"print": lambda self, *a, **k: lines.append(str(a[0]))})())
    assert results["steps"]["distill"] == 0 and "after_distillation" not in results["stage_scores"]
    assert any("no trainable feature map: its 2 distillation steps are skipped" in line for line in lines)


def test_channel_lr_scale_gives_luna_channel_functions_their_own_rate_in_both_stages():
    from conftest import make_bert

    from luna_convert import convert
    from luna_convert.conversion import feature_map_parameters, linear_attention_modules
    from luna_convert.engine.training import scaled_groups

    model = make_bert()
    convert(model, "luna", dwc=True)  # the default rate: 0.1; DWC for its own rate below
    channel = {id(p) for n, p in model.named_parameters() if ".psi." in n}
    assert channel
    layers = linear_attention_modules(model)
    distil = scaled_groups(feature_map_parameters(model), layers, lr=1e-2)
    lr_of = {id(p): g["lr"] for g in distil for p in g["params"]}
    assert all(lr_of[i] == pytest.approx(1e-3) for i in channel)
    assert {v for i, v in lr_of.items() if i not in channel} == {1e-2}
    groups = parameter_groups(model, lr=2e-5, weight_decay=0.01, added_lr=1e-3)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert all(lr_of[i] == pytest.approx(1e-4) for i in channel)
    dwc = {id(p) for n, p in model.named_parameters() if ".dwc." in n}
    assert {lr_of[i] for i in dwc} == {1e-3}
    plain = make_bert()
    convert(plain, "luna", channel_lr_scale=1.0)  # one rate for everything: one group
    assert len(scaled_groups(feature_map_parameters(plain), linear_attention_modules(plain), lr=1e-2)) == 1


def test_exp_span_sets_where_the_channels_follow_exp():
    """exp_span 8: the knots cover [-8, 8] (spacing 0.254), so the channel follows exp out to 8 where the
    default span stops at 4 and continues linearly."""
    wide = ScalarChannels(channels=2, hidden=64, init="exp", exp_rate=1.0, exp_span=8.0).double()
    narrow = ScalarChannels(channels=2, hidden=64, init="exp", exp_rate=1.0).double()
    u = torch.linspace(-8.0, 8.0, 401, dtype=torch.float64)
    want = torch.exp(u[:, None] * exp_rates(2, 1.0)[None, :])
    with torch.no_grad():
        got_wide, got_narrow = (psi(u[:, None])[:, 0, :] for psi in (wide, narrow))
    # Interpolation error <= spacing^2 c^2 / 8 = 0.0081 for |c| = 1 (measured 0.0080).
    assert ((got_wide - want).abs() / want).max().item() < 9e-3
    assert got_narrow[-1, 0].item() < 0.5 * math.exp(8.0)  # the default span grows linearly past 4


def test_separate_key_map_gives_keys_their_own_parameters(tmp_path):
    from luna_convert import convert, load, save
    from luna_convert.conversion import linear_attention_modules
    from conftest import example_inputs, logits_of, make_bert

    layer = LinearAttention("luna", 8, 2, 8**-0.5, dwc=False, separate_key_map=True)
    assert layer.phi_k is not None and layer.phi_k is not layer.phi_q
    shared = LinearAttention("luna", 8, 2, 8**-0.5, dwc=False, separate_key_map=False)
    assert shared.phi_k is None
    assert len(layer.method_parameters()) == 2 * len(shared.method_parameters())
    model = make_bert()
    convert(model, "luna", separate_key_map=True)
    with torch.no_grad():  # keys' map moved away from the queries': loading must read both from disk
        for la in linear_attention_modules(model):
            la.phi_k.head_proj_weight.add_(0.1)
    inputs = example_inputs("hf-bert")
    loaded = load(save(model, tmp_path / "m"))
    assert linear_attention_modules(loaded)[0].phi_k is not None
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), logits_of(model, inputs))


# ----------------------------------------------------------------- the teacher's logits in finetuning
def _tiny_classifier(seed: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_finetune_loss_is_the_weighted_task_loss_and_kl_to_the_frozen_teacher(weight):
    """train.teacher_kd: (1 - w) cross-entropy + w KL(teacher || model), written out over the classes in float64."""
    from accelerate import Accelerator
    from luna_convert.engine.training import finetune
    from luna_convert.run.pipeline import frozen_copy

    student, teacher = _tiny_classifier(0), _tiny_classifier(1)
    with torch.no_grad():  # a freshly initialised head gives near-uniform classes: make the teacher decided
        teacher.classifier.weight.mul_(100)
    teacher = frozen_copy(teacher)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (4, 6), generator=g), "attention_mask": torch.ones(4, 6, dtype=torch.long),
             "labels": torch.tensor([0, 2, 1, 2])}
    batch["attention_mask"][1, 4:] = 0
    with torch.no_grad():
        s = torch.log_softmax(student(**{k: v for k, v in batch.items() if k != "labels"}).logits.double(), -1)
        t = torch.log_softmax(teacher(**{k: v for k, v in batch.items() if k != "labels"}).logits.double(), -1)
    ce = -s[torch.arange(4), batch["labels"]].mean()
    kl = (t.exp() * (t - s)).sum(-1).mean()
    want = (1 - weight) * ce + weight * kl
    logged = []
    finetune(Accelerator(cpu=True), student, [batch], steps=1, lr=1e-3, teacher=teacher, teacher_weight=weight,
             log=logged.append)
    assert logged[0]["loss"] == pytest.approx(want.item(), rel=1e-5)
    assert kl.item() > 0.01 and abs(ce.item() - kl.item()) > 0.01  # the weights are told apart
    # the teacher neither trains nor changes
    assert all(torch.equal(v, teacher_state[k]) for k, v in teacher.state_dict().items())
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_run_with_teacher_kd_records_it_and_refuses_bad_weights(tiny_case, tmp_path):
    from luna_convert.errors import LunaConvertError

    model_dir, data_dir = tiny_case
    results = run_conversion(config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "kd", teacher_kd=0.5))
    assert results["config"]["train"]["teacher_kd"] == 0.5 and results["steps"]["finetune"] == 3
    log = [json.loads(line) for line in (Path(results["run_dir"]) / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if e["stage"] == "finetune"] == [1, 2, 3]
    for bad, message in ((-0.1, "must be a weight in"), (1.5, "must be a weight in"), ("half", "must be a number")):
        with pytest.raises(LunaConvertError, match=f"train.teacher_kd {message}"):
            config_for(model_dir, data_dir, "sst2", "hedgehog", tmp_path / "bad", teacher_kd=bad).validate()
    with pytest.raises(LunaConvertError, match="teacher_kd does not fit --task embedding"):
        config_for(model_dir, data_dir, "embedding", "hedgehog", tmp_path / "emb", teacher_kd=0.5).validate()
