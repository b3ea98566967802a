"""A run folder's model card: ``README.md`` with Hugging Face model-card front matter.

The front matter (``base_model``, ``tags``, ``pipeline_tag``, ``metrics``, ``model-index`` with the
measured scores, ``library_name``) is what the Hub and ``huggingface_hub.ModelCard`` read; the
body says how the model was made: method and options, teacher vs converted score, the command.
Everything comes from the run's ``results.json`` (which holds the run's config too).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .autoconfig import task_for
from ..fileio import atomic_write_text
from ..linear_methods.registry import methods
from ..metrics import recovered_pct
from .config import RunConfig
from .recipes import available_recipes, load_recipe
from ..folder_layout import MODEL_CARD_FILE, RESULTS_FILE
from .results import RunResults
from ..task_kinds import kind_of

LIBRARY_NAME = "luna-convert"
# Settings that name or place a run rather than decide what it computes.
_NOT_IN_COMMAND = {"name", "description", "output_dir"}
# Settings with their own command-line flag (the rest go through --set).
_FLAGS = {"model": "--model", "task": "--task", "data_dir": "--data-dir", "method": "--method"}


def write_model_card(run_dir: str | Path, results: RunResults | None = None, config: RunConfig | None = None) -> Path:
    """Write ``run_dir/README.md`` from ``results`` (default: the run's results.json) and the run's ``config``
    (default: the one ``results`` records, read back); returns its path."""
    run_dir = Path(run_dir)
    if results is None:
        results = RunResults.read(run_dir / RESULTS_FILE)
    path = run_dir / MODEL_CARD_FILE
    atomic_write_text(path, model_card_text(results, config if config is not None else results.run_config()))
    return path


def model_card_text(results: RunResults, config: RunConfig) -> str:
    """The card's text (front matter + body) for one finished run."""
    import yaml

    front = yaml.safe_dump(card_metadata(results, config), sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n{_body(results, config)}"


def card_metadata(results: RunResults, config: RunConfig) -> dict:
    task = task_for(config)
    pipeline_tag = kind_of(task).pipeline_tag(task)
    method = results.method
    converted = results.converted_metrics
    meta: dict = {}
    base = hub_model_id(results.model or "")
    if base is not None:
        meta["base_model"] = base
    meta.update({
        "library_name": LIBRARY_NAME,
        "pipeline_tag": pipeline_tag,
        "tags": ["linear-attention", method, LIBRARY_NAME, task.kind],
        "metrics": sorted({name.split("/")[-1] for name in converted}),
        "model-index": [{
            "name": Path(results.run_dir).name,
            "results": [{
                "task": {"type": pipeline_tag, "name": task.name},
                "dataset": _dataset(task, config),
                "metrics": [{"type": name, "name": name, "value": float(value)} for name, value in converted.items()],
            }],
        }],
        # The conversion itself, for tools that read the card (the Hub shows unknown keys as they are).
        "luna_convert": {
            "method": method,
            "method_options": _options(results, config),
            "headline_metric": results.headline_metric,
            "teacher_score": results.teacher_score,
            "converted_score": results.converted_score,
            "recovered_pct": results.recovered_pct,
            "steps": {"distill": results.steps.distill, "finetune": results.steps.finetune},
        },
    })
    return meta


def hub_model_id(model: str) -> str | None:
    """The Hub id of the run's original model, or None for a local folder or a built-in teacher."""
    if model.startswith("timm:"):
        return f"timm/{model.removeprefix('timm:')}"  # timm's pretrained weights live under the timm org
    if model.startswith(("builtin:", ".", "/", "~")) or Path(model).exists() or model.count("/") > 1:
        return None
    return model


def _dataset(task, config: RunConfig) -> dict:
    """The data the run was scored on: the hub's GLUE only where the run read it (no --data-dir), else the
    hub dataset or the local folder it named, with the split scored."""
    data_dir = str(config.data_dir or "").rstrip("/")
    split = config.eval_split or task.eval_split
    if task.glue_config and not data_dir:
        return {"name": f"GLUE {task.glue_config.upper()}", "type": "nyu-mll/glue", "config": task.glue_config,
                "split": split}
    if data_dir.startswith("hf:"):
        return {"name": data_dir.removeprefix("hf:"), "type": data_dir.removeprefix("hf:"), "split": split}
    name = Path(data_dir).name if data_dir else task.name
    return {"name": f"{name} (local files)" if data_dir else name, "type": name, "split": split}


def reproduce_command(config: RunConfig) -> str:
    """A ``luna-convert`` command line that rebuilds this config: the recipe, then every setting that
    differs from it (own data: from the defaults, resolved choices included)."""
    recipe = config.name if config.name in available_recipes() else None
    base = load_recipe(recipe).settings()
    words = ["luna-convert", "run"] + ([recipe] if recipe else [])
    for key, value in config.settings().items():
        if key in _NOT_IN_COMMAND or value == base.get(key):
            continue
        flag = _FLAGS.get(key)
        words += [flag, str(value)] if flag and isinstance(value, str) else ["--set", f"{key}={_yaml_scalar(value)}"]
    return shlex.join(words)


def _yaml_scalar(value) -> str:
    """``value`` as --set reads it back (YAML): PyYAML writes 1e-05 as 1.0e-05, which it parses as a number."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def _options(results: RunResults, config: RunConfig) -> dict:
    """The options the conversion ran with (the method's defaults filled in), as results.json records them."""
    return (results.conversion.options if results.conversion else None) or config.method_options


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _selection_lines(selection: dict | None) -> list[str]:
    """The card's line on layers chosen by ``keep_softmax_layers: auto`` (none where they were not)."""
    if not selection or "chosen" not in selection:
        return []
    attempt = (selection.get("attempts") or [{}])[-1]
    pct = attempt.get("pct_of_control")
    return [f"- layers kept softmax: {selection['chosen'] or 'none'}, chosen (`--keep-softmax-layers auto`) as the "
            f"fewest that keep {selection['target_pct']:g} % of the softmax control's score; this run "
            + (f"{'reaches' if selection.get('verified') else 'misses'} it ({pct:.1f} % of the control)"
               if pct is not None else "was not checked")
            + f" (the frontier: `{selection.get('file', 'layer_selection.md')}`)"]


def _body(results: RunResults, config: RunConfig) -> str:
    method, headline = results.method, results.headline_metric
    given = config.method_options
    options_text = ", ".join(f"`{k}={v}`" + ("" if k in given else " (default)")
                             for k, v in _options(results, config).items()) or "none"
    steps, conversion = results.steps, results.conversion
    lines = [
        f"# {Path(results.run_dir).name}",
        "",
        f"`{results.model}` with its softmax attention converted to **{method}** linear attention "
        f"({methods().get(method, '')}) by luna-convert, then trained back on "
        f"**{results.task}**.",
        "",
        "## Conversion",
        "",
        f"- method: `{method}`; options: {options_text}",
        f"- attention modules converted: {len(conversion.modules) if conversion else 0}, "
        f"parameters added: {conversion.params_added if conversion else 0:,}"
        + (" (the control run: the original softmax model finetuned unconverted)" if not conversion else ""),
        f"- training: {steps.distill} attention-distillation steps, then {steps.finetune} finetuning steps "
        f"(lr {config.train.lr}, batch {config.train.batch_size}, seed {results.seed})",
        *_selection_lines(results.layer_selection),
        "",
        "## Results",
        "",
        f"{results.eval_examples} evaluation examples; headline metric **{headline}**.",
        "",
        "| metric | teacher (softmax) | converted | recovered |",
        "|---|---:|---:|---:|",
    ]
    for name, teacher in results.teacher_metrics.items():
        converted = results.converted_metrics.get(name)
        star = " *" if name == headline else ""
        pct = recovered_pct(converted, teacher, name.split("/")[-1]) if converted is not None else None
        lines.append(f"| {name}{star} | {teacher:.4f} | "
                     f"{'-' if converted is None else f'{converted:.4f}'} | {_pct(pct)} |")
    lines += [
        "",
        f"Converted {headline} {results.converted_score:.4f} against the teacher's {results.teacher_score:.4f}: "
        f"{_pct(results.recovered_pct)} of the original recovered.",
        "",
        "## How it was made",
        "",
        "```bash",
        reproduce_command(config),
        "```",
        "",
        "Load it with `luna_convert.load(\"model\")` (this folder's `model/`); the training curves are in `curves.png`.",
        "",
    ]
    return "\n".join(lines)
