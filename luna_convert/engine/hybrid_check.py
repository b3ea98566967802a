"""The window hybrid's check: does a trained ``window`` layer still use its linear part?

A layer with ``method_options.window`` adds gamma x linear attention beyond each query's window to exact
softmax inside it. Training can drive the linear part to nothing (gamma near 0, or features that add almost
nothing), leaving a sliding-window softmax model that is linear attention in name only. Two measurements
after training, on the run's eval data:

- the headline score with every layer's linear part removed (``AttentionMode.WINDOW_ONLY``: gamma = 0, the
  window's softmax alone) against the full layers' score;
- per layer, on the same inputs (a forward hook recomputes the layer's output without its linear part), the
  relative change ||full - window only|| / ||full|| over the real query rows of the first examples.

The linear part counts as bypassed when the score moves by no more than the noise of the score (1 / sqrt(n),
two standard errors of an accuracy near 0.5 on n examples) and no layer's output changes by
:data:`BYPASS_CHANGE` or more.
"""

from __future__ import annotations

import math

import torch

from ..conversion import linear_attention_modules
from ..layers.attention import AttentionMode, attention_mode
from .scoring import score
from .training import forward_logits

BYPASS_CHANGE = 0.01  # relative output change below which a layer's linear part does nothing that counts


def window_layers(model) -> list:
    """The model's LinearAttention layers that have a window (empty: no window run)."""
    return [layer for layer in linear_attention_modules(model) if layer.window]


def output_change(layers: list, model, batches, max_examples: int = 32, device=None) -> list[float]:
    """Per layer of ``layers``: ||full - window only|| / ||full|| of its output over the real query rows of the
    first ``max_examples`` examples of ``batches``, both outputs from the same inputs."""
    sums = [[0.0, 0.0] for _ in layers]  # per layer: squared difference, squared output

    def hook_for(index: int):
        def hook(module, args, kwargs, output):
            call = {**dict(zip(("q", "k", "v", "key_mask", "grid", "num_prefix"), args)), **kwargs}
            with attention_mode([module], AttentionMode.WINDOW_ONLY):
                alone = module.forward(*args, **kwargs)
            mask = call.get("key_mask")
            rows = 1.0 if mask is None else mask[:, None, :, None].to(output.dtype)
            sums[index][0] += float((((output - alone) * rows).double() ** 2).sum())
            sums[index][1] += float(((output * rows).double() ** 2).sum())
        return hook

    handles = [layer.register_forward_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]
    examples = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                take = min(max_examples - examples, len(next(iter(batch.values()))))
                forward_logits(model, {name: value[:take].to(device) if device is not None else value[:take]
                                       for name, value in batch.items() if name != "labels"})
                examples += take
                if examples >= max_examples:
                    break
    finally:
        for handle in handles:
            handle.remove()
    return [math.sqrt(diff / total) if total > 0 else 0.0 for diff, total in sums]


def hybrid_check(accelerator, model, eval_loaders: dict, task, kind, headline: str, full_score: float,
                 examples: int) -> dict | None:
    """The check of a trained window model (None: no layer has a window): results.json's ``hybrid_check``
    (``kind``: the task's kind, as :func:`luna_convert.engine.scoring.score` takes it)."""
    layers = window_layers(accelerator.unwrap_model(model))
    if not layers:
        return None
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), attention_mode(layers, AttentionMode.WINDOW_ONLY):
        window_metrics, _ = score(accelerator, model, eval_loaders, task, kind)
    window_score = window_metrics[headline]
    change = output_change(layers, accelerator.unwrap_model(model), next(iter(eval_loaders.values())),
                           device=accelerator.device)
    noise = 1 / math.sqrt(max(1, examples))
    bypassed = abs(full_score - window_score) <= noise and max(change) < BYPASS_CHANGE
    return {"score": full_score, "window_only_score": window_score, "score_noise": round(noise, 4),
            "output_change": [round(c, 6) for c in change], "bypass_change": BYPASS_CHANGE,
            "gamma": [round(float(layer.window_gamma().detach().mean()), 4) for layer in layers],
            "linear_part_bypassed": bypassed}


def describe(check: dict, headline: str) -> str:
    """One console line: the two scores, the largest output change, and whether the linear part is bypassed."""
    line = (f"hybrid check: {headline} {check['score']:.4f} with the linear part, {check['window_only_score']:.4f} "
            f"window only; largest layer output change {max(check['output_change']):.2%}")
    if check["linear_part_bypassed"]:
        return (line + f". The linear part is bypassed (score within noise {check['score_noise']:.4f}, every layer's "
                f"output within {check['bypass_change']:.0%}): this model works as sliding-window softmax")
    return line
