"""A tuning split held out of an ImageFolder's train/: a new folder whose train/ has 9 of every 10
images of each class and whose val/ has the tenth (symbolic links, sorted file names, every tenth from
the tenth on). A teacher trained on its train/ has never seen its val/, so finetuning settings can be
chosen there and the chosen ones reported on the original val/ (docs/quality.md, section 8).

    python benchmarks/holdout_split.py ../shared/data/cifar10-small/train outputs/cifar-tune/data
    luna-convert compare cifar-vit --data-dir outputs/cifar-tune/data --output-dir outputs/cifar-tune --methods luna --set train.lr=2.0e-4
"""

from __future__ import annotations

import argparse
from pathlib import Path


def holdout_split(train_dir: Path, out_dir: Path, every: int = 10) -> tuple[int, int]:
    """Link the images of ``train_dir`` into ``out_dir``/train and ``out_dir``/val; returns the counts."""
    if out_dir.exists():
        raise SystemExit(f"error: {out_dir} exists; pass a new folder")
    counts = [0, 0]
    for class_dir in sorted(p for p in train_dir.iterdir() if p.is_dir()):
        for index, image in enumerate(sorted(p for p in class_dir.iterdir() if p.is_file())):
            held_out = index % every == every - 1
            target = out_dir / ("val" if held_out else "train") / class_dir.name / image.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(image.resolve())
            counts[held_out] += 1
    return counts[0], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_dir", type=Path, help="an ImageFolder's train/ (one folder per class)")
    parser.add_argument("out_dir", type=Path, help="the new folder (train/ and val/ of links)")
    parser.add_argument("--every", type=int, default=10, help="hold out one image in this many")
    args = parser.parse_args()
    train, val = holdout_split(args.train_dir, args.out_dir, args.every)
    print(f"{args.out_dir}: {train} training and {val} held-out images")


if __name__ == "__main__":
    main()
