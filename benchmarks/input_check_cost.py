"""What the input checks cost (docs/reliability.md): the SHA-256 content digest that save and load compute over
a model's weights (BERT-base, 438 MB), and the pre-flight decode of every image (1,000 224x224 JPEGs of noise,
quality 90). Medians of 3 for the digest; wall and CPU time for both.

    python benchmarks/input_check_cost.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


def timed(fn, clock) -> float:
    runs = []
    for _ in range(3):
        start = clock()
        fn()
        runs.append(clock() - start)
    return statistics.median(runs)


def digest_cost() -> None:
    import transformers

    import luna_convert
    from luna_convert.serialization import file_sha256

    model = transformers.BertForSequenceClassification(transformers.BertConfig())
    folder = luna_convert.save(model, tempfile.mkdtemp() + "/bert-base")
    weights = folder / "model.safetensors"
    print(f"{weights.stat().st_size / 1e6:.0f} MB: sha256 {timed(lambda: file_sha256(weights), time.perf_counter):.2f} s "
          f"wall, {timed(lambda: file_sha256(weights), time.process_time):.2f} s CPU; luna_convert.load with the check "
          f"{timed(lambda: luna_convert.load(folder), time.perf_counter):.2f} s wall (median of 3)")


def decode_cost(count: int = 1000) -> None:
    import numpy as np
    from PIL import Image

    from luna_convert.data import ImageFolderDataset, readable_images

    root = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    samples = []
    for i in range(count):
        path = root / "train" / "a" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(path, quality=90)
        samples.append((str(path), 0))
    dataset = ImageFolderDataset(root / "train", ["a"], samples)
    wall, cpu = time.perf_counter(), time.process_time()
    readable_images(dataset)
    print(f"{count:,} 224x224 JPEGs decoded in {time.perf_counter() - wall:.2f} s wall, "
          f"{time.process_time() - cpu:.2f} s CPU")


if __name__ == "__main__":
    digest_cost()
    decode_cost()
