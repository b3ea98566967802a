"""The LRA tasks read from a user's folders: Image (CIFAR-10 as grayscale pixel sequences from an ImageFolder),
Text (byte-level classification) and Retrieval (byte-level document-pair matching).

Each reader returns (sequences, labels) for one split, sequences as uint8 arrays (pixel values or UTF-8
bytes); a missing folder or file is a one-line LunaConvertError that says what layout is expected.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

from ..errors import LunaConvertError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
# which folder names hold each split, in the order they are looked for
SPLIT_FOLDERS = {"train": ("train",), "test": ("test", "val", "validation"), "dev": ("dev", "valid")}
# aclImdb's train/unsup holds unlabelled reviews: not a class
SKIPPED_CLASS_FOLDERS = ("unsup",)
TEXT_LAYOUT = "train/<class>/*.txt and test/<class>/*.txt (e.g. IMDB's aclImdb folder)"
RETRIEVAL_LAYOUT = ("train.tsv and test.tsv (or the LRA release's *train.tsv / *test.tsv), rows "
                    "label<TAB>text1<TAB>text2 or label<TAB>id1<TAB>id2<TAB>text1<TAB>text2")


def split_folder(root: Path, split: str) -> Path | None:
    for name in SPLIT_FOLDERS[split]:
        if (root / name).is_dir():
            return root / name
    return None


def class_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name not in SKIPPED_CLASS_FOLDERS
                  and not p.name.startswith("."))


def need_folder(data_dir: str | Path | None, task: str, layout: str) -> Path:
    if data_dir is None:
        raise LunaConvertError(f"lra {task} reads your own data: pass --data-dir FOLDER holding {layout}")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise LunaConvertError(f"lra {task}: data folder {root} does not exist; pass --data-dir FOLDER holding {layout}")
    return root


def read_image_split(data_dir, split: str) -> tuple[list[np.ndarray], np.ndarray, list[str]]:
    """An ImageFolder split as 1,024-pixel grayscale sequences (images resized to 32 x 32 where they are not),
    row by row, with class ids in sorted class-name order, and the class names."""
    from PIL import Image

    layout = "train/<class>/*.png|jpg and val/<class>/ (or test/<class>/): an ImageFolder such as CIFAR-10's"
    root = need_folder(data_dir, "image", layout)
    folder = split_folder(root, split)
    if folder is None:
        raise LunaConvertError(f"lra image: {root} has no {' or '.join(SPLIT_FOLDERS[split])} folder; it must hold {layout}")
    classes = class_folders(folder)
    sequences, labels = [], []
    for label, class_dir in enumerate(classes):
        for path in sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                with Image.open(path) as image:
                    gray = image.convert("L")
                    if gray.size != (32, 32):
                        gray = gray.resize((32, 32), Image.BILINEAR)
                    sequences.append(np.asarray(gray, dtype=np.uint8).reshape(-1))
            except OSError as e:
                raise LunaConvertError(f"lra image: cannot read {path} ({e}); remove or replace it") from None
            labels.append(label)
    if not sequences:
        raise LunaConvertError(f"lra image: no images in {folder}; it must hold {layout}")
    return sequences, np.array(labels, dtype=np.int64), [c.name for c in classes]


def text_bytes(text: str, max_bytes: int) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8")[:max_bytes], dtype=np.uint8).copy()


def read_text_split(data_dir, split: str, max_bytes: int) -> tuple[list[np.ndarray], np.ndarray, list[str]]:
    """Class folders of text files as byte sequences (UTF-8, cut at ``max_bytes``)."""
    root = need_folder(data_dir, "text", TEXT_LAYOUT)
    folder = split_folder(root, split)
    if folder is None:
        raise LunaConvertError(f"lra text: {root} has no {' or '.join(SPLIT_FOLDERS[split])} folder; it must hold "
                               f"{TEXT_LAYOUT}")
    classes = class_folders(folder)
    sequences, labels = [], []
    for label, class_dir in enumerate(classes):
        for path in sorted(class_dir.glob("*.txt")):
            sequences.append(text_bytes(path.read_text(encoding="utf-8", errors="replace"), max_bytes))
            labels.append(label)
    if len(classes) < 2 or not sequences:
        raise LunaConvertError(f"lra text: {folder} needs at least two class folders of .txt files ({TEXT_LAYOUT})")
    return sequences, np.array(labels, dtype=np.int64), [c.name for c in classes]


def retrieval_file(root: Path, split: str) -> Path | None:
    for name in SPLIT_FOLDERS[split]:
        found = sorted(root.glob(f"{name}.tsv")) or sorted(root.glob(f"*{name}.tsv"))
        if found:
            return found[0]
    return None


def read_retrieval_split(data_dir, split: str, max_bytes: int
                         ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Document pairs of a TSV file as two byte sequences each (UTF-8, cut at ``max_bytes``) and 0/1 labels."""
    root = need_folder(data_dir, "retrieval", RETRIEVAL_LAYOUT)
    path = retrieval_file(root, split)
    if path is None:
        raise LunaConvertError(f"lra retrieval: no {split} file in {root}; it must hold {RETRIEVAL_LAYOUT}")
    csv.field_size_limit(sys.maxsize)  # whole documents sit in one field
    first, second, labels = [], [], []
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        for number, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
            if len(row) not in (3, 5):
                raise LunaConvertError(f"lra retrieval: {path} line {number} has {len(row)} columns; expected "
                                       f"{RETRIEVAL_LAYOUT}")
            try:
                label = int(float(row[0]))
            except ValueError:
                if number == 1:  # a header line
                    continue
                raise LunaConvertError(f"lra retrieval: {path} line {number}: label {row[0]!r} is not 0 or 1") from None
            if label not in (0, 1):
                raise LunaConvertError(f"lra retrieval: {path} line {number}: label {label} is not 0 or 1")
            first.append(text_bytes(row[-2], max_bytes))
            second.append(text_bytes(row[-1], max_bytes))
            labels.append(label)
    if not labels:
        raise LunaConvertError(f"lra retrieval: {path} holds no document pairs ({RETRIEVAL_LAYOUT})")
    return first, second, np.array(labels, dtype=np.int64)
