"""Whole models, original against converted with the same weights: ViT and BERT inference, a BERT
training step."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ...conversion import convert
from .timing import Clock, median_ms, round_robin

VIT_SIZES = (224, 512, 1024)
BERT_LENGTHS = (128, 512, 1024, 2048, 4096)
BERT_TRAIN = (16, 128)  # batch, tokens


def _model_configs(quick: bool):
    """(ViT config kwargs, BERT config kwargs, ViT sizes, BERT lengths, BERT train (batch, tokens))."""
    if quick:  # tiny models: exercises every code path in seconds
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        return (dict(small, patch_size=8), dict(small, vocab_size=1000), (32, 64), (64, 128), (2, 32))
    return {}, {}, VIT_SIZES, BERT_LENGTHS, BERT_TRAIN


def _pair(build, method: str, device):
    """(original, converted) with identical weights; the converted one is ``convert(copy, method)``."""
    import copy

    original = build().to(device)
    converted = copy.deepcopy(original)
    convert(converted, method)
    return original, converted


def compare_times(original: Callable[[], object], converted: Callable[[], object], clock: Clock, repeats: int, warmup: int,
             **fields) -> dict:
    """Round-robin timing of the original and the converted model; a result row."""
    times = round_robin({"original": original, "converted": converted}, clock, repeats, warmup)
    row = {**fields, "original_ms": median_ms(times["original"]), "converted_ms": median_ms(times["converted"])}
    row["ratio"] = row["converted_ms"] / row["original_ms"]
    row["original_runs_ms"] = [1000 * t for t in times["original"]]
    row["converted_runs_ms"] = [1000 * t for t in times["converted"]]
    return row


def inference_fn(model, inputs: dict) -> Callable[[], None]:
    """One forward of ``model(**inputs)`` in eval mode, without autograd."""
    import torch

    def run():
        model.eval()
        with torch.inference_mode():
            model(**inputs)
    return run


def train_step_fn(model, batch: dict) -> Callable[[], None]:
    """One training step: forward, ``.loss``, backward, AdamW step (dropout on, as in finetuning)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def run():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()
    return run


def bench_models(device, repeats: int, warmup: int, quick: bool = False, method: str = "luna",
                 vit_sizes: Sequence[int] | None = None, bert_lengths: Sequence[int] | None = None,
                 cpu_time: bool = False, log: Callable[[str], None] = print) -> dict:
    """Original vs converted (random init): ViT-B/16 and BERT-base inference, one BERT-base train step."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, ViTConfig, ViTModel

    vit_kw, bert_kw, sizes, lengths, (train_batch, train_tokens) = _model_configs(quick)
    sizes = tuple(vit_sizes or sizes)
    lengths = tuple(bert_lengths or lengths)
    clock = Clock(device, cpu_time)
    out: dict = {"method": method, "vit": [], "bert": [], "bert_train": None}
    torch.manual_seed(0)

    def report(label: str, row: dict, t0: float) -> None:
        log(f"{label}: original {row['original_ms']:.0f} ms, converted {row['converted_ms']:.0f} ms"
            f" (x{row['ratio']:.2f})  ({time.perf_counter() - t0:.0f} s)")

    for size in sizes:
        t0 = time.perf_counter()
        config = ViTConfig(image_size=size, **vit_kw)
        original, converted = _pair(lambda: ViTModel(config, add_pooling_layer=False).eval(), method, device)
        inputs = {"pixel_values": torch.randn(1, 3, size, size, device=device)}
        tokens = (size // config.patch_size) ** 2 + 1
        row = compare_times(inference_fn(original, inputs), inference_fn(converted, inputs), clock, repeats, warmup,
                       image_size=size, tokens=tokens, batch=1)
        out["vit"].append(row)
        report(f"ViT {size}px ({tokens} tokens)", row, t0)
        del original, converted

    max_pos = max([*lengths, train_tokens, 512])
    for n in lengths:
        t0 = time.perf_counter()
        config = BertConfig(max_position_embeddings=max_pos, **bert_kw)
        original, converted = _pair(lambda: BertModel(config, add_pooling_layer=False).eval(), method, device)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (1, n), device=device)}
        row = compare_times(inference_fn(original, inputs), inference_fn(converted, inputs), clock, repeats, warmup, tokens=n, batch=1)
        out["bert"].append(row)
        report(f"BERT {n} tokens", row, t0)
        del original, converted

    # One training step: forward, loss, backward, AdamW step (dropout on, as in finetuning).
    t0 = time.perf_counter()
    config = BertConfig(max_position_embeddings=max_pos, num_labels=2, **bert_kw)
    original, converted = _pair(lambda: BertForSequenceClassification(config).train(), method, device)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (train_batch, train_tokens), device=device),
             "attention_mask": torch.ones(train_batch, train_tokens, dtype=torch.long, device=device),
             "labels": torch.randint(0, 2, (train_batch,), device=device)}

    row = compare_times(train_step_fn(original, batch), train_step_fn(converted, batch), clock, repeats, warmup, batch=train_batch, tokens=train_tokens)
    out["bert_train"] = row
    report(f"BERT train step {train_batch}x{train_tokens}", row, t0)
    return out
