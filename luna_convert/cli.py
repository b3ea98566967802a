"""``luna-convert``: a thin command line over the Python API.

Heavy libraries are imported inside commands so ``--help`` answers at once.
Errors the user can fix (LunaConvertError) print one line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

console = Console(stderr=False)
err_console = Console(stderr=True)


class DefaultRunGroup(TyperGroup):
    """``luna-convert RECIPE ...`` means ``luna-convert run RECIPE ...``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=DefaultRunGroup,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Convert finetuned softmax Transformers (BERT, ViT) to linear attention and train them back.\n\n"
    "Examples:  luna-convert demo  |  luna-convert bert-base-sst2 --method luna  |  luna-convert eval outputs/<run>",
)

DEBUG = {"on": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    DEBUG["on"] = debug or DEBUG["on"]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _overrides(cli: dict, sets: List[str]) -> dict:
    from .recipes import parse_override

    out = {k: v for k, v in cli.items() if v is not None}
    out.update(dict(parse_override(item) for item in sets))
    return out


@app.command()
def run(
    recipe: Optional[str] = typer.Argument(None, help="Recipe name (see `luna-convert recipes`) or a YAML file."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="luna, t2r, t2r-hh or hedgehog."),
    model: Optional[str] = typer.Option(None, "--model", help="Hub id, local folder or timm:<name>."),
    task: Optional[str] = typer.Option(None, "--task", help="Task name (GLUE task, imagenet, digits, ...)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local data: GLUE TSVs, csv/jsonl/parquet, ImageFolder."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Parent folder for run outputs [outputs]."),
    eval_split: Optional[str] = typer.Option(None, "--eval-split", help="Evaluation split [the task's dev split]."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Finetune optimizer steps (overrides epochs)."),
    epochs: Optional[float] = typer.Option(None, "--epochs"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Text: tokens per example."),
    distill_steps: Optional[int] = typer.Option(None, "--distill-steps", help="Attention-distillation steps (0: none)."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help="no, bf16 or fp16."),
    set_: List[str] = typer.Option([], "--set", help="Any recipe setting as key=value (repeatable), e.g. train.lr=3e-5."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Allow writing into an existing run folder."),
) -> None:
    """Convert a model and train it back; writes outputs/<recipe>-<method>-<time>/."""
    from .recipes import apply_overrides, load_recipe

    if resume is not None:
        results = _guard(lambda: _run_pipeline(None, resume=resume))
    else:
        cli = {"method": method, "model": model, "task": task, "data_dir": data_dir, "output_dir": output_dir,
               "eval_split": eval_split, "seed": seed, "train.max_steps": max_steps, "train.epochs": epochs,
               "train.batch_size": batch_size, "train.lr": lr, "train.max_length": max_length,
               "train.mixed_precision": mixed_precision, "distill.steps": distill_steps}

        def build():
            config = apply_overrides(load_recipe(recipe), _overrides(cli, set_))
            config["overwrite"] = overwrite
            return config

        config = _guard(build)
        results = _guard(lambda: _run_pipeline(config))
    _print_results(results)


def _run_pipeline(config, resume=None):
    from .pipeline import run_conversion

    if config is not None:
        console.print(f"[bold]luna-convert[/] {config['name'] or ''} method={config['method']} model={config['model']} "
                      f"task={config['task']}")
    return run_conversion(config, resume=resume, console=console)


def _print_results(results: dict) -> None:
    if results is None or not _is_main():
        return
    from rich.table import Table

    table = Table(title=f"{results['recipe']} / {results['method']}  ({results['run_dir']})")
    for col in ("metric", "original", "converted", "recovered"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key, teacher_value in results["teacher_metrics"].items():
        conv = results["converted_metrics"].get(key)
        rec = f"{100 * conv / teacher_value:.1f}%" if conv is not None and teacher_value > 0 else "-"
        star = " *" if key == results["headline_metric"] else ""
        table.add_row(key + star, f"{teacher_value:.4f}", f"{conv:.4f}" if conv is not None else "-", rec)
    console.print(table)
    console.print(f"* headline metric. {results['eval_examples']} eval examples; "
                  f"{results['steps']['distill']} distil + {results['steps']['finetune']} finetune steps; "
                  f"{results['timings']['total_s']:.0f} s")


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


@app.command("eval")
def eval_(
    path: Path = typer.Argument(..., help="A run folder, a saved converted model, or an original checkpoint."),
    task: Optional[str] = typer.Option(None, "--task"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir"),
    split: Optional[str] = typer.Option(None, "--split"),
    batch_size: int = typer.Option(64, "--batch-size"),
    max_examples: Optional[int] = typer.Option(None, "--max-examples"),
    json_out: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
) -> None:
    """Evaluate a saved model and print its metrics."""
    import json

    from .pipeline import evaluate_model

    result = _guard(lambda: evaluate_model(path, task, data_dir, split, batch_size, max_examples=max_examples))
    if not _is_main():
        return
    if json_out:
        print(json.dumps(result, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{result['model']} on {result['task']} ({result['eval_examples']} examples)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result["metrics"].items():
        table.add_row(k, f"{v:.4f}")
    console.print(table)


@app.command()
def recipes() -> None:
    """List the named recipes."""
    from .recipes import available_recipes

    for name, description in available_recipes().items():
        console.print(f"[bold]{name:<20}[/] {escape(description)}")


@app.command()
def methods() -> None:
    """List the conversion methods."""
    from .methods import methods as list_methods

    for name, description in list_methods().items():
        console.print(f"[bold]{name:<10}[/] {escape(description)}")


@app.command()
def report(
    runs: List[Path] = typer.Argument(..., help="Run folders, or folders that contain runs."),
    output: Path = typer.Option(Path("outputs/report"), "--output", "-o", help="Where to write report.md/report.csv."),
) -> None:
    """Gather runs into a methods x tasks table of % recovered."""
    from .report import build_report, render_table

    rep = _guard(lambda: build_report(runs, output))
    console.print(render_table(rep))
    console.print(f"wrote {output / 'report.md'} and {output / 'report.csv'}")


@app.command()
def demo(
    method: str = typer.Option("luna", "--method", "-m"),
    output_dir: str = typer.Option("outputs", "--output-dir"),
    set_: List[str] = typer.Option([], "--set", help="Recipe overrides key=value."),
) -> None:
    """Offline quickstart: the digits-vit recipe (a small ViT on scikit-learn digits), a few minutes on a CPU."""
    from .recipes import apply_overrides, load_recipe

    def build():
        return apply_overrides(load_recipe("digits-vit"), _overrides({"method": method, "output_dir": output_dir}, set_))

    results = _guard(lambda: _run_pipeline(_guard(build)))
    _print_results(results)


@app.command()
def bench(
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Default: outputs/bench-<time>/."),
    quick: bool = typer.Option(False, "--quick", help="Few lengths and repeats (a smoke run)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Comma-separated sequence lengths."),
    no_models: bool = typer.Option(False, "--no-models", help="Attention layers only, skip whole models."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
) -> None:
    """Time and memory of softmax vs every method as sequence length grows."""
    from datetime import datetime

    from .bench import run_benchmark

    out = output_dir or Path("outputs") / f"bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    kwargs = {"models": not no_models, "quick": quick, "device": device}
    if lengths:
        kwargs["lengths"] = tuple(int(x) for x in lengths.split(","))
    _guard(lambda: run_benchmark(out, **kwargs))
    console.print(f"wrote {out}")


def _guard(fn):
    """Run ``fn``; a user error becomes one line on stderr and exit code 2."""
    from .errors import LunaConvertError

    try:
        return fn()
    except LunaConvertError as e:
        if DEBUG["on"]:
            raise
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted; resume with --resume <run folder>")
        raise typer.Exit(130)


def main() -> None:
    if "--debug" in sys.argv[1:]:  # accepted anywhere on the line
        sys.argv.remove("--debug")
        DEBUG["on"] = True
    app()


if __name__ == "__main__":
    main()
