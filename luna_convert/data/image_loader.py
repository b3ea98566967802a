"""Image DataLoaders: the torchvision transforms and per-example seeded augmentation."""

from __future__ import annotations

import math

from ..errors import LunaConvertError, unknown_name


def image_transform(mean, std, image_size: int, train: bool, *, crop_pct: float = 0.875, hflip: bool = True,
                    interpolation: str = "bicubic"):
    """torchvision transform: train = RandomResizedCrop(scale 0.5-1) + horizontal flip; eval =
    Resize(image_size / crop_pct) + CenterCrop(image_size); then ToTensor + Normalize.
    ``crop_pct`` / ``interpolation`` can come from timm's ``resolve_data_config``."""
    from torchvision import transforms as T

    if isinstance(image_size, (tuple, list)):
        image_size = int(image_size[-1])
    image_size = int(image_size)
    try:
        interp = T.InterpolationMode(str(interpolation).lower())
    except ValueError:
        choices = [m.value for m in T.InterpolationMode]
        raise unknown_name("interpolation", str(interpolation), choices) from None
    norm = [T.ToTensor(), T.Normalize(mean=[float(m) for m in mean], std=[float(s) for s in std])]
    if train:
        ops = [T.RandomResizedCrop(image_size, scale=(0.5, 1.0), interpolation=interp)]
        if hflip:
            ops.append(T.RandomHorizontalFlip())
        return T.Compose(ops + norm)
    resize = int(math.floor(image_size / crop_pct)) if crop_pct and crop_pct < 1 else image_size
    return T.Compose([T.Resize(resize, interpolation=interp), T.CenterCrop(image_size), *norm])


class _TransformedImages:
    """Applies ``transform`` to each image. Random transforms draw from torch's generator re-seeded
    from (seed, epoch, index) inside a forked RNG: an example's augmentation does not depend on what
    was loaded before it (so a resumed run sees the same pixels) and loading never consumes the
    global RNG that dropout uses. Training loops call ``set_epoch`` so each epoch differs."""

    def __init__(self, dataset, transform, seed: int = 0):
        self.dataset = dataset
        self.transform = transform
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        import torch

        img, y = self.dataset[i]
        if self.transform is None:
            return img, int(y)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_033 + int(i)) % (2**63))
            return self.transform(img), int(y)


def _collate_images(items):
    import torch

    pixels = torch.stack([x for x, _ in items])
    return {"pixel_values": pixels.float(), "labels": torch.tensor([y for _, y in items], dtype=torch.long)}


def make_image_dataloader(dataset, transform, *, batch_size: int, shuffle: bool = False, seed: int = 0,
                          num_workers: int = 0):
    """A DataLoader of ``{"pixel_values": float [B,3,H,W], "labels": long [B]}``; the transform
    runs in the workers. Shuffling uses a ``torch.Generator`` seeded with ``seed``."""
    import torch
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise LunaConvertError(f"batch size must be at least 1, got {batch_size}")
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    loader = DataLoader(_TransformedImages(dataset, transform, seed), batch_size=batch_size, shuffle=shuffle,
                        num_workers=num_workers, collate_fn=_collate_images, generator=generator,
                        persistent_workers=False)
    loader.num_examples = len(dataset)
    loader.classes = list(getattr(dataset, "classes", []) or [])
    return loader
