"""A long-context encoder (ModernBERT) in three variants, and DINOv2 at other resolutions."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ...conversion import convert
from .models import compare_times, inference_fn, train_step_fn
from .timing import Clock, median_ms, peak_memory, round_robin

LONG_LENGTHS = (1024, 2048, 4096, 8192)
DINO_SIZES = (224, 518, 1024)  # DINOv2 is trained at 518 px; 224 and 1024 interpolate its positions
LONG_VARIANTS = ("original", "converted global", "converted all")  # softmax; global layers linear; every layer


def _available_memory_bytes(device) -> int | None:
    """Memory a new allocation can still get: CUDA's free memory, or Linux's MemAvailable (None elsewhere)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# A training step's peak at the next length is guessed as the last one's, scaled linearly in N (what the
# original's flash SDPA and the linear layers need), with this margin; above what is free, the step is skipped.
TRAIN_MEMORY_MARGIN = 1.3


def _train_step_would_not_fit(last_peak: tuple[int, float] | None, n: int, device) -> str | None:
    """Why the training step at ``n`` tokens is skipped, or None: ``last_peak`` (tokens, bytes) scaled to ``n``,
    with TRAIN_MEMORY_MARGIN, against the free memory (no previous step, or no way to read it: never skipped)."""
    available = _available_memory_bytes(device) if last_peak else None
    if available is None:
        return None
    need = last_peak[1] * n / last_peak[0]
    if need * TRAIN_MEMORY_MARGIN <= available:
        return None
    return (f"needs about {need / 2**30:.1f} GiB (the {last_peak[0]}-token step's peak, linear in N), "
            f"{available / 2**30:.1f} GiB free")


def _time_train_step(model, batch: dict, clock, repeats: int, warmup: int, device, memory: bool) -> dict:
    """``train_ms`` (median step time) and, with ``memory``, ``train_peak_mb`` (a fresh optimizer's first step);
    each optimizer and the gradients are freed before the next, so one model's training state is alive at a time."""
    import gc

    def release() -> None:
        model.zero_grad(set_to_none=True)
        gc.collect()

    step = train_step_fn(model, batch)
    cell = {"train_ms": median_ms(round_robin({"step": step}, clock, repeats, warmup)["step"])}
    del step  # its optimizer state
    release()
    if memory:
        cell["train_peak_mb"] = peak_memory({"step": train_step_fn(model, batch)}, device)["step"] / 2**20
        release()
    return cell


def bench_long_models(device, repeats: int, warmup: int, quick: bool = False, method: str = "luna",
                      lengths: Sequence[int] | None = None, memory: bool = True, cpu_time: bool = False,
                      log: Callable[[str], None] = print) -> dict:
    """A long-context encoder where linear attention can pay: ModernBERT-base sizes (random init from
    its config; tiny if ``quick``), batch 1, inference and one training step (AdamW) at each length.
    Three variants with the same weights: the original (SDPA, its global/local pattern), the global
    layers converted (``convert``'s default: local layers stay sliding-window softmax), every layer
    converted (``convert_local_layers=True``). Times and the training step's peak tensor memory, each
    also as a ratio to the original.

    The variants run one after another, each with its own optimizer freed before the next, so only one
    trains at a time (a ModernBERT-base training step at 4k tokens peaks near 10 GB in float32). With
    ``memory``, a training step whose peak, extrapolated from the previous length, would not fit in the
    memory left is skipped and the row says so (``train_skipped``) rather than the process being killed."""
    import copy
    import gc

    import torch
    import transformers

    if quick:
        config = transformers.ModernBertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3,
                                               num_attention_heads=2, intermediate_size=96, local_attention=16,
                                               global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=2, cls_token_id=1, sep_token_id=2)
        lengths = tuple(lengths or (64, 128))
    else:
        config = transformers.ModernBertConfig()  # ModernBERT-base: 22 layers, 768 wide, window 128
        lengths = tuple(lengths or LONG_LENGTHS)
    config.max_position_embeddings = max(lengths)
    config._attn_implementation = "sdpa"  # the eager-free CPU path; v4's flash/unpadded path is refused
    clock = Clock(device, cpu_time)
    torch.manual_seed(0)
    original = transformers.ModernBertForMaskedLM(config).to(device)
    inputs = {n: (torch.randint(3, config.vocab_size, (1, n), device=device),
                  torch.randint(3, config.vocab_size, (1, n), device=device)) for n in lengths}
    rows = [{"tokens": n, "batch": 1} for n in lengths]
    models = {"original": original}  # copied before any training step, so every variant has the same weights
    for name, local in (("converted global", False), ("converted all", True)):
        models[name] = copy.deepcopy(original)
        convert(models[name], method, convert_local_layers=local)
    del original
    for name in LONG_VARIANTS:
        model = models.pop(name)
        last_peak: tuple[int, float] | None = None  # (tokens, bytes) of the last measured training step
        for row in rows:
            n, (ids, labels) = row["tokens"], inputs[row["tokens"]]
            t0 = time.perf_counter()
            x = row[name] = {"fwd_ms": median_ms(round_robin({name: inference_fn(model, {"input_ids": ids})}, clock,
                                                               repeats, warmup)[name])}
            skip = _train_step_would_not_fit(last_peak, n, device) if memory else None
            if skip:
                x["train_skipped"] = skip
                log(f"ModernBERT {n} tokens, {name}: training step skipped: {skip}")
            else:
                x.update(_time_train_step(model, {"input_ids": ids, "labels": labels}, clock, repeats, warmup,
                                          device, memory))
                if memory:
                    last_peak = (n, x["train_peak_mb"] * 2**20)
            for key in [k for k in x if k.endswith(("_ms", "_mb"))]:
                base = row["original"].get(key)
                x[f"{key}_ratio"] = 1.0 if name == "original" else x[key] / base if base else None
            log(f"ModernBERT {n} tokens, {name}: forward {x['fwd_ms']:.0f} ms, train step "
                + (f"{x['train_ms']:.0f} ms" if "train_ms" in x else "skipped")
                + (f", peak {x['train_peak_mb']:.0f} MiB" if "train_peak_mb" in x else "")
                + f"  ({time.perf_counter() - t0:.0f} s)")
        del model
        gc.collect()
    # DINOv2 (ViT-B/14 sizes, random init) at other resolutions: positions interpolated from 518 px.
    if quick:
        dino = transformers.Dinov2Config(image_size=56, patch_size=14, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128)
        sizes = (28, 56, 84)
    else:
        dino, sizes = transformers.Dinov2Config(image_size=518, patch_size=14), DINO_SIZES
    dino._attn_implementation = "sdpa"
    original = transformers.Dinov2Model(dino).to(device).eval()
    converted = copy.deepcopy(original)
    convert(converted, method)
    vit_rows = []
    for size in sizes:
        t0 = time.perf_counter()
        inputs = {"pixel_values": torch.randn(1, 3, size, size, device=device)}
        row = compare_times(inference_fn(original, inputs), inference_fn(converted, inputs), clock, repeats, warmup, image_size=size,
                       tokens=(size // dino.patch_size) ** 2 + 1, batch=1)
        vit_rows.append(row)
        log(f"DINOv2 {size}px ({row['tokens']} tokens): original {row['original_ms']:.0f} ms, converted "
            f"{row['converted_ms']:.0f} ms (x{row['ratio']:.2f})  ({time.perf_counter() - t0:.0f} s)")
    return {"method": method, "model": "ModernBERT-base" if not quick else "ModernBERT (tiny)",
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "window": config.local_attention,
            "rows": rows, "dinov2": vit_rows, "dinov2_model": "DINOv2-base (ViT-B/14)" if not quick else "DINOv2 (tiny)"}
