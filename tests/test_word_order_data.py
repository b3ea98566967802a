"""benchmarks/make_word_order_data.py on a tiny made-up SST-2 folder: balanced labels, changed sentences that
are the originals' words in another order, no sentence in both splits, seeded, and a folder `run` reads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_word_order_data.py"
spec = importlib.util.spec_from_file_location("make_word_order_data", SCRIPT)
word_order = importlib.util.module_from_spec(spec)
spec.loader.exec_module(word_order)

WORDS = "the a film movie plot is was very not good bad dull funny actor story ends".split()


def write_source(folder: Path, n_train: int = 60, n_dev: int = 20, shared: int = 5) -> Path:
    import random

    rng = random.Random(1)
    make = lambda: " ".join(rng.choices(WORDS, k=rng.randint(5, 10))) + (" , but " + " ".join(
        rng.choices(WORDS, k=3)) if rng.random() < 0.5 else "")
    dev = [make() for _ in range(n_dev)]
    train = [make() for _ in range(n_train)] + dev[:shared] + ["too short here", dev[0]]  # overlap + a duplicate
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{rng.randint(0, 1)}\n" for s in rows))
    return folder


def read(path: Path) -> list[tuple[str, int]]:
    header, *rows = path.read_text().splitlines()
    assert header == "sentence\tlabel"
    return [(s, int(y)) for s, y in (row.split("\t") for row in rows)]


def test_balanced_changed_in_order_only_and_no_sentence_in_both_splits(tmp_path):
    src = write_source(tmp_path / "SST-2")
    counts = word_order.make_word_order_data(src, tmp_path / "out", seed=3)
    train, dev = read(tmp_path / "out" / "train.tsv"), read(tmp_path / "out" / "dev.tsv")
    assert counts == {"train": len(train), "dev": len(dev)} and len(train) >= 40 and len(dev) >= 16
    for rows in (train, dev):
        assert Counter(y for _, y in rows) == {0: len(rows) // 2, 1: len(rows) // 2}  # balanced
    originals = set(word_order.read_sentences(src / "train.tsv", 5)) | set(word_order.read_sentences(
        src / "dev.tsv", 5))
    by_words = {}
    for sentence in originals:
        by_words.setdefault(tuple(sorted(sentence.split())), set()).add(sentence)
    for sentence, label in train + dev:
        if label:
            assert sentence in originals
        else:  # the words of an original, in another order, and no original itself
            assert sentence not in originals and by_words.get(tuple(sorted(sentence.split())))
    dev_sources = {s for s in originals if tuple(sorted(s.split())) in {tuple(sorted(d.split())) for d, _ in dev}}
    train_sources = {s for s in originals if tuple(sorted(s.split())) in {tuple(sorted(t.split())) for t, _ in train}}
    assert not dev_sources & train_sources  # held out: the dev sentences (and their changes) never in train
    assert all(len(s.split()) >= 5 for s, _ in train + dev)
    assert len({s for s, _ in train}) == len(train)  # the duplicate source row gave one example


def test_the_changes_are_a_swap_or_a_moved_clause_and_the_folder_is_seeded(tmp_path):
    import random

    rng = random.Random(0)
    assert word_order.move_clause("it is good , but the plot is dull".split(), rng) in (
        "but the plot is dull , it is good".split(), "the plot is dull but it is good ,".split())
    assert word_order.move_clause("it is good".split(), rng) is None
    moved = word_order.move_clause("it is good , the plot is dull".split(), rng)
    assert moved == "the plot is dull , it is good".split()
    swapped = word_order.swap_two_words("a b c d".split(), rng)
    assert sorted(swapped) == list("abcd") and sum(x != y for x, y in zip(swapped, "abcd")) == 2
    assert word_order.swap_two_words("a a a".split(), rng) is None
    for seed in range(20):  # a change is never the sentence itself, nor another original
        assert word_order.change_order("x , x", random.Random(seed)) not in (None, "x , x")
        rows = word_order.make_split(["p q", "r s", "t u"], random.Random(seed), {"p q", "q p", "r s", "t u"}, None)
        assert not [s for s, y in rows if y == 0 and s in {"p q", "q p", "r s", "t u"}]
        assert sum(y for _, y in rows) * 2 == len(rows)
    src = write_source(tmp_path / "SST-2")
    for out, seed in (("one", 3), ("two", 3), ("three", 4)):
        subprocess.run([sys.executable, str(SCRIPT), str(src), str(tmp_path / out), "--seed", str(seed)], check=True,
                       capture_output=True)
    same = [(tmp_path / n / "train.tsv").read_text() for n in ("one", "two", "three")]
    assert same[0] == same[1] != same[2]


def test_luna_convert_reads_the_folder_as_a_text_classification(tmp_path):
    from luna_convert.run.autoconfig import resolve_own_data
    from luna_convert.run.config import RunConfig
    from luna_convert.run.models import load_model
    from builders import write_bert_checkpoint

    src = write_source(tmp_path / "SST-2")
    word_order.make_word_order_data(src, tmp_path / "out")
    model = write_bert_checkpoint(tmp_path / "bert", words=WORDS + [",", "but"])
    config = RunConfig(model=str(model), data_dir=str(tmp_path / "out"), method="elu")
    config.train.max_length = 64
    resolve_own_data(config, load_model(str(model)))
    assert config.task == "text-classification" and config.resolved["data"]["eval_split"] in ("dev", "validation")
    assert config.resolved["data"]["train_split"] == "train"
