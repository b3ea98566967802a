"""A tuning split held out of a training set, so that finetuning settings can be chosen on data the
reported teacher never saw and the chosen ones reported on the original validation split
(docs/quality.md, sections 4 and 8). Every tenth example (sorted, from the tenth on) is held out.

An ImageFolder's train/: the new folder's train/ has 9 of every 10 images of each class and its val/
the tenth (symbolic links). A GLUE TSV folder (train.tsv): the new folder's train.tsv has 9 of every 10
rows and its dev.tsv the tenth (the header row in both).

    python benchmarks/holdout_split.py ../shared/data/cifar10-small/train outputs/cifar-tune/data
    luna-convert compare cifar-vit --data-dir outputs/cifar-tune/data --output-dir outputs/cifar-tune --methods luna --set train.lr=2.0e-4
    python benchmarks/holdout_split.py ../shared/data/glue/RTE outputs/rte-tune/data
    luna-convert compare minilm-rte --data-dir outputs/rte-tune/data --output-dir outputs/rte-tune --methods luna --set train.lr=5.0e-5
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path


def holdout_split(train_dir: Path, out_dir: Path, every: int = 10) -> tuple[int, int]:
    """Link the images of ``train_dir`` into ``out_dir``/train and ``out_dir``/val; returns the counts."""
    counts = [0, 0]
    for class_dir in sorted(p for p in train_dir.iterdir() if p.is_dir()):
        for index, image in enumerate(sorted(p for p in class_dir.iterdir() if p.is_file())):
            held_out = index % every == every - 1
            target = out_dir / ("val" if held_out else "train") / class_dir.name / image.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(image.resolve())
            counts[held_out] += 1
    return counts[0], counts[1]


def holdout_split_tsv(glue_dir: Path, out_dir: Path, every: int = 10,
                      shuffle_seed: int | None = None) -> tuple[int, int]:
    """Split ``glue_dir``/train.tsv into ``out_dir``/train.tsv and ``out_dir``/dev.tsv; returns the row counts.
    GLUE's TSVs hold one example per line (no quoting), so lines are rows. ``shuffle_seed``: take every
    ``every``-th row of a seeded shuffle instead, for files whose order follows the labels (the word-order
    task alternates them, so every tenth row would be one class)."""
    header, *rows = (glue_dir / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    order = list(range(len(rows)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    held = {index for position, index in enumerate(order) if position % every == every - 1}
    parts: list[list[str]] = [[header], [header]]
    for index, row in enumerate(rows):
        parts[index in held].append(row)
    out_dir.mkdir(parents=True)
    for name, part in zip(("train.tsv", "dev.tsv"), parts):
        (out_dir / name).write_text("".join(part), encoding="utf-8")
    names = header.rstrip("\n").split("\t")
    if "label" in names:  # the class balance of each part: a held-out part of one class tells nothing
        column = names.index("label")
        for name, part in zip(("train", "held-out"), parts):
            labels = Counter(row.rstrip("\n").split("\t")[column] for row in part[1:])
            print(f"{name} labels:", dict(sorted(labels.items())))
    return len(parts[0]) - 1, len(parts[1]) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="an ImageFolder's train/ (one folder per class), or a GLUE "
                        "TSV folder with train.tsv")
    parser.add_argument("out_dir", type=Path, help="the new folder")
    parser.add_argument("--every", type=int, default=10, help="hold out one example in this many")
    parser.add_argument("--shuffle-seed", type=int, help="GLUE TSV: hold out every N-th row of a seeded shuffle")
    args = parser.parse_args()
    if args.out_dir.exists():
        raise SystemExit(f"error: {args.out_dir} exists; pass a new folder")
    if (args.source / "train.tsv").is_file():
        train, held_out = holdout_split_tsv(args.source, args.out_dir, args.every, args.shuffle_seed)
    else:
        train, held_out = holdout_split(args.source, args.out_dir, args.every)
    print(f"{args.out_dir}: {train} training and {held_out} held-out examples")


if __name__ == "__main__":
    main()
