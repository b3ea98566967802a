"""Rebuild the digits-vit teacher shipped inside the package (builtin:digits-vit, behind `luna-convert demo`).

    python scripts/train_digits_teacher.py            # retrain into luna_convert/builtin_teachers/digits-vit/
    python scripts/train_digits_teacher.py --output DIR  # elsewhere, e.g. to check that a rerun is identical

Trains the teacher of luna_convert.run.teachers.BUILTIN["digits-vit"] (seed 0, 920 steps, about 75 s on an
idle 2-core CPU) with the same finetune loop as conversions, saves it in luna_convert.save format and
prints each file's SHA-256 next to the one recorded in luna_convert/run/teachers.py SHIPPED_SHA256.
One CPU thread and deterministic kernels: the same library versions give the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the digits ship with scikit-learn: nothing to download
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, also when another one is installed


def main() -> int:
    import torch

    from luna_convert.run.teachers import SHIPPED_DIR, SHIPPED_SHA256, file_sha256, train_builtin

    name = "digits-vit"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=SHIPPED_DIR / name, help="folder to write [%(default)s]")
    args = parser.parse_args()
    # Sums of floats depend on how work is split among threads: one thread makes the result reproducible.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    metrics = train_builtin(name, args.output)
    print(f"teacher {name}: {metrics} -> {args.output}")
    recorded = SHIPPED_SHA256[name]
    same = True
    for file in recorded:
        digest = file_sha256(args.output / file)
        same &= digest == recorded[file]
        print(f'    "{file}": "{digest}",  # {"as recorded" if digest == recorded[file] else "differs from the record"}')
    if not same:
        print("the checksums differ from SHIPPED_SHA256 in luna_convert/run/teachers.py: if this checkpoint is the one to "
              "ship, record the lines above there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
