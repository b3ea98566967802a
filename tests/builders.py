"""What the tests build on disk: tiny checkpoints and datasets written in the test, run configs, and
the command line run in-process. Shared by every test module (imported as ``builders``)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

import luna_convert
from luna_convert.conversion import linear_attention_modules
from luna_convert.run.config import RunConfig
from luna_convert.run.recipes import apply_overrides, load_recipe

WORDS = "good great fine awful bad poor movie film plot actor the a is was very not".split()


def write_sst2(folder: Path, n_train: int = 48, n_dev: int = 20) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = [rng.choice(WORDS[:3] if label else WORDS[3:6])] + rng.choices(WORDS[6:], k=rng.randint(2, 9))
            rows.append(" ".join(rng.sample(words, len(words))) + f"\t{label}")
        (folder / name).write_text("\n".join(rows) + "\n")
    return folder


def write_bert_checkpoint(folder: Path, num_labels: int = 2, arch: str = "bert", head: str = "Sequence",
                          words=WORDS, id2label: dict | None = None) -> Path:
    """A tiny BERT (or, with arch="distilbert", DistilBERT) classifier with its tokenizer (vocabulary: the
    special tokens and ``words``), saved like a hub checkpoint; ``head`` "Token" makes a token classifier,
    "QuestionAnswering" an extractive QA model."""
    import transformers

    prefix = {"bert": "Bert", "distilbert": "DistilBert"}[arch]
    tokenizer_class = transformers.BertTokenizerFast  # DistilBERT checkpoints use the same WordPiece vocabulary
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    # transformers 5 takes the vocabulary as `vocab` (and silently ignores `vocab_file`, leaving a
    # 5-token tokenizer that maps every word to [UNK]); v4 takes `vocab_file`.
    import inspect

    key = "vocab" if "vocab" in inspect.signature(tokenizer_class.__init__).parameters else "vocab_file"
    tokenizer = tokenizer_class(**{key: str(vocab)})
    assert len(tokenizer) == len(words) + 5, "the tiny tokenizer lost its vocabulary"
    torch.manual_seed(0)
    sizes = {"vocab_size": len(words) + 5, "max_position_embeddings": 64, "num_labels": num_labels}
    if id2label is not None:
        sizes.update(num_labels=len(id2label), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if arch == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, **sizes)
    else:
        config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **sizes)
    head_class = "ForQuestionAnswering" if head == "QuestionAnswering" else f"For{head}Classification"
    getattr(transformers, f"{prefix}{head_class}")(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_tiny_teacher(loaded, loader, model_dir: Path, epochs: int, lr: float = 3e-3) -> None:
    """A few epochs of AdamW on the task loss over ``loader``, then the model saved back to ``model_dir``:
    a tiny checkpoint becomes a real (if easy) teacher."""
    from luna_convert.engine.training import forward_logits, task_loss

    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=lr)
    loaded.model.train()
    for _ in range(epochs):
        for batch in loader:
            task_loss(forward_logits(loaded.model, batch), batch["labels"]).backward()
            optimizer.step()
            optimizer.zero_grad()
    loaded.model.save_pretrained(model_dir)


def saved_tokenizer(model_dir: Path):
    """The tokenizer a checkpoint writer saved beside the model (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_image_folder(folder: Path, classes=("cat", "dog", "fox"), per_class: int = 6) -> Path:
    from PIL import Image

    rng = random.Random(0)
    for split, n in (("train", per_class), ("val", per_class // 2)):
        for c_idx, cls in enumerate(classes):
            (folder / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                colour = tuple(min(255, 60 * c_idx + rng.randint(0, 40)) for _ in range(3))
                Image.new("RGB", (24, 24), colour).save(folder / split / cls / f"{i}.png")
    return folder


def write_timm_checkpoint(folder: Path, num_classes: int = 3, img_size: int = 32, embed_dim: int = 32,
                          depth: int = 2, num_heads: int = 4) -> Path:
    """A tiny timm ViT saved in luna_convert.save format (an original, unconverted checkpoint)."""
    torch.manual_seed(0)
    model = luna_convert.create_timm_model("vit_tiny_patch16_224", img_size=img_size, patch_size=8,
                                           embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                                           num_classes=num_classes)
    image_config = {"mean": [0.5] * 3, "std": [0.5] * 3, "size": img_size}
    luna_convert.save(model, folder, extra={"image_config": image_config})
    return folder


def config_for(model: Path, data: Path, task: str, method: str, out: Path, **train) -> RunConfig:
    overrides = {"model": str(model), "data_dir": str(data), "task": task, "method": method,
                 "output_dir": str(out), "train.max_steps": 3, "train.batch_size": 8, "train.eval_batch_size": 8,
                 "train.lr": 1e-3, "distill.default_steps": 2, "seed": 0}
    overrides.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(load_recipe(None), overrides)


def invoke_cli(*args):
    """The CLI run in this process (typer's CliRunner, stdout and stderr apart): seconds faster than a
    subprocess (no fresh interpreter importing torch and transformers). The tests that need a real process
    (exit codes as the shell sees them, signals, accelerate's launcher) start one themselves."""
    from typer.testing import CliRunner

    from luna_convert.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def cli_error_line(result, alone: bool = True) -> str:
    """The one error line an in-process CLI run that failed on bad input printed (exit code 2, no traceback);
    ``alone``: the only line on stderr (else the libraries' progress bars before it are allowed)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:], repr(result.exception))
    if not alone:
        lines = [line for line in lines if line.startswith("error")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def randomize_dwc(model: nn.Module, seed: int = 0) -> None:
    """DWC is zero-initialised; give it weights so tests exercise the branch."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for la in linear_attention_modules(model):
            if la.dwc is not None:
                for p in la.dwc.parameters():
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
