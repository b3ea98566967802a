"""Training through accelerate: attention distillation, task finetuning, evaluation.

One code path for CPU, one GPU and ``accelerate launch`` (DDP). Callers swap
attention modules before anything here runs; the finetune optimizer is built
after conversion, inside :func:`finetune`.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..conversion import feature_map_parameters, linear_attention_modules
from ..errors import LunaConvertError
from ..fileio import atomic_write_json
from ..folder_layout import STATE_FILE
from ..layers.attention import AttentionMode, attention_mode
from ..ops.reference import logits_distillation_loss
from ..tasks import IGNORE_INDEX



class NonFiniteLossError(LunaConvertError):
    pass


@dataclass
class StageResult:
    stage: str
    steps: int
    seconds: float
    final_loss: float | None


# ----------------------------------------------------------------- model calls
def forward_logits(model: nn.Module, batch: dict) -> torch.Tensor:
    """Logits for a batch from a transformers model (keyword inputs) or a timm model (a tensor). A question
    answering model's start and end logits come as rows over the positions, [B, 2, S]: with labels [B, 2]
    (start, end), the cross-entropy of :func:`task_loss` is then the model's own span loss."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if "pixel_values" in inputs and not _is_transformers(model):
        out = model(inputs["pixel_values"])
    else:
        out = model(**accepted_inputs(model, inputs))
    if torch.is_tensor(out):
        return out
    if getattr(out, "start_logits", None) is not None:
        return torch.stack([out.start_logits, out.end_logits], dim=1)
    return out.logits


def accepted_inputs(model: nn.Module, inputs: dict) -> dict:
    """``inputs`` less the keys the model's forward does not take (e.g. ``token_type_ids`` from a
    BERT tokenizer for a DistilBERT model, whose v4 forward rejects them)."""
    inner = getattr(model, "module", model)  # DDP wraps in .module
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return inputs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inputs
    return {k: v for k, v in inputs.items() if k in params}


def _is_transformers(model: nn.Module) -> bool:
    inner = getattr(model, "module", model)  # DDP wraps in .module
    return hasattr(inner, "config") and hasattr(inner.config, "to_json_string")


def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """MSE for regression; else cross-entropy over examples ([B, C] logits), tokens ([B, S, C], the
    positions labelled IGNORE_INDEX left out) or a QA model's start and end rows over the positions ([B, 2, S]
    with labels [B, 2]: the mean of the start and end cross-entropies, the model's own span loss)."""
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def teacher_kl(teacher: nn.Module, batch: dict, logits: torch.Tensor, over_positions: bool = False) -> torch.Tensor:
    """KL(teacher || model) of one batch (the squared error for one output), the frozen ``teacher`` run
    without gradients; ``logits`` are the model's own for ``batch``. Padded tokens are left out."""
    with torch.no_grad():
        target = forward_logits(teacher, batch)
    return logits_distillation_loss(target, logits, batch.get("attention_mask"), over_positions=over_positions)


# ------------------------------------------------------------------ progress UI
def progress_bar(accelerator, description: str, total: int, file=None, every: float = 5.0):
    """Progress of a long step on the main process only (a no-op elsewhere): a rich bar in a terminal;
    where output is not a terminal (a log file, a pipe, CI), a plain line every ``every`` seconds.
    It goes to stderr unless ``file`` says otherwise, so that stdout carries only results
    (``luna-convert eval --json | jq`` reads JSON alone).

    Both answer ``with bar:``, ``bar.advance(task)`` and ``bar.update(task, advance=, completed=, info=)``.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(file=file if file is not None else sys.stderr)
    if accelerator.is_main_process and not (console.is_terminal or console.is_jupyter):  # notebooks draw rich bars
        bar = PlainProgress(description, total, console.file, every)
        return bar, bar.task
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    bar = Progress(*columns, console=console, disable=not accelerator.is_main_process, transient=False)
    task = bar.add_task(description, total=total, info="")
    return bar, task


class PlainProgress:
    """Progress as plain lines (``finetune 40/920 loss 0.3120 elapsed 0:00:12 eta 0:04:24``): one
    when ``every`` seconds have passed since the last, and one at the end; rich's bar would print
    nothing until the step is over where output is not a terminal."""

    task = 0  # the one task, so that callers written for rich's Progress work unchanged

    def __init__(self, description: str, total: int, file, every: float = 5.0,
                 clock: Callable[[], float] | None = None):
        self.description, self.total, self.file, self.every = description, total, file, every
        self.clock = clock or time.monotonic
        self.completed, self.info = 0, ""
        self.started_at = self.start_completed = self.printed_at = None
        self.printed_completed = None

    def __enter__(self):
        self.started_at = self.printed_at = self.clock()
        self.start_completed = self.completed  # a resumed stage's earlier steps do not count in its speed
        return self

    def __exit__(self, *exc) -> None:
        if self.printed_completed != self.completed:
            self._print()

    def advance(self, task, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(self, task, advance: float = 0, completed: float | None = None, info: str | None = None) -> None:
        self.completed = (completed if completed is not None else self.completed) + advance
        if info is not None:
            self.info = info
        if self.started_at is None:  # set before ``with``: the starting point, not progress to show
            return
        if self.clock() - self.printed_at >= self.every:
            self._print()

    def _print(self) -> None:
        now = self.clock()
        elapsed = now - self.started_at
        done = self.completed - self.start_completed
        left = self.total - self.completed
        eta = _clock_time(elapsed / done * left) if done > 0 else "?"
        parts = [self.description, f"{int(self.completed)}/{self.total}", self.info,
                 f"elapsed {_clock_time(elapsed)}", f"eta {eta}"]
        print(" ".join(p for p in parts if p), file=self.file, flush=True)
        self.printed_at, self.printed_completed = now, self.completed


def _clock_time(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ------------------------------------------------------------------ checkpoints
def save_checkpoint(accelerator, run_dir: Path, stage: str, step: int, keep: int = 1) -> None:
    """accelerate state (model, optimizer, scheduler, RNG) + where we are; older ones pruned."""
    ckpt_root = run_dir / "checkpoints"
    path = ckpt_root / f"{stage}-{step:07d}"
    accelerator.save_state(str(path), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # The pointer is written last and atomically: a crash mid-save leaves the previous one valid.
        atomic_write_json(run_dir / STATE_FILE, {"stage": stage, "step": step, "checkpoint": path.name})
        old = sorted(p for p in ckpt_root.glob(f"{stage}-*") if p != path)
        for p in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)


def read_trainer_state(run_dir: Path) -> dict | None:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------- evaluation
@torch.no_grad()
def predict(accelerator, model: nn.Module, loader, description: str = "eval") -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels over the whole loader, each example counted once across processes. Logits with a
    position axis (token tasks [B, S, C], QA [B, 2, S]) and token labels ([B, S]): every batch padded to the
    longest (logits with 0, token labels with IGNORE_INDEX), giving e.g. [N, S, C] and [N, S]."""
    model.eval()
    all_logits, all_labels = [], []
    bar, task = progress_bar(accelerator, description, len(loader))
    with bar:
        for batch in loader:
            logits, labels = forward_logits(model, batch).float(), batch["labels"]
            if logits.ndim == 3:  # a position axis: batches on other processes may be longer
                for dim in (1, 2):
                    logits = accelerator.pad_across_processes(logits, dim=dim)
            if labels.ndim == 2:
                labels = accelerator.pad_across_processes(labels, dim=1, pad_index=IGNORE_INDEX)
            logits, labels = accelerator.gather_for_metrics((logits, labels))
            all_logits.append(logits.cpu())
            all_labels.append(labels.cpu())
            bar.advance(task)
    if all_logits and all_logits[0].ndim == 3:
        rows, cols = (max(x.shape[d] for x in all_logits) for d in (1, 2))
        all_logits = [F.pad(x, (0, cols - x.shape[2], 0, rows - x.shape[1])) for x in all_logits]
    if all_labels and all_labels[0].ndim == 2:
        longest = max(labels.shape[1] for labels in all_labels)
        all_labels = [F.pad(y, (0, longest - y.shape[1]), value=IGNORE_INDEX) for y in all_labels]
    return torch.cat(all_logits).numpy(), torch.cat(all_labels).numpy()


# ------------------------------------------------------------------ the loops
def _check_finite(loss: torch.Tensor, stage: str, step: int, accelerator=None, total: int | None = None,
                  run_dir: Path | None = None) -> None:
    """Stop on a NaN/inf loss. ``step`` counts the updates already done, so the failing one is ``step + 1``.

    Under several processes the verdict is shared (one all-reduce), so every rank stops together
    instead of the others waiting forever in the next collective.
    """
    bad = ~torch.isfinite(loss.detach()).all()
    if accelerator is not None and accelerator.num_processes > 1:
        bad = accelerator.reduce(bad.float().reshape(1), reduction="sum")[0] > 0
    if not bool(bad):
        return
    value = loss.detach().float().flatten()[0].item()
    where = f"step {step + 1}" + (f" of {total}" if total else "")
    kept = ""
    state = read_trainer_state(run_dir) if run_dir is not None else None
    if state is not None and state.get("stage") == stage:
        kept = f" The last good checkpoint (step {state['step']}) is kept in {run_dir / 'checkpoints' / state['checkpoint']}."
    knob = "the distillation learning rate (--set distill.lr=...)" if stage == "distillation" else "the learning rate (--lr)"
    raise NonFiniteLossError(
        f"{stage} loss became {value} at {where}; training stopped.{kept} "
        f"Lower {knob} or use --mixed-precision no, and start a new run"
    )


def _check_finite_weights(model: nn.Module, stage: str, step: int) -> None:
    """Refuse to checkpoint weights that an update has made NaN/inf (the loss shows it only one step later)."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p.detach()).all():
            raise NonFiniteLossError(
                f"{stage} weights became non-finite at step {step} ({name.removeprefix('module.')}); training stopped "
                "before checkpointing them. Lower the learning rate (--lr) or use --mixed-precision no, and start "
                "a new run"
            )


def _batches(loader, accelerator, start_batch: int, epoch: int):
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    dataset = getattr(loader, "dataset", None)
    if hasattr(dataset, "set_epoch"):  # per-example augmentation seeded by (seed, epoch, index): resumable
        dataset.set_epoch(epoch)
    return accelerator.skip_first_batches(loader, start_batch) if start_batch else loader


# distill.target -> what the layers compute while distilling; "logits" compares the model's logits, each layer
# staying linear (its softmax teacher pass is :func:`softmax_logits`).
DISTILL_MODES = {"attention": AttentionMode.DISTILL_ATTENTION, "output": AttentionMode.DISTILL_OUTPUT,
                 "logits": AttentionMode.LINEAR}


def distill_attention(
    accelerator, model: nn.Module, loader, *, steps: int, lr: float, log: Callable[[dict], None] | None = None,
    target: str = "attention", span_logits: bool = False,
) -> StageResult:
    """Hedgehog stage 1: train only the feature maps so linear attention rows match softmax rows
    (``target`` "attention"), so each layer's output matches softmax's ("output"), or so the model's
    logits match those of the same model run with softmax attention ("logits"; ``span_logits``: a question
    answering model's start and end rows over the positions, see :func:`forward_logits`).

    The model stays unwrapped (no DDP: most parameters are frozen); feature-map
    gradients are averaged across processes by hand before each update. The
    stage is short and deterministic given the seed, so it is checkpointed only
    at its end (by the caller); a crash inside it re-runs it.
    """
    params = feature_map_parameters(model)
    if not params:
        raise LunaConvertError("this method's feature map has no trainable parameters to distil; set --distill-steps 0")
    trainable = {id(p) for p in params}
    saved_flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    layers = linear_attention_modules(model)
    optimizer = torch.optim.AdamW(scaled_groups(params, layers, lr), lr=lr)
    # Logits: both passes without dropout, so the teacher's logits are the model's, not one dropout draw.
    model.train(target != "logits")
    step, epoch, loss_value, t0 = 0, 0, None, time.perf_counter()
    bar, task = progress_bar(accelerator, "distil", steps)
    try:
        with bar, attention_mode(layers, DISTILL_MODES[target]) as modes:
            while step < steps:
                for batch in _batches(loader, accelerator, 0, epoch):
                    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                    with accelerator.autocast():
                        if target == "logits":
                            teacher = softmax_logits(model, layers, batch)
                            loss = logits_distillation_loss(teacher, forward_logits(model, batch),
                                                            batch.get("attention_mask"), over_positions=span_logits)
                        else:
                            forward_logits(model, batch)
                            loss = modes.distillation_loss()
                    _check_finite(loss, "distillation", step, accelerator, steps)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    for p in params:
                        if p.grad is not None and accelerator.num_processes > 1:
                            p.grad = accelerator.reduce(p.grad, reduction="mean")
                    optimizer.step()
                    step += 1
                    loss_value = accelerator.reduce(loss.detach(), reduction="mean").item()
                    bar.update(task, advance=1, info=f"loss {loss_value:.4f}")
                    if log:
                        log({"stage": "distill", "step": step, "loss": loss_value})
                    if step >= steps:
                        break
                epoch += 1
    finally:
        for p, flag in saved_flags.items():
            p.requires_grad_(flag)
    return StageResult("distill", step, time.perf_counter() - t0, loss_value)


def softmax_logits(model: nn.Module, layers: list, batch: dict) -> torch.Tensor:
    """The logits of ``model`` with every converted layer run as exact softmax attention (no grad)."""
    with attention_mode(layers, AttentionMode.SOFTMAX), torch.no_grad():
        return forward_logits(model, batch)


def _load_latest(accelerator, run_dir: Path) -> None:
    state = read_trainer_state(run_dir)
    if state is None:
        raise LunaConvertError(f"nothing to resume in {run_dir}: no {STATE_FILE}; start a new run instead")
    accelerator.load_state(str(run_dir / "checkpoints" / state["checkpoint"]))


def learning_rate_scales(layers: list) -> dict[int, float]:
    return {k: v for layer in layers for k, v in layer.learning_rate_scales().items()}


def scaled_groups(params: list[nn.Parameter], layers: list, lr: float) -> list[dict]:
    """Optimizer groups of ``params`` at ``lr`` times each parameter's method-given scale (default 1)."""
    scales = learning_rate_scales(layers)
    groups: dict[float, list] = {}
    for p in params:
        groups.setdefault(scales.get(id(p), 1.0), []).append(p)
    return [{"params": ps, "lr": lr * scale} for scale, ps in sorted(groups.items())]


def parameter_groups(model: nn.Module, lr: float, weight_decay: float, added_lr: float | None = None) -> list[dict]:
    """AdamW groups: weight decay on matrices only; what conversion added at ``added_lr`` (None: ``lr``),
    times the learning-rate scale its method gives a parameter (``learning_rate_scales``)."""
    layers = linear_attention_modules(model)
    added = {id(p) for layer in layers for p in layer.parameters()}
    scales = learning_rate_scales(layers)
    groups: dict[tuple[bool, bool, float], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((id(p) in added, p.ndim > 1, scales.get(id(p), 1.0)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if matrix else 0.0,
             "lr": (added_lr if is_added and added_lr is not None else lr) * scale}
            for (is_added, matrix, scale), params in sorted(groups.items())]


def make_scheduler(optimizer, schedule: str, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        raise LunaConvertError(f"unknown schedule {schedule!r}; use linear, cosine or constant")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def finetune(
    accelerator, model: nn.Module, loader, *, steps: int, lr: float, weight_decay: float = 0.01,
    schedule: str = "linear", warmup_ratio: float = 0.0, max_grad_norm: float = 1.0, run_dir: Path | None = None,
    checkpoint_every: int = 0, start_step: int = 0, log: Callable[[dict], None] | None = None,
    stage: str = "finetune", added_lr: float | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    teacher: nn.Module | None = None, teacher_weight: float = 0.0, span_logits: bool = False,
) -> tuple[nn.Module, StageResult]:
    """Train every parameter on the task loss (``loss_fn(outputs, labels)``, default :func:`task_loss`) for
    ``steps`` optimizer updates.

    ``teacher`` (frozen, e.g. the model before conversion) with ``teacher_weight`` w: the loss is
    (1 - w) task loss + w :func:`teacher_kl` (``span_logits``: QA's rows over positions).

    ``added_lr`` is the learning rate of what conversion added (feature maps, DWC
    branch): freshly initialised modules barely move at a pretrained model's small
    learning rate. None: ``lr`` for everything. Returns the prepared (possibly
    DDP-wrapped) model and the stage summary.
    """
    loss_fn = loss_fn or task_loss  # looked up per call, not bound at definition
    optimizer = torch.optim.AdamW(parameter_groups(model, lr, weight_decay, added_lr), lr=lr)
    # accelerate steps the scheduler once per process per update; keep it in update units.
    scheduler = make_scheduler(optimizer, schedule, int(warmup_ratio * steps), steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if start_step and run_dir is not None:
        _load_latest(accelerator, run_dir)
    accum = accelerator.gradient_accumulation_steps
    batches_per_epoch = max(1, len(loader))
    # accelerate also updates on an epoch's last batch when accum does not divide the batch count.
    updates_per_epoch = math.ceil(batches_per_epoch / accum)
    step, loss_value, t0 = start_step, None, time.perf_counter()
    epoch, skip = step // updates_per_epoch, (step % updates_per_epoch) * accum
    model.train()
    bar, task = progress_bar(accelerator, stage, steps)
    bar.update(task, completed=step)
    with bar:
        while step < steps:
            for batch in _batches(loader, accelerator, skip, epoch):
                with accelerator.accumulate(model):
                    with accelerator.autocast():
                        logits = forward_logits(model, batch)
                        loss = loss_fn(logits, batch["labels"])
                        if teacher is not None and teacher_weight:
                            kl = teacher_kl(teacher, batch, logits, over_positions=span_logits)
                            loss = (1 - teacher_weight) * loss + teacher_weight * kl
                    _check_finite(loss, stage, step, accelerator, steps, run_dir)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue
                step += 1
                loss_value = accelerator.reduce(loss.detach(), reduction="mean").item()
                bar.update(task, advance=1, info=f"loss {loss_value:.4f}")
                if log:
                    log({"stage": stage, "step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0]})
                if run_dir is not None and checkpoint_every and step % checkpoint_every == 0 and step < steps:
                    _check_finite_weights(model, stage, step)
                    save_checkpoint(accelerator, run_dir, stage, step)
                if step >= steps:
                    break
            epoch, skip = epoch + 1, 0
    return model, StageResult(stage, step, time.perf_counter() - t0, loss_value)
