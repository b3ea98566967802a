"""Image datasets of (PIL RGB image, class id): ImageFolder layouts, scikit-learn digits and a
``datasets.Dataset`` with an image column."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Sequence

from ..errors import LunaConvertError, unknown_name
from ..tasks import TaskSpec
from .labels import int_or_none
from .splits import canonical_split, subset_indices

# An ImageFolder split of up to this many images is decoded whole before a run writes anything: a corrupt or
# truncated file (PIL's verify() passes truncated JPEGs) is found then, not at the first step that reads it.
# Larger splits are decoded as they are read; a file that fails then is named in the error.
DECODE_ALL_UP_TO = 20_000
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff", ".gif")
# split name -> folder names tried in data_dir, in order
_IMAGE_SPLIT_DIRS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("validation", "val", "valid", "dev"),
    "test": ("test",),
}


class _ImageDatasetBase:
    """Shared bits: ``classes``, ``targets``, ``label_map`` (applied by align_labels)."""

    classes: list[str]
    label_map: dict[int, int] | None = None

    def _target(self, y: int) -> int:
        return self.label_map.get(y, y) if self.label_map else y


class ImageFolderDataset(_ImageDatasetBase):
    """(PIL RGB image, class id) pairs from ``root/<class>/**/*.{jpg,png,...}``."""

    def __init__(self, root: Path, classes: list[str], samples: list[tuple[str, int]]):
        self.root = Path(root)
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = list(samples)
        self.label_map = None

    @property
    def targets(self) -> list[int]:
        return [self._target(y) for _, y in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        from PIL import Image

        path, y = self.samples[index]
        try:
            with warnings.catch_warnings():
                # PIL warns of damage it reads past (e.g. a TIFF's corrupt EXIF): the pixels are what counts
                warnings.simplefilter("ignore")
                with Image.open(path) as img:
                    img = img.convert("RGB")
        except Exception as e:  # noqa: BLE001 - PIL's decoders raise many kinds on a damaged file: all are bad input
            raise unreadable_image(path, e) from None
        return img, self._target(y)

    def subset(self, indices: Sequence[int]) -> "ImageFolderDataset":
        out = ImageFolderDataset(self.root, self.classes, [self.samples[i] for i in indices])
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"ImageFolderDataset(root={str(self.root)!r}, classes={len(self.classes)}, samples={len(self)})"


class DigitsDataset(_ImageDatasetBase):
    """scikit-learn's 8x8 digits as 32x32 RGB PIL images, classes "0".."9"."""

    def __init__(self, images, labels, size: int = 32):
        import numpy as np

        self.images = np.asarray(images, dtype=np.uint8)  # [N, 8, 8]
        self.labels = [int(y) for y in labels]
        self.size = size
        self.classes = [str(i) for i in range(10)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.label_map = None

    @property
    def targets(self) -> list[int]:
        return [self._target(y) for y in self.labels]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image

        img = Image.fromarray(self.images[index])  # uint8 [8, 8] -> mode "L"
        img = img.resize((self.size, self.size), Image.NEAREST).convert("RGB")
        return img, self._target(self.labels[index])

    def subset(self, indices: Sequence[int]) -> "DigitsDataset":
        out = DigitsDataset(self.images[list(indices)], [self.labels[i] for i in indices], self.size)
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"DigitsDataset(samples={len(self)})"


def _load_digits_split(split: str) -> DigitsDataset:
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    s = canonical_split(split)
    if s not in ("train", "validation"):
        raise unknown_name("split", split, ["train", "validation"])
    d = load_digits()
    images = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    idx_train, idx_val = train_test_split(
        np.arange(len(d.target)), test_size=0.2, stratify=d.target, random_state=0, shuffle=True
    )
    idx = idx_train if s == "train" else idx_val
    return DigitsDataset(images[idx], d.target[idx])


def _image_split_dir(data_dir: Path, split: str) -> Path:
    s = canonical_split(split)
    names = _IMAGE_SPLIT_DIRS.get(s, (split,))
    for name in names:
        if (data_dir / name).is_dir():
            return data_dir / name
    present = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    raise LunaConvertError(
        f"no folder for split {split!r} in {data_dir} (looked for {', '.join(names)}); "
        f"expected an ImageFolder layout {data_dir}/{names[0]}/<class>/<image>.jpg; found folders: {', '.join(present) or 'none'}"
    )


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _load_image_folder(task: TaskSpec, data_dir: Path, split: str) -> ImageFolderDataset:
    split_dir = _image_split_dir(data_dir, split)
    classes = _class_dirs(split_dir)
    if not classes:
        raise LunaConvertError(
            f"{split_dir} has no class folders; expected {split_dir}/<class name>/<image>.jpg|png"
        )
    # Class ids must agree across splits even when one split lacks a class: take the union of the
    # class folders of all split folders next to this one (sorted names, as torchvision/timm do).
    siblings = {split_dir}
    for names in _IMAGE_SPLIT_DIRS.values():
        for name in names:
            if (data_dir / name).is_dir():
                siblings.add(data_dir / name)
    all_classes = sorted({c for d in siblings for c in _class_dirs(d)})
    class_to_idx = {c: i for i, c in enumerate(all_classes)}
    samples: list[tuple[str, int]] = []
    for c in classes:
        for dirpath, dirnames, filenames in os.walk(split_dir / c, followlinks=True):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.lower().endswith(IMAGE_EXTENSIONS) and not fn.startswith("."):
                    samples.append((os.path.join(dirpath, fn), class_to_idx[c]))
    if not samples:
        raise LunaConvertError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {split_dir}; expected {split_dir}/<class name>/<image>.jpg|png"
        )
    return ImageFolderDataset(split_dir, all_classes, samples)


_SKIP_HINT = "replace or remove it, or pass --skip-unreadable-images to leave unreadable images out"


def unreadable_image(path: str, error: BaseException) -> LunaConvertError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    out = LunaConvertError(f"cannot decode image {path} ({reason}); {_SKIP_HINT}")
    out.reason = reason
    return out


def readable_images(dataset, skip: bool = False):
    """``dataset`` with every image decoded once: (the dataset, the paths of the images that did not decode).

    Images that do not decode are an error naming them, or with ``skip`` left out of the returned dataset. Only
    ImageFolder splits are checked, and those above :data:`DECODE_ALL_UP_TO` images only with ``skip`` (else
    each image is checked as it is read)."""
    if not isinstance(dataset, ImageFolderDataset) or len(dataset) > DECODE_ALL_UP_TO and not skip:
        return dataset, []
    bad: dict[int, str] = {}  # index -> why it did not decode
    for i in range(len(dataset)):
        try:
            dataset[i]
        except LunaConvertError as e:
            bad[i] = getattr(e, "reason", str(e))
    if not bad:
        return dataset, []
    paths = [dataset.samples[i][0] for i in bad]
    first = next(iter(bad.values()))
    if not skip or len(bad) == len(dataset):
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        what = f"image {shown}" if len(paths) == 1 else f"{len(paths)} of {len(dataset)} images: {shown}"
        hint = _SKIP_HINT if not skip else "no image is left to use"
        raise LunaConvertError(f"cannot decode {what} ({first}); {hint}")
    return dataset.subset(sorted(set(range(len(dataset))) - set(bad))), paths


def _interleave_by_class(labels: Sequence[int]) -> list[int]:
    """Indices ordered round-robin over classes, so any prefix is class-balanced."""
    by_class: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_class.setdefault(y, []).append(i)
    order: list[int] = []
    queues = [by_class[k] for k in sorted(by_class)]
    depth = max((len(q) for q in queues), default=0)
    for j in range(depth):
        for q in queues:
            if j < len(q):
                order.append(q[j])
    return order


def load_image_split(task: TaskSpec, split: str, data_dir: Path | None, max_examples: int | None, seed: int):
    """``split`` of an image task: scikit-learn digits or an ImageFolder, with ``max_examples`` as in load_split."""
    if task.name == "digits":
        ds = _load_digits_split(split)
        if max_examples is not None:
            train = canonical_split(split) == "train"
            idx = subset_indices(len(ds), max_examples, shuffle=train, seed=seed)
            if idx is not None:
                ds = ds.subset(idx)
        return ds
    if data_dir is None:
        raise LunaConvertError(
            f"task {task.name!r} needs --data-dir: an ImageFolder with train/<class>/*.jpg and val/<class>/*.jpg"
        )
    ds = _load_image_folder(task, data_dir, split)
    if max_examples is not None and max_examples < len(ds):
        if max_examples < 1:
            raise LunaConvertError(f"max_examples must be at least 1, got {max_examples}")
        if canonical_split(split) == "train":
            idx = subset_indices(len(ds), max_examples, shuffle=True, seed=seed)
        else:  # ImageFolder order is sorted by class: take a class-balanced prefix instead
            idx = sorted(_interleave_by_class([y for _, y in ds.samples])[:max_examples])
        ds = ds.subset(idx)
    return ds


class DatasetsImageDataset(_ImageDatasetBase):
    """(PIL RGB image, class id) pairs from a ``datasets.Dataset`` with an image and a label column."""

    def __init__(self, dataset, image_column: str, label_column: str, classes: list[str]):
        self.dataset = dataset
        self.image_column, self.label_column = image_column, label_column
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.label_map = None

    def _class_id(self, y) -> int:
        i = int_or_none(y)
        if i is None:
            i = self.class_to_idx[str(y)]
        return self._target(i)

    @property
    def targets(self) -> list[int]:
        return [self._class_id(y) for y in self.dataset[self.label_column]]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        from PIL import Image

        row = self.dataset[int(index)]
        img = row[self.image_column]
        if isinstance(img, dict):  # undecoded {"bytes", "path"}
            import io

            img = Image.open(io.BytesIO(img["bytes"])) if img.get("bytes") else Image.open(img["path"])
        elif not isinstance(img, Image.Image):
            import numpy as np

            img = Image.fromarray(np.asarray(img, dtype=np.uint8))
        return img.convert("RGB"), self._class_id(row[self.label_column])

    def subset(self, indices: Sequence[int]) -> "DatasetsImageDataset":
        out = DatasetsImageDataset(self.dataset.select(list(indices)), self.image_column, self.label_column,
                                   self.classes)
        out.label_map = self.label_map
        return out

    def __repr__(self) -> str:
        return f"DatasetsImageDataset(classes={len(self.classes)}, samples={len(self)})"
