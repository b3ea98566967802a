"""Bad input found by an outside audit, each answered through the command line with one line and exit code 2
before anything is written (the pre-flight stage, run/preflight.py), or handled as documented: damaged images,
text files in another encoding, an output folder that cannot be written, damaged model folders (config.json,
linear_attention.json, flipped bytes in model.safetensors), empty or ragged csv files, ``--max-steps 0``,
Ctrl-C, and ``luna_convert.save`` onto a folder in use. docs/reliability.md lists each with its message."""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest

from builders import cli_error_line, invoke_cli, write_bert_checkpoint, write_sst2, write_timm_checkpoint
from luna_convert.errors import LunaConvertError

CLASSES = ("cat", "dog", "fox")


def write_jpeg_folder(folder: Path, per_class: int = 4) -> Path:
    """An ImageFolder of small JPEGs (train/ and val/), three classes."""
    from PIL import Image

    for split, n in (("train", per_class), ("val", per_class // 2)):
        for c, name in enumerate(CLASSES):
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (32, 32), (80 * c, 40 * i, 200 - 60 * c)).save(folder / split / name / f"{i}.jpg")
    return folder


def truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # PIL's verify() still passes it; decoding fails
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import transformers
    from transformers.utils import logging as hf_logging

    from luna_convert.conversion import convert
    from luna_convert.serialization import save

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("input-checks")
    w = {"root": root, "bert": write_bert_checkpoint(root / "bert"), "sst2": write_sst2(root / "SST-2"),
         "vit": write_timm_checkpoint(root / "vit"), "file": root / "a-file.txt"}
    w["file"].write_text("not a folder\n")
    model = transformers.BertForSequenceClassification.from_pretrained(w["bert"])
    convert(model, "t2r")
    w["converted"] = save(model, root / "converted", tokenizer=transformers.AutoTokenizer.from_pretrained(w["bert"]),
                          extra={"task": "sst2"})
    return w


def run_args(model, data, out: Path, *extra, task: str | None = "sst2") -> list:
    task_args = ["--task", task] if task else []
    return ["run", "--model", model, *task_args, "--data-dir", data, "--max-steps", "1", "--batch-size", "8",
            "--method", "t2r", "--output-dir", out, *extra]


def refused(args: list, message: str, out: Path | None = None, alone: bool = True) -> str:
    """The one error line of a refused command; ``out``: no run folder was written there; ``alone``: the only
    line on stderr (else a progress bar of the run that was under way may come before it)."""
    line = cli_error_line(invoke_cli(*args), alone=alone)
    assert message in line, line
    if out is not None:
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    return line


def finished(args: list):
    result = invoke_cli(*args)
    assert result.exit_code == 0, (result.output[-3000:], repr(result.exception))
    return result


def only_run(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


# ----------------------------------------------------------------------------------- images
@pytest.mark.parametrize("split", ["train", "val"])
def test_a_truncated_jpeg_is_named_before_anything_is_written(world, tmp_path, split):
    images = write_jpeg_folder(tmp_path / "images")
    bad = truncate(images / split / "dog" / "1.jpg")
    line = refused(run_args(world["vit"], images, tmp_path / "out", task="image-classification"),
                   f"cannot decode image {bad}", tmp_path / "out")
    assert "--skip-unreadable-images" in line


def test_several_unreadable_images_are_counted_and_named(world, tmp_path):
    images = write_jpeg_folder(tmp_path / "images")
    for name in CLASSES:
        truncate(images / "train" / name / "0.jpg")
    (images / "train" / "cat" / "junk.png").write_bytes(b"not an image at all")
    line = refused(run_args(world["vit"], images, tmp_path / "out", task="image-classification"),
                   "cannot decode 4 of 13 images: ", tmp_path / "out")
    assert str(images / "train" / "cat" / "0.jpg") in line and "and 1 more" in line


def test_skip_unreadable_images_leaves_them_out_and_says_how_many(world, tmp_path):
    images = write_jpeg_folder(tmp_path / "images")
    truncate(images / "train" / "dog" / "1.jpg")
    truncate(images / "val" / "fox" / "0.jpg")
    result = finished(run_args(world["vit"], images, tmp_path / "out", "--skip-unreadable-images",
                               task="image-classification"))
    assert "skipped 2 unreadable image(s)" in result.stdout
    results = json.loads((only_run(tmp_path / "out") / "results.json").read_text())
    assert results["eval_examples"] == 5  # 6 validation images, one left out
    assert json.loads((only_run(tmp_path / "out") / "config.json").read_text())["skip_unreadable_images"] is True


def test_above_the_decode_limit_a_bad_image_is_named_when_read_and_the_run_resumes(world, tmp_path, monkeypatch):
    """A split larger than DECODE_ALL_UP_TO is not decoded up front: the image that fails is named when the run
    reads it, the run folder stays a resumable run, and after the file is replaced --resume finishes it."""
    import luna_convert.data.images as images_module

    monkeypatch.setattr(images_module, "DECODE_ALL_UP_TO", 0)
    images = write_jpeg_folder(tmp_path / "images")
    bad = images / "val" / "fox" / "1.jpg"
    good = bad.read_bytes()
    truncate(bad)
    out = tmp_path / "out"
    refused(run_args(world["vit"], images, out, task="image-classification"), f"cannot decode image {bad}",
            alone=False)
    run_dir = only_run(out)
    assert (run_dir / "config.json").is_file() and not (run_dir / "results.json").exists()
    bad.write_bytes(good)
    finished(["run", "--resume", run_dir])
    assert json.loads((run_dir / "results.json").read_text())["eval_examples"] == 6


# ----------------------------------------------------------------------------- text files
def test_a_csv_in_another_encoding_names_the_line_and_encoding_reads_it(world, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = "text,label\n" + "".join(f"{w} movie,{i % 2}\n" for i, w in enumerate(["good", "bad", "fine", "awful"] * 3))
    (data / "train.csv").write_text(rows, encoding="utf-8")
    (data / "dev.csv").write_bytes((rows + "caf\u00e9 plot,1\n").encode("cp1252"))
    out = tmp_path / "out"
    line = refused(run_args(world["bert"], data, out, task=None), f"{data / 'dev.csv'} is not UTF-8 text: line 14",
                   out)
    assert "--encoding" in line
    finished(run_args(world["bert"], data, out, "--encoding", "cp1252", task=None))
    assert json.loads((only_run(out) / "config.json").read_text())["encoding"] == "cp1252"


def test_a_glue_tsv_in_latin1(world, tmp_path):
    data = shutil.copytree(world["sst2"], tmp_path / "SST-2")
    with open(data / "train.tsv", "ab") as f:
        f.write("the na\u00efve plot\t1\n".encode("latin-1"))
    out = tmp_path / "out"
    refused(run_args(world["bert"], data, out), "train.tsv is not UTF-8 text: line 50", out)
    refused(run_args(world["bert"], data, out, "--encoding", "klingon"), "encoding must be a text encoding", out)
    finished(run_args(world["bert"], data, out, "--encoding", "latin-1"))


def test_eval_reads_data_in_another_encoding_with_encoding(world, tmp_path):
    data = shutil.copytree(world["sst2"], tmp_path / "SST-2")
    with open(data / "dev.tsv", "ab") as f:
        f.write("the na\u00efve plot\t1\n".encode("latin-1"))
    args = ["eval", world["converted"], "--data-dir", data]
    refused(args, "dev.tsv is not UTF-8 text: line 22")
    assert "(21 examples)" in " ".join(finished([*args, "--encoding", "latin-1"]).stdout.split())


def test_a_utf8_byte_order_mark_is_dropped_whatever_encoding_is_named(tmp_path):
    from luna_convert.data import read_table, text_encoding

    path = tmp_path / "train.csv"
    path.write_bytes("sentence,label\ngood,1\n".encode("utf-8-sig"))
    for encoding in (None, "utf-8", "utf-8-sig"):
        with text_encoding(encoding):
            assert list(read_table(path)) == ["sentence", "label"], encoding


@pytest.mark.parametrize("name", ["train.jsonl", "train.json"])
def test_json_nested_too_deeply_is_one_line(tmp_path, name):
    from luna_convert.data import read_table

    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(LunaConvertError, match="line 1 nests too deeply to read"):
        read_table(path)


def own_data(tmp_path: Path, train: str) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text(train)
    (data / "dev.csv").write_text("text,label\ngood movie,1\nbad film,0\n")
    return data


def test_an_empty_train_csv_is_called_empty(world, tmp_path):
    data = own_data(tmp_path, "")
    refused(run_args(world["bert"], data, tmp_path / "out", task=None), f"{data / 'train.csv'} is empty",
            tmp_path / "out")


def test_a_csv_row_with_an_extra_field_is_named(world, tmp_path):
    data = own_data(tmp_path, "text,label\ngood movie,1\nthe plot, it was bad,0\nfine,1\n")
    refused(run_args(world["bert"], data, tmp_path / "out", task=None),
            f"{data / 'train.csv'}: row 2 (line 3) has 3 fields but the header has 2; a text holding a comma must be "
            "quoted", tmp_path / "out")


# ------------------------------------------------------------------------------- output
def test_an_output_dir_that_is_a_file(world, tmp_path):
    refused(run_args(world["bert"], world["sst2"], world["file"]), f"{world['file']} is a file; choose another "
            "--output-dir")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_an_output_dir_that_cannot_be_written(world, tmp_path):
    """/proc takes no new files, even from root (who may write into a folder whose mode forbids it)."""
    refused(run_args(world["bert"], world["sst2"], "/proc/luna-convert-out"), "/proc is not writable")


# ------------------------------------------------------------------------- model folders
def damaged_run(world, tmp_path: Path, file: str, content) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(world["converted"], run_dir / "model")
    (run_dir / "config.json").write_text(json.dumps({"model": str(world["bert"]), "method": "t2r", "train": {},
                                                     "task": "sst2"}))
    target = run_dir / "model" / file
    target.write_text(content(json.loads(target.read_text())) if callable(content) else content)
    return run_dir


def eval_args(world, run_dir: Path) -> list:
    return ["eval", run_dir, "--data-dir", world["sst2"]]


@pytest.mark.parametrize("file, content, message", [
    ("config.json", "{\"model_type\": \"bert\", ", "model/config.json is corrupt (JSONDecodeError"),
    ("config.json", lambda c: json.dumps({k: v for k, v in c.items() if k != "model_type"}),
     "model/config.json: field 'model_type' is missing"),
    ("linear_attention.json", lambda m: json.dumps({k: v for k, v in m.items() if k != "model"}),
     "model/linear_attention.json: field 'model' is missing"),
    ("linear_attention.json", lambda m: json.dumps({**m, "conversion": {**m["conversion"], "targets": 3}}),
     "field 'conversion.targets' is missing or not a list"),
    ("linear_attention.json", lambda m: json.dumps({**m, "format_version": 99}),
     "model was saved by a newer luna-convert (format_version 99; this version reads up to 1)"),
], ids=["config corrupt", "config without model_type", "no model key", "targets not a list", "newer format"])
def test_a_damaged_model_folder_is_named_with_its_field(world, tmp_path, file, content, message):
    from luna_convert.serialization import load

    run_dir = damaged_run(world, tmp_path, file, content)
    refused(eval_args(world, run_dir), message)
    with pytest.raises(LunaConvertError, match=re.escape(message)):
        load(run_dir)


def flip_bytes(weights: Path) -> None:
    """Damage the tensor data, not the header: size and header stay intact."""
    data = bytearray(weights.read_bytes())
    for i in range(len(data) - 400, len(data) - 300):
        data[i] ^= 0xFF
    weights.write_bytes(bytes(data))


def test_flipped_bytes_in_the_weights_are_found_by_the_recorded_digest(world, tmp_path):
    from luna_convert.serialization import load

    run_dir = damaged_run(world, tmp_path, "README", "")
    flip_bytes(run_dir / "model" / "model.safetensors")
    refused(eval_args(world, run_dir), f"{run_dir / 'model' / 'model.safetensors'} does not match the SHA-256 "
            "recorded when it was saved")
    with pytest.raises(LunaConvertError, match="does not match the SHA-256"):
        load(run_dir)


def test_a_folder_saved_before_the_digest_loads_with_a_note(world, tmp_path, caplog):
    import torch

    from luna_convert.serialization import load

    run_dir = damaged_run(world, tmp_path, "linear_attention.json",
                          lambda m: json.dumps({k: v for k, v in m.items() if k != "weights_sha256"}))
    with caplog.at_level(logging.WARNING, logger="luna_convert.serialization"):
        model = load(run_dir)
    (note,) = [r.getMessage() for r in caplog.records if r.name == "luna_convert.serialization"]
    assert "has no recorded SHA-256 (saved by an older luna-convert)" in note and "\n" not in note
    reference = load(world["converted"])
    inputs = {"input_ids": torch.tensor([[2, 7, 9, 3]])}
    assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
    assert invoke_cli(*eval_args(world, run_dir)).exit_code == 0


def test_save_onto_a_folder_in_use_names_the_python_argument(world, tmp_path):
    from luna_convert.serialization import load, save

    target = shutil.copytree(world["converted"], tmp_path / "model")
    with pytest.raises(LunaConvertError, match=r"pass overwrite=True") as raised:
        save(load(world["converted"]), target)
    assert "--overwrite" not in str(raised.value)


# --------------------------------------------------------------------------- --max-steps 0
def test_max_steps_0_means_no_finetuning(world, tmp_path):
    from luna_convert.cli import app
    from typer.testing import CliRunner

    help_text = " ".join(CliRunner().invoke(app, ["run", "--help"]).output.split())
    assert "0: no finetuning" in help_text
    result = finished(run_args(world["bert"], world["sst2"], tmp_path / "out", "--max-steps", "0"))
    assert "no finetuning (train.max_steps 0)" in result.stdout
    results = json.loads((only_run(tmp_path / "out") / "results.json").read_text())
    assert results["steps"]["finetune"] == 0
    assert results["converted_score"] == results["stage_scores"]["after_conversion"]


# ----------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_names_the_run_folder_to_resume(world, tmp_path, monkeypatch):
    import luna_convert.run.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "score", interrupted)  # Ctrl-C while the original model is scored
    result = invoke_cli(*run_args(world["bert"], world["sst2"], tmp_path / "out"))
    run_dir = only_run(tmp_path / "out")
    assert result.exit_code == 130
    assert result.stderr.strip() == f"interrupted; resume with: luna-convert run --resume {run_dir}"


def test_ctrl_c_before_the_run_folder_exists_offers_nothing_to_resume(world, tmp_path, monkeypatch):
    import luna_convert.run.preflight as preflight

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "load_model", interrupted)
    result = invoke_cli(*run_args(world["bert"], world["sst2"], tmp_path / "out"))
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted"
    assert not (tmp_path / "out").exists()
