"""Which heads the kernel can follow: per converted layer and head, the softmax attention's row
entropy and the KL divergence from it to the linear attention rows.

Both come from the converted model's own queries and keys on real data (a forward pre-hook on
each :class:`~luna_convert.layers.attention.LinearAttention` takes what the layer receives), over
real query rows and real keys. A sharp head (low entropy) that the kernel follows badly (high KL)
is the rank limit at work: D features give a linear attention matrix of rank at most D.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..conversion import linear_attention_modules
from ..ops.context import AttentionContext
from ..ops.reference import softmax_attention_weights
from .training import forward_logits

# The N x N rows are built per example; beyond this many tokens they are left out (memory).
MAX_TOKENS = 2048
# log(0) guard for the linear rows (a row weight below this counts as this).
EPS = 1e-12


@contextmanager
def captured_inputs(layers: list) -> Iterator[list[list[dict]]]:
    """Within the block, each call of ``layers[i]`` appends what it received (``q``, ``k``,
    ``key_mask``, ``grid``, ``num_prefix``; detached) to the i-th list of the yielded lists."""
    seen: list[list[dict]] = [[] for _ in layers]
    handles = []

    def hook_for(index: int):
        def hook(_module, args, kwargs):
            call = {**dict(zip(("q", "k", "v", "key_mask", "grid", "num_prefix"), args)), **kwargs}
            seen[index].append({"q": call["q"].detach(), "k": call["k"].detach(), "key_mask": call.get("key_mask"),
                                "grid": call.get("grid"), "num_prefix": call.get("num_prefix", 0)})
        return hook

    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(hook_for(i), with_kwargs=True))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def row_entropy_and_kl(layer, call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head, summed over the real query rows of the call: (softmax row entropy, KL(softmax || linear),
    number of rows), each [H] in float64."""
    q, k, mask = call["q"], call["k"], call["key_mask"]
    context = AttentionContext(mask, q.shape[2], call["num_prefix"], call["grid"])
    teacher = softmax_attention_weights(q, k, layer.softmax_scale, mask).double()  # [B, H, N, N]
    student = layer.attention_weights(q, k, mask, context).double()
    t_log_t = torch.where(teacher > 0, teacher * teacher.clamp_min(EPS).log(), torch.zeros_like(teacher))
    entropy = -t_log_t.sum(-1)  # [B, H, N]
    kl = (t_log_t - teacher * student.clamp_min(EPS).log()).sum(-1)
    rows = torch.ones_like(entropy, dtype=torch.bool) if mask is None else mask[:, None, :].expand_as(entropy)
    zero = torch.zeros_like(entropy)
    return (torch.where(rows, entropy, zero).sum((0, 2)), torch.where(rows, kl, zero).sum((0, 2)),
            rows.sum((0, 2)).double())


def head_fit(model, batches, max_examples: int = 32, device=None) -> dict:
    """Run ``model`` (no grad) on ``batches`` (dicts of tensors, as the eval loaders yield) until
    ``max_examples`` examples are seen; returns per converted layer and head the mean softmax row
    entropy and the mean KL(softmax || linear), and the heads ranked by KL."""
    layers = linear_attention_modules(model)
    if not layers:
        raise ValueError("head_fit needs a converted model (no linear attention layers found)")
    totals = [None] * len(layers)
    examples, skipped = 0, False
    model.eval()
    with torch.no_grad():
        for batch in batches:
            take = min(max_examples - examples, len(next(iter(batch.values()))))
            batch = {name: value[:take].to(device) if device is not None else value[:take]
                     for name, value in batch.items() if name != "labels"}
            with captured_inputs(layers) as seen:
                forward_logits(model, batch)
            for i, calls in enumerate(seen):
                for call in calls:
                    if call["q"].shape[2] > MAX_TOKENS:
                        skipped = True
                        continue
                    for b in range(call["q"].shape[0]):  # one example at a time: an N x N per head
                        one = {**call, "q": call["q"][b:b + 1], "k": call["k"][b:b + 1],
                               "key_mask": None if call["key_mask"] is None else call["key_mask"][b:b + 1]}
                        sums = row_entropy_and_kl(layers[i], one)
                        totals[i] = sums if totals[i] is None else tuple(a + s for a, s in zip(totals[i], sums))
            examples += take
            if examples >= max_examples:
                break
    if all(t is None for t in totals):
        return {"examples": examples, "layers": [], "skipped": f"inputs longer than {MAX_TOKENS} tokens"}
    out_layers, ranked = [], []
    for i, sums in enumerate(totals):
        if sums is None:
            continue
        entropy, kl = (s / sums[2].clamp_min(1) for s in sums[:2])
        out_layers.append({"layer": i, "entropy": [round(x, 4) for x in entropy.tolist()],
                           "kl": [round(x, 4) for x in kl.tolist()]})
        ranked += [{"layer": i, "head": h, "entropy": round(e, 4), "kl": round(d, 4)}
                   for h, (e, d) in enumerate(zip(entropy.tolist(), kl.tolist()))]
    ranked.sort(key=lambda r: -r["kl"])
    all_kl = [r["kl"] for r in ranked]
    result = {"examples": examples, "mean_kl": round(sum(all_kl) / len(all_kl), 4),
              "mean_entropy": round(sum(r["entropy"] for r in ranked) / len(ranked), 4),
              "layers": out_layers, "worst_heads": ranked[:5]}
    if skipped:
        result["skipped"] = f"calls longer than {MAX_TOKENS} tokens left out"
    return result
