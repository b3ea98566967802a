"""Long Range Arena data: the generators are deterministic, label what they draw correctly (checked against
evaluations written here independently: hand-evaluated ListOps expressions and a recursive evaluator; a flood fill
over each Pathfinder image), keep LRA's length distribution, and the user-folder readers read what they say."""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from luna_convert.errors import LunaConvertError
from luna_convert.lra import folders, listops, pathfinder
from luna_convert.lra.config import DataSettings
from luna_convert.lra.data import build_splits, cache_key, generator_settings

SHARED_CIFAR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-small"


# ------------------------------------------------------------------ ListOps
@pytest.mark.parametrize("expression, value", [
    ("[MAX 4 3 [MIN 2 3 ] 1 0 ]", 4),  # MIN(2, 3) = 2; MAX(4, 3, 2, 1, 0) = 4
    ("[MED 1 5 8 9 2 ]", 5),  # sorted 1 2 5 8 9
    ("[MED 3 1 4 2 ]", 2),  # sorted 1 2 3 4: the middle two 2, 3 -> floor(2.5) = 2
    ("[SM 9 8 [MAX 1 7 ] ]", 4),  # 9 + 8 + 7 = 24 -> 4
    ("[MIN [SM 5 5 ] [MAX 3 9 ] ]", 0),  # SM: 10 mod 10 = 0; MIN(0, 9) = 0
    ("[MAX [MED [SM 1 2 ] 7 [MIN 8 6 ] ] 2 ]", 6),  # SM 3; MIN 6; MED(3, 7, 6) = 6; MAX(6, 2) = 6
    ("7", 7),
])
def test_listops_values_of_hand_evaluated_expressions(expression, value):
    assert listops.evaluate(expression.split()) == value


def reference_value(tokens: list[str], at: int = 0) -> tuple[int, int]:
    """(value, next index) by recursive descent, the median from the statistics module rounded down."""
    token = tokens[at]
    if token.isdigit():
        return int(token), at + 1
    args, at = [], at + 1
    while tokens[at] != "]":
        value, at = reference_value(tokens, at)
        args.append(value)
    ops = {"[MAX": max, "[MIN": min, "[SM": lambda a: sum(a) % 10, "[MED": lambda a: math.floor(statistics.median(a))}
    return ops[token](args), at + 1


def depth_and_widest(tokens: list[str]) -> tuple[int, int]:
    depth = deepest = widest = 0
    counts = []
    for token in tokens:
        if counts and token != "]":
            counts[-1] += 1
        if token.startswith("["):
            depth += 1
            deepest = max(deepest, depth)
            counts.append(0)
        elif token == "]":
            depth -= 1
            widest = max(widest, counts.pop())
    return deepest, widest


def test_listops_labels_lengths_depth_and_arguments():
    sequences, labels = listops.generate(200, seed=5)
    lengths = np.array([len(s) for s in sequences])
    for ids, label in zip(sequences, labels):
        tokens = listops.decode(ids)
        value, end = reference_value(tokens)
        assert end == len(tokens) and value == label
        deepest, widest = depth_and_widest(tokens)
        assert deepest <= 10 and 2 <= widest <= 10
    # LRA's range, spread over it (measured on this seed: median 986, 25 % above 1,330)
    assert lengths.min() >= 500 and lengths.max() <= 2000
    assert 750 <= np.median(lengths) <= 1300 and (lengths > 1500).mean() >= 0.05
    assert set(labels.tolist()) == set(range(10))  # every class occurs


def test_listops_generation_is_deterministic():
    a, la = listops.generate(20, seed=3)
    b, lb = listops.generate(20, seed=3)
    c, _ = listops.generate(20, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and np.array_equal(la, lb)
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))


def test_listops_keeps_a_short_range_when_asked():
    sequences, _ = listops.generate(30, seed=0, settings=listops.ListOpsSettings(min_length=100, max_length=300))
    assert all(100 <= len(s) <= 300 for s in sequences)


# ------------------------------------------------------------------ Pathfinder
def flood_fill(image: np.ndarray, start: tuple[int, int], reach: int) -> set[tuple[int, int]]:
    """Every drawn pixel joined to ``start`` through drawn pixels at most ``reach`` apart (Chebyshev)."""
    seen, queue = {start}, deque([start])
    while queue:
        y, x = queue.popleft()
        for dy in range(-reach, reach + 1):
            for dx in range(-reach, reach + 1):
                p = (y + dy, x + dx)
                if 0 <= p[0] < image.shape[0] and 0 <= p[1] < image.shape[1] and image[p] and p not in seen:
                    seen.add(p)
                    queue.append(p)
    return seen


def marks(image: np.ndarray) -> list[tuple[int, int]]:
    """The centres of the two dots: marked pixels whose four neighbours are marked too (or that sit nearest)."""
    marked = {tuple(p) for p in np.argwhere(image == pathfinder.MARK)}
    groups = []
    for p in sorted(marked):
        if not any(max(abs(p[0] - q[0]), abs(p[1] - q[1])) <= 2 for g in groups for q in g):
            groups.append([p])
        else:
            next(g for g in groups if any(max(abs(p[0] - q[0]), abs(p[1] - q[1])) <= 2 for q in g)).append(p)
    return [g[0] for g in groups]


def test_flood_fill_bridges_a_dash_gap_but_not_a_wider_one():
    image = np.zeros((5, 9), dtype=np.uint8)
    image[2, [0, 1, 3, 4]] = 1  # a gap of one pixel
    image[2, [7, 8]] = 1  # two pixels further on
    assert flood_fill(image, (2, 0), reach=2) == {(2, 0), (2, 1), (2, 3), (2, 4)}


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_pathfinder_labels_agree_with_a_flood_fill(difficulty):
    settings = pathfinder.PathfinderSettings(difficulty=difficulty)
    sequences, labels = pathfinder.generate(60, seed=difficulty, settings=settings)
    assert labels.sum() == 30  # balanced
    curves = pathfinder.DIFFICULTIES[difficulty][0]
    for seq, label in zip(sequences, labels):
        image = seq.reshape(32, 32)
        assert seq.dtype == np.uint8 and seq.shape == (1024,)
        a, b = marks(image)
        joined = flood_fill(image, a, reach=settings.gap + 1)
        assert (b in joined) == bool(label)
        # as many separate curves as the difficulty draws, whatever the label
        left, pieces = {tuple(p) for p in np.argwhere(image > 0)}, 0
        while left:
            left -= flood_fill(image, next(iter(left)), reach=settings.gap + 1)
            pieces += 1
        assert pieces == curves


def test_pathfinder_generation_is_deterministic():
    a, la = pathfinder.generate(10, seed=7)
    b, lb = pathfinder.generate(10, seed=7)
    c, _ = pathfinder.generate(10, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and np.array_equal(la, lb)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


# ------------------------------------------------------------------ splits and the cache
def test_generated_splits_are_cached_and_read_back_identically(tmp_path):
    data = DataSettings(train_examples=12, dev_examples=4, test_examples=5, min_length=50, max_length=120)
    first = build_splits("listops", data, cache_dir=tmp_path)
    files = sorted(tmp_path.glob("listops-*.npz"))
    assert len(files) == 3
    again = build_splits("listops", data, cache_dir=tmp_path)
    for name in ("train", "dev", "test"):
        assert all(np.array_equal(x, y) for x, y in zip(first[name].sequences, again[name].sequences))
        assert np.array_equal(first[name].labels, again[name].labels)
    # the three splits are different draws; another length range is another cache entry
    assert not np.array_equal(first["train"].sequences[0][:50], first["test"].sequences[0][:50])
    wider = DataSettings(min_length=50, max_length=130)
    assert cache_key("listops", generator_settings("listops", wider), 12, 1) != \
        cache_key("listops", generator_settings("listops", data), 12, 1)


# ------------------------------------------------------------------ user folders
def write_images(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 5), ("val", 2)):
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / split / cls / f"{i}.png")


def test_image_folder_becomes_grayscale_pixel_rows(tmp_path):
    from PIL import Image

    write_images(tmp_path)
    sequences, labels, names = folders.read_image_split(tmp_path, "test")  # val/ is the test split
    assert names == ["cat", "dog"] and labels.tolist() == [0, 0, 1, 1]
    rgb = np.asarray(Image.open(tmp_path / "val" / "dog" / "1.png"), dtype=np.float64)
    # ITU-R 601-2 luma, as PIL's "L" conversion computes it (rounded)
    luma = rgb[..., 0] * 299 / 1000 + rgb[..., 1] * 587 / 1000 + rgb[..., 2] * 114 / 1000
    assert np.abs(sequences[3].astype(np.float64) - luma.reshape(-1)).max() <= 1
    data = DataSettings(train_examples=None, dev_examples=None, test_examples=None, dev_fraction=0.2)
    splits = build_splits("image", data, tmp_path)
    assert (len(splits["train"]), len(splits["dev"]), len(splits["test"])) == (8, 2, 4)  # dev held out of train


def test_the_shared_cifar_folder_reads_as_ten_classes_of_1024_pixels():
    if not SHARED_CIFAR.is_dir():
        pytest.skip(f"needs the real CIFAR-10 images in {SHARED_CIFAR}")
    sequences, labels, names = folders.read_image_split(SHARED_CIFAR, "test")
    assert len(names) == 10 and len(sequences) == 2000 and np.bincount(labels).tolist() == [200] * 10
    assert {s.shape for s in sequences} == {(1024,)}


def test_text_and_retrieval_folders(tmp_path):
    for split in ("train", "test"):
        for cls, words in (("neg", "bad"), ("pos", "good")):
            (tmp_path / "imdb" / split / cls).mkdir(parents=True)
            (tmp_path / "imdb" / split / cls / "0.txt").write_text(f"{words} café " * 3)
    (tmp_path / "imdb" / "train" / "unsup").mkdir()  # aclImdb's unlabelled reviews: not a class
    sequences, labels, names = folders.read_text_split(tmp_path / "imdb", "train", max_bytes=10)
    assert names == ["neg", "pos"] and labels.tolist() == [0, 1]
    assert bytes(sequences[0]) == "bad café ".encode()[:10] and len(sequences[1]) == 10
    (tmp_path / "aan").mkdir()
    (tmp_path / "aan" / "train.tsv").write_text("label\tid1\tid2\ttext1\ttext2\n1\ta\tb\tone\ttwo\n0\tc\td\tx\ty\n")
    first, second, labels = folders.read_retrieval_split(tmp_path / "aan", "train", 4096)
    assert [bytes(s) for s in first] == [b"one", b"x"] and [bytes(s) for s in second] == [b"two", b"y"]
    assert labels.tolist() == [1, 0]
    with pytest.raises(LunaConvertError, match="no test file"):
        folders.read_retrieval_split(tmp_path / "aan", "test", 4096)
    with pytest.raises(LunaConvertError, match="pass --data-dir"):
        folders.read_text_split(None, "train", 4096)
