"""Property-based fuzz of the data loaders, in-process through the command line's error mapping: random bytes,
text in several encodings with and without byte-order marks, ragged rows, empty files, huge fields, JSON of any
shape, and images of odd modes, sizes and formats (some truncated). Every case either loads (each row aligned to
the model's labels, each image decoded and transformed) or ends in exit code 2 with one line; an exception that
escapes as a bug (exit 1) or a traceback fails the test with the case that caused it."""

from __future__ import annotations

import csv
import io
import json
import warnings
import tempfile
from pathlib import Path
from typing import Optional

import typer
from hypothesis import HealthCheck, event, given, settings, strategies as st
from typer.testing import CliRunner

from luna_convert import data, task_kinds
from luna_convert.cli import DefaultRunGroup, _guard
from luna_convert.tasks import get_task

ID2LABEL = {0: "negative", 1: "positive"}
fuzz_app = typer.Typer(cls=DefaultRunGroup, add_completion=False)


@fuzz_app.command("load")
def load_command(kind: str, folder: Path, encoding: Optional[str] = typer.Option(None, "--encoding")) -> None:
    _guard(lambda: load_everything(kind, folder, encoding))


@fuzz_app.command("nothing")
def _nothing() -> None:  # a second command keeps the app a group, so DefaultRunGroup's mapping applies
    pass


def load_everything(kind: str, folder: Path, encoding: str | None) -> None:
    """What a run does with a split before training: read it, align its labels, decode and transform images."""
    if kind == "image":
        task = get_task("image-classification")
        dataset, _ = data.readable_images(task_kinds.load_split(task, "train", folder), skip=True)
        transform = data.image_transform([0.5] * 3, [0.5] * 3, 16, train=False)
        for i in range(len(dataset)):
            transform(dataset[i][0])
        return
    task = get_task("sst2" if kind == "glue" else "text-classification")
    with data.text_encoding(encoding):
        dataset = task_kinds.load_split(task, "train", folder)
    task_kinds.align_labels(dataset, task, ID2LABEL, 2)


# ------------------------------------------------------------------------------ strategies
ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "cp1252", "latin-1"]
field = st.one_of(st.text(max_size=12), st.sampled_from(["0", "1", "positive", "negative", "", "\"", ",", "\t",
                                                          "\n", "\r\n", "\x00", "x" * 200_000]))
plain = st.text(st.characters(blacklist_characters="\t\r\n", blacklist_categories=("Cs",)), max_size=12)
good_row = st.tuples(st.one_of(plain, plain, plain, st.just("word " * 40_000)), st.sampled_from(["0", "1"])).map(list)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=8)


@st.composite
def table_file(draw, extensions=(".csv", ".tsv", ".jsonl", ".json"),
               headers=(("sentence", "label"), ("text", "label"))):
    """(file name, bytes, --encoding given or None) of a table file: mostly well-formed for its kind (rows for
    csv and tsv, objects for JSON), in an encoding the reader is mostly told; else random bytes or empty."""
    ext = draw(st.sampled_from(extensions))
    shape = draw(st.sampled_from(["well-formed"] * 3 + ["ragged", "random bytes", "empty"]))
    if shape == "random bytes":
        return f"train{ext}", draw(st.binary(max_size=300)), None
    if shape == "empty":
        return f"train{ext}", draw(st.sampled_from([b"", b"\n\n", b"\xef\xbb\xbf", b"text,label\n",
                                                    b"sentence\tlabel\n", b"[]", b"{}"])), None
    if ext in (".json", ".jsonl"):  # mostly records with a text and a label, some any JSON at all
        records = st.fixed_dictionaries({"text": plain, "label": st.sampled_from([0, 1, "0", "1"])})
        if shape == "ragged":
            records = st.one_of(json_value, st.fixed_dictionaries({"text": field, "label": st.one_of(
                st.integers(-2, 3), field)}))
        records = draw(st.lists(records, min_size=1, max_size=4))
        as_list = ext == ".json" and draw(st.booleans())
        text = json.dumps(records) if as_list else "\n".join(json.dumps(r) for r in records)
    elif shape == "ragged":
        header = draw(st.sampled_from([["sentence", "label"], ["label", "text", "extra"], ["a"], []]))
        lines = [header, *draw(st.lists(st.one_of(good_row, st.lists(field, max_size=4)), min_size=1, max_size=6))]
    else:
        header = list(draw(st.sampled_from(headers)))
        lines = [header, *draw(st.lists(good_row, min_size=1, max_size=6))]
    if ext not in (".json", ".jsonl"):
        if ext == ".csv":  # quoted where a field needs it
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator=draw(st.sampled_from(["\n", "\r\n"]))).writerows(lines)
            text = buffer.getvalue()
        else:
            text = "\n".join("\t".join(line) for line in lines)
    encoding = draw(st.sampled_from(["utf-8"] * 4 + ENCODINGS))
    content = text.encode(encoding, errors="replace")
    told = draw(st.sampled_from([None, encoding, encoding, draw(st.sampled_from(ENCODINGS))]))
    return f"train{ext}", content, told


MODES = ["1", "L", "P", "RGB", "RGBA", "CMYK", "I", "I;16", "F", "LA", "YCbCr"]
FORMATS = {"PNG": ".png", "JPEG": ".jpg", "BMP": ".bmp", "GIF": ".gif", "TIFF": ".tif", "WEBP": ".webp",
           "PPM": ".ppm"}


@st.composite
def image_file(draw):
    """(file name, bytes) of an image: a drawn mode, size and format, sometimes cut short, or random bytes."""
    from PIL import Image

    fmt = draw(st.sampled_from(sorted(FORMATS)))
    if draw(st.integers(0, 5)) == 0:
        return f"x{FORMATS[fmt]}", draw(st.binary(max_size=200))
    mode = draw(st.sampled_from(MODES))
    size = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    buffer = io.BytesIO()
    try:
        Image.new(mode, size, draw(st.integers(0, 255))).save(buffer, format=fmt)
    except (OSError, ValueError, KeyError):  # PIL cannot write this mode in this format; TIFF takes every mode
        fmt, buffer = "TIFF", io.BytesIO()
        Image.new(mode, size).save(buffer, format=fmt)
    content = buffer.getvalue()
    cut = draw(st.sampled_from([None, None, 0.9, 0.5, 0.1]))
    return f"x{FORMATS[fmt]}", content if cut is None else content[: int(len(content) * cut)]


case = st.one_of(
    st.tuples(st.just("table"), table_file()),
    st.tuples(st.just("glue"), table_file([".tsv"], [("sentence", "label")])),
    st.tuples(st.just("image"), st.lists(image_file(), min_size=1, max_size=3)),
)


def write_case(kind: str, spec, folder: Path) -> list[str]:
    if kind == "image":
        for i, (name, content) in enumerate(spec):
            target = folder / "train" / ("a", "b")[i % 2] / f"{i}{name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        return []
    name, content, encoding = spec
    (folder / name).write_bytes(content)
    return ["--encoding", encoding] if encoding else []


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                       HealthCheck.data_too_large])
@given(case)
def test_every_data_file_loads_or_gets_one_line_and_exit_2(example):
    kind, spec = example
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        options = write_case(kind, spec, folder)
        with warnings.catch_warnings(record=True) as warned:  # the command line would print each on stderr
            warnings.simplefilter("always")
            result = CliRunner().invoke(fuzz_app, ["load", kind, str(folder), *options])
        assert not warned, [str(w.message) for w in warned]
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        event(f"{kind}: exit {result.exit_code}")  # pytest --hypothesis-show-statistics: how the cases ended
        assert result.exit_code in (0, 2), (result.exit_code, result.stderr[-1500:], repr(result.exception))
        assert "Traceback" not in result.output
        if result.exit_code == 2:
            errors = [line for line in lines if line.startswith("error: ")]
            assert len(errors) == 1 and len(lines) == 1, lines
