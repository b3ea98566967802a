"""How finished runs fit a held-out split of a GLUE sentence-pair task, finer than accuracy: per run, for its
distilled checkpoint and its final model, the accuracy, the mean negative log-likelihood of the true label
and the agreement with the teacher's predictions, on ``DATA_DIR/dev.tsv``.

    python benchmarks/heldout_fit.py outputs/rte-tune/luna outputs/rte-tune/hedgehog --data-dir outputs/rte-tune/data \
        --teacher outputs/rte-tune/teachers/minilm-rte

Each argument is a ``compare`` folder (its runs are the ``*-seed*`` folders inside) or one run folder.
Prints a markdown table. A 212-pair split moves accuracy in steps
of 0.47 %; the log-likelihood moves with every pair's confidence, so two seeds tell levers apart sooner.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
import transformers

import luna_convert

PAIR_COLUMNS = ("sentence1", "sentence2")
LABELS = ("entailment", "not_entailment")  # GLUE RTE's order (luna_convert.tasks)


def read_pairs(data_dir: Path) -> tuple[list[tuple[str, str]], torch.Tensor]:
    with open(data_dir / "dev.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [(r[PAIR_COLUMNS[0]], r[PAIR_COLUMNS[1]]) for r in rows], torch.tensor([LABELS.index(r["label"]) for r in rows])


@torch.no_grad()
def log_probs(model, tokenizer, pairs, max_length: int = 128, batch: int = 32) -> torch.Tensor:
    model.eval()
    out = []
    for start in range(0, len(pairs), batch):
        first, second = zip(*pairs[start:start + batch])
        inputs = tokenizer(list(first), list(second), truncation=True, max_length=max_length, padding=True,
                           return_tensors="pt")
        out.append(torch.log_softmax(model(**inputs).logits.float(), -1))
    return torch.cat(out)


def load_model(folder: Path):
    if (folder / "linear_attention.json").is_file():
        return luna_convert.load(folder)
    return transformers.AutoModelForSequenceClassification.from_pretrained(folder)


def runs_of(path: Path) -> list[Path]:
    return sorted(path.glob("*-seed*")) if not (path / "results.json").is_file() else [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True, help="the teacher's folder (the runs' original)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs, labels = read_pairs(args.data_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.teacher)
    teacher_lp = log_probs(load_model(args.teacher), tokenizer, pairs)
    teacher = teacher_lp.argmax(-1)
    print("| folder | run | stage | accuracy | NLL | agreement with the teacher |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    print(f"| {args.teacher.name} | teacher | - | {(teacher == labels).float().mean():.4f} | "
          f"{-teacher_lp.gather(1, labels[:, None]).mean():.4f} | 1 |")
    for folder in args.folders:
        for run in runs_of(folder):
            stages = [("distilled", run / "checkpoints" / "distilled"), ("final", run / "model")]
            for stage, model_dir in stages:
                if not model_dir.is_dir():
                    continue
                lp = log_probs(load_model(model_dir), tokenizer, pairs)
                accuracy = (lp.argmax(-1) == labels).float().mean()
                nll = -lp.gather(1, labels[:, None]).mean()
                agreement = (lp.argmax(-1) == teacher).float().mean()
                print(f"| {folder.name} | {run.name} | {stage} | {accuracy:.4f} | {nll:.4f} | {agreement:.4f} |",
                      flush=True)


if __name__ == "__main__":
    main()
