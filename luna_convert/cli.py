"""``luna-convert``: a thin command line over the Python API.

Heavy libraries are imported inside commands so ``--help`` answers at once.
Errors the user can fix (LunaConvertError) print one line and exit 2; any other exception
prints one line naming what failed and exits 1; ``--debug`` shows the traceback instead.
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

# light modules (no torch): imported here; the rest inside each command
from .errors import LunaConvertError
from .folder_layout import CURVES_FILE, MODEL_CARD_FILE, MODEL_DIR, RESULTS_FILE, TABLE_FILE
from .tasks import TASKS
from .tools.heap import keep_heap

console = Console(stderr=False)
# every task `run` takes, from the task registry (own-data tasks are inferred when --task is left out)
TASK_HELP = f"Task: {', '.join(TASKS)} [inferred from the model and data]."
err_console = Console(stderr=True)


def _click_exceptions() -> tuple[type, ...]:
    try:
        import click
    except ImportError:
        return ()
    return click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort


class DefaultRunGroup(TyperGroup):
    """``luna-convert RECIPE ...`` means ``luna-convert run RECIPE ...``; an unexpected exception in any
    command becomes one line (what failed, where, and to rerun with --debug) instead of a traceback."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)

    def parse_args(self, ctx, args):
        ctx.meta["luna_convert.args"] = list(args)  # for naming the model/files in an unexpected error
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        # usage errors and exits of typer (which vendors click since 0.2x) and of click itself, where
        # installed (typer no longer depends on it)
        passthrough = (typer.Exit, typer.Abort, typer.exceptions.TyperException, *_click_exceptions())
        try:
            return super().invoke(ctx)
        except passthrough:
            raise
        except Exception as e:  # noqa: BLE001 - every other failure is a bug: say so on one line
            if DEBUG["on"]:
                raise
            err_console.print(f"[red]error:[/] {escape(unexpected_error_line(e, ctx.meta.get('luna_convert.args', [])))}",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


# What an unexpected error names as its subject, from the command line: the model and files given.
_SUBJECT_OPTIONS = {"--model": "model", "--resume": "run", "--data-dir": "data", "--image": "image"}


def unexpected_error_line(error: BaseException, args: list[str]) -> str:
    """One line for a failure that is not a LunaConvertError: the command and what it was run on,
    the exception, the file it concerns (if it says) and the code line that raised it."""
    import traceback

    command = next((a for a in args if not a.startswith("-")), "")
    subject = [f"{_SUBJECT_OPTIONS[a]} {args[i + 1]}" for i, a in enumerate(args[:-1]) if a in _SUBJECT_OPTIONS]
    if not subject:  # e.g. `eval PATH`, `attention-map PATH`, `run RECIPE`
        positional = [a for a in args[1:] if not a.startswith("-")]
        subject = positional[:1]
    file = getattr(error, "filename", None)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    return (f"luna-convert {command}{' on ' + ', '.join(subject) if subject else ''} failed unexpectedly: "
            f"{type(error).__name__}: {reason}{f' (file {file})' if file else ''}{where}. "
            "This is a bug in luna-convert, not in your input: rerun with --debug to see the traceback, and report it")


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
    DEBUG["on"] = debug
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The libraries' own tqdm bars (loading/writing weights) would interleave with ours and with
    # one-line error messages; read by huggingface_hub/transformers when they are first imported.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _overrides(cli: dict, sets: List[str]) -> dict:
    from .run.recipes import parse_override

    out = {k: v for k, v in cli.items() if v is not None}
    out.update(dict(parse_override(item) for item in sets))
    return out


@app.command()
def run(
    recipe: Optional[str] = typer.Argument(None, help="Recipe name (see `luna-convert recipes`) or a YAML file."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="A registered method; `luna-convert methods` lists them."),
    model: Optional[str] = typer.Option(None, "--model", help="Hub id, local folder or timm:<name>."),
    task: Optional[str] = typer.Option(None, "--task", help=TASK_HELP),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local data: GLUE TSVs, csv/tsv/jsonl/parquet, "
                                           "ImageFolder, a save_to_disk folder, or hf:<dataset id>."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Parent folder for run outputs [outputs]."),
    eval_split: Optional[str] = typer.Option(None, "--eval-split", help="Evaluation split [the task's dev split]."),
    train_split: Optional[str] = typer.Option(None, "--train-split", help="Training split [train]."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Own data: the text column [detected]."),
    text_pair_column: Optional[str] = typer.Option(None, "--text-pair-column", help="Own data: the second text column."),
    label_column: Optional[str] = typer.Option(None, "--label-column", help="Own data: the label column [detected]."),
    metric: Optional[str] = typer.Option(None, "--metric", help="Headline metric, e.g. accuracy, macro_f1, "
                                         "matthews_correlation, pearson, spearmanr, mse [by task type]."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Own data: print what is inferred from the model and "
                                 "data (task, columns, splits, labels, settings) and stop."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Finetune optimizer steps, overriding --epochs "
                                            "(0: no finetuning; the score after distillation is the final one)."),
    epochs: Optional[float] = typer.Option(None, "--epochs"),
    encoding: Optional[str] = typer.Option(None, "--encoding", help="Encoding of the csv/tsv/jsonl data files, "
                                           "e.g. cp1252 or latin-1 [utf-8]."),
    skip_unreadable_images: bool = typer.Option(False, "--skip-unreadable-images", help="ImageFolder: leave out "
                                                "images that do not decode (counted) instead of refusing the data."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Text: tokens per example."),
    distill_steps: Optional[int] = typer.Option(None, "--distill-steps", help="Attention-distillation steps (0: none)."),
    keep_softmax_layers: Optional[str] = typer.Option(None, "--keep-softmax-layers", help="Comma-separated attention "
                                                      "layers (0-based, negative from the end) left softmax: a hybrid; "
                                                      "auto: the fewest that keep --target-pct of the control."),
    target_pct: Optional[float] = typer.Option(None, "--target-pct", help="With --keep-softmax-layers auto: percent "
                                               "of the softmax control's score to keep [99]."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help="no, bf16 or fp16."),
    set_: List[str] = typer.Option([], "--set", help="Any recipe setting as key=value (repeatable), e.g. train.lr=3e-5."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Let a new run replace the run in an existing "
                                   "--run-dir folder (its results, checkpoints and model are deleted)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Write the run into this folder "
                                           "[OUTPUT_DIR/<recipe>-<method>-<time>]; refused if it holds files, "
                                           "unless --overwrite."),
) -> None:
    """Convert a model and train it back; writes outputs/<recipe>-<method>-<time>/."""
    from .run.recipes import apply_overrides, load_recipe

    if resume is not None:
        given = {"recipe": recipe, "--method": method, "--model": model, "--task": task, "--data-dir": data_dir,
                 "--output-dir": output_dir, "--eval-split": eval_split, "--train-split": train_split,
                 "--text-column": text_column, "--text-pair-column": text_pair_column, "--label-column": label_column,
                 "--metric": metric, "--max-steps": max_steps, "--epochs": epochs, "--batch-size": batch_size,
                 "--lr": lr, "--max-length": max_length, "--distill-steps": distill_steps, "--seed": seed,
                 "--mixed-precision": mixed_precision, "--keep-softmax-layers": keep_softmax_layers,
                 "--target-pct": target_pct, "--set": set_ or None, "--run-dir": run_dir, "--encoding": encoding,
                 "--skip-unreadable-images": skip_unreadable_images or None,
                 "--overwrite": overwrite or None}
        if any(v is not None for v in given.values()):
            _guard(lambda: _resume_alone([k for k, v in given.items() if v is not None]))
        results = _guard(lambda: _run_pipeline(None, resume=resume))
    else:
        cli = {"method": method, "model": model, "task": task, "data_dir": data_dir, "output_dir": output_dir,
               "eval_split": eval_split, "seed": seed, "train.max_steps": max_steps, "train.epochs": epochs,
               "train.batch_size": batch_size, "train.lr": lr, "train.max_length": max_length,
               "train.mixed_precision": mixed_precision, "distill.steps": distill_steps,
               "train_split": train_split, "metric": metric, "columns.text": text_column,
               "columns.text_pair": text_pair_column, "columns.label": label_column,
               "keep_softmax_layers": _guard(lambda: _layer_list(keep_softmax_layers, auto=True)), "encoding": encoding,
               "skip_unreadable_images": skip_unreadable_images or None, "layer_selection.target_pct": target_pct}

        def build():
            overrides = _overrides(cli, set_)
            config = apply_overrides(load_recipe(recipe), overrides)
            if target_pct is not None and config.keep_softmax_layers != "auto":
                raise LunaConvertError("--target-pct goes with --keep-softmax-layers auto (the layers chosen to keep "
                                       "that score)")
            config.overwrite = overwrite
            if run_dir is not None:
                config.run_dir = str(run_dir)
            if recipe is None:  # own model + own data: unset training settings are chosen from their sizes
                from .run.autoconfig import mark_auto

                mark_auto(config, overrides)
            return config

        config = _guard(build)
        if dry_run:
            _guard(lambda: _dry_run(config))
            return
        results = _guard(lambda: _run_pipeline(config))
    _print_results(results)


def _resume_alone(given: list) -> None:
    raise LunaConvertError(f"--resume continues a run with the settings saved in its config.json; drop "
                           f"{', '.join(given)} (or start a new run with them)")


def _dry_run(config) -> None:
    from .run.autoconfig import needs_resolution, resolve_own_data
    from .run.models import load_model

    config.check_runnable()
    if not needs_resolution(config):
        raise LunaConvertError("--dry-run shows what is inferred for your own data: pass --model and --data-dir "
                               "without a recipe (and without a GLUE/image benchmark --task)")
    from .data import text_encoding

    with text_encoding(config.encoding):
        resolve_own_data(config, load_model(config.model), say=console.print)


def _run_pipeline(config, resume=None):
    from .tools.layer_selection import run as run_conversion

    if config is not None:
        console.print(f"[bold]luna-convert[/] {config.name or ''} method={config.method} model={config.model} "
                      f"task={config.task or 'auto'}")
    return run_conversion(config, resume=resume, console=console)


def _print_results(results) -> None:
    """The finished run's scores (``results``: its ``run.results.RunResults``) as a table."""
    if results is None or not _is_main():
        return
    from rich.table import Table

    table = Table(title=f"{results.recipe} / {results.method}  ({results.run_dir})")
    for col in ("metric", "original", "converted", "recovered"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key, teacher_value in results.teacher_metrics.items():
        conv = results.converted_metrics.get(key)
        rec = f"{100 * conv / teacher_value:.1f}%" if conv is not None and teacher_value > 0 else "-"
        star = " *" if key == results.headline_metric else ""
        table.add_row(key + star, f"{teacher_value:.4f}", f"{conv:.4f}" if conv is not None else "-", rec)
    console.print(table)
    console.print(f"* headline metric. {results.eval_examples} eval examples; "
                  f"{results.steps.distill} distil + {results.steps.finetune} finetune steps; "
                  f"{results.timings.total_s:.0f} s")
    cut = {k: v for k, v in results.truncated_by_split.items() if v}
    if cut:
        console.print(f"truncated to max_length {results.run_config().train.max_length}: "
                      + ", ".join(f"{n} {split} examples" for split, n in cut.items()))


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
    encoding: Optional[str] = typer.Option(None, "--encoding", help="Encoding of the csv/tsv/jsonl data files [the "
                                           "run's, or utf-8]."),
    json_out: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
    heads: bool = typer.Option(False, "--heads", help="Converted model: also, per layer and head, the softmax "
                               "attention's row entropy and the KL from it to the linear attention."),
) -> None:
    """Evaluate a saved model and print its metrics."""
    import json

    from .run.pipeline import evaluate_model

    result = _guard(lambda: evaluate_model(path, task, data_dir, split, batch_size, max_examples=max_examples,
                                           heads=heads, encoding=encoding))
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
    if heads:
        _print_head_fit(result["head_fit"])


def _print_head_fit(fit: dict) -> None:
    from rich.table import Table

    if not fit["layers"]:
        console.print(f"no per-head fit: {fit.get('skipped', 'no converted layer was called')}")
        return
    table = Table(title=f"fit to softmax per layer ({fit['examples']} examples): row entropy of softmax, "
                        f"KL(softmax || linear); mean KL {fit['mean_kl']:.4f}")
    for name in ("layer", "mean entropy", "mean KL", "worst head", "its entropy", "its KL"):
        table.add_column(name, justify="right")
    for layer in fit["layers"]:
        entropy, kl = layer["entropy"], layer["kl"]
        worst = max(range(len(kl)), key=kl.__getitem__)
        table.add_row(str(layer["layer"]), f"{sum(entropy) / len(entropy):.3f}", f"{sum(kl) / len(kl):.4f}",
                      str(worst), f"{entropy[worst]:.3f}", f"{kl[worst]:.4f}")
    console.print(table)
    console.print("every head: `luna-convert eval ... --heads --json`", highlight=False)


@app.command()
def recipes() -> None:
    """List the named recipes."""
    from .run.recipes import available_recipes

    for name, description in available_recipes().items():
        console.print(f"[bold]{name:<20}[/] {escape(description)}")


@app.command()
def methods(
    details: bool = typer.Option(False, "--details", help="Also each method's paper, kind, recipe, options with "
                                 "defaults, and what is confirmed vs derived."),
) -> None:
    """List the conversion methods (from the registry, luna_convert.linear_methods)."""
    from .linear_methods import METHODS
    from rich.padding import Padding

    from .linear_methods.base import option_table

    for name, spec in METHODS.items():
        console.print(f"[bold]{name:<10}[/] {escape(spec.description)}")
        if not details:
            continue
        recipe = "distil attention, then finetune" if spec.distill else "finetune (no distillation)"
        console.print(f"  paper:  {escape(spec.paper)}\n  kind:   {spec.kind}\n  recipe: {recipe}"
                      + "".join(f"; {k}={v}" for k, v in spec.recipe.items()))
        console.print("  options (--set method_options.NAME=VALUE):")
        for option, default, text in option_table(spec.options):
            console.print(f"    {option:<22} {escape(repr(default)):<10} {escape(text)}")
        if name == "luna":
            from .linear_methods.luna_native import status

            console.print(f"  native channel kernel (CPU, float32): {escape(status())}")
        if name == "sorting":
            from .linear_methods.sorting_native import status

            console.print(f"  native passes (CPU, float32): {escape(status())}")
        console.print(Padding(escape(" ".join(spec.details.split())), (0, 0, 1, 2)))


@app.command()
def report(
    runs: List[Path] = typer.Argument(..., help="Run folders, or folders that contain runs."),
    output: Path = typer.Option(Path("outputs/report"), "--output", "-o", help="Where to write report.md/report.csv."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write one self-contained HTML page: the table, "
                                        "bar charts, each run's curves and the bench plot of any bench folder given."),
) -> None:
    """Gather runs into a methods x tasks table of % recovered."""
    from .tools.report import build_report, render_table
    from .tools.report_html import check_html_path, write_html_report

    if html is not None:
        _guard(lambda: check_html_path(html))
    rep = _guard(lambda: build_report(runs, output))
    console.print(render_table(rep))
    console.print(f"wrote {output / 'report.md'} and {output / 'report.csv'}")
    if html is not None:
        _guard(lambda: write_html_report(runs, html, rep))
        console.print(f"wrote {html}", soft_wrap=True, highlight=False)


@app.command()
def compare(
    recipe: Optional[str] = typer.Argument(None, help="Recipe name or YAML file (or --model/--data-dir)."),
    methods: str = typer.Option("luna,hedgehog,t2r-hh,t2r", "--methods", help="Comma-separated methods."),
    seeds: str = typer.Option("0", "--seeds", help="Comma-separated seeds; mean and spread are reported."),
    control: bool = typer.Option(True, "--control/--no-control", help="Also finetune the unconverted model with "
                                 "the same budget (the softmax row)."),
    folder: Optional[Path] = typer.Option(None, "--dir", help="Comparison folder [OUTPUT_DIR/compare-<case>]; "
                                          "runs finished there earlier are read back, not re-run."),
    model: Optional[str] = typer.Option(None, "--model"),
    task: Optional[str] = typer.Option(None, "--task"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir"),
    output_dir: Optional[str] = typer.Option(None, "--output-dir"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    distill_steps: Optional[int] = typer.Option(None, "--distill-steps"),
    keep_softmax_layers: Optional[str] = typer.Option(None, "--keep-softmax-layers",
                                                      help="Comma-separated layers left softmax (every method)."),
    lr: Optional[float] = typer.Option(None, "--lr"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    max_length: Optional[int] = typer.Option(None, "--max-length"),
    set_: List[str] = typer.Option([], "--set", help="Any recipe setting as key=value (repeatable)."),
) -> None:
    """Several methods on one case with the same budget: teacher, right after conversion, after
    distillation, final, % recovered, s/step; writes compare.json, compare.md and compare.png."""
    from .run.compare import run_compare
    from .run.recipes import apply_overrides, load_recipe

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    seed_list = _int_list(seeds, "--seeds")
    cli = {"model": model, "task": task, "data_dir": data_dir, "output_dir": output_dir,
           "train.max_steps": max_steps, "distill.steps": distill_steps, "train.lr": lr,
           "train.batch_size": batch_size, "train.max_length": max_length,
           "keep_softmax_layers": _guard(lambda: _layer_list(keep_softmax_layers))}

    def build():
        config = apply_overrides(load_recipe(recipe), _overrides(cli, set_))
        if recipe is None:
            from .run.autoconfig import mark_auto

            mark_auto(config, _overrides(cli, set_))
        return config

    config = _guard(build)
    case = config.name or Path(str(config.model)).name
    target = folder or Path(config.output_dir) / f"compare-{case}"
    summary = _guard(lambda: run_compare(config, method_list, seed_list, target, control=control, console=console))
    from .run.compare import markdown_table

    console.print(markdown_table(summary), soft_wrap=True, highlight=False)
    console.print(f"wrote {target / TABLE_FILE}, compare.json and compare.png", soft_wrap=True, highlight=False)


@app.command()
def lra(
    task: str = typer.Argument(..., help="listops, image, pathfinder, text or retrieval."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="softmax (exact attention) or a registered "
                                         "method [the recipe's, else softmax]."),
    protocol: str = typer.Option("cpu", "--protocol", help="cpu (the reduced budget) or paper (the full one, "
                                 "for a GPU): the recipe luna_convert/recipes/lra/<task>-<protocol>.yaml."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="A YAML recipe file instead of --protocol's."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="image: an ImageFolder; text: class folders of "
                                           ".txt files; retrieval: train.tsv and test.tsv of document pairs."),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="Where generated sets are kept "
                                            "[~/.cache/luna_convert/lra]."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Parent folder for run outputs [outputs]."),
    set_: List[str] = typer.Option([], "--set", help="Any LRA setting as key=value (repeatable), e.g. "
                                   "encoder.layers=4, data.train_examples=5000, method_options.luna.channels=4."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Let a new run replace the run in --run-dir."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Write the run into this folder "
                                           "[OUTPUT_DIR/lra-<task>-<method>-<time>]."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Compare these methods (comma-separated) with the "
                                          "same recipe, one run each per seed, into --dir; writes compare.md."),
    seeds: str = typer.Option("0", "--seeds", help="With --methods: comma-separated seeds."),
    folder: Optional[Path] = typer.Option(None, "--dir", help="With --methods: the comparison folder "
                                          "[OUTPUT_DIR/compare-lra-<task>]; finished runs there are read back."),
) -> None:
    """Train the small Long Range Arena encoder from scratch with one attention method (or compare several);
    writes a run folder."""
    from .lra.compare import markdown_table as lra_table, run_lra_compare
    from .lra.config import load_lra_config
    from .lra.train import run_lra, summary_line

    if resume is not None:
        results = _guard(lambda: run_lra(None, resume=resume, console=console))
    else:
        cli = {"method": method, "seed": seed, "data_dir": data_dir, "cache_dir": cache_dir, "output_dir": output_dir,
               "train.max_steps": max_steps, "train.batch_size": batch_size, "train.lr": lr}

        def build():
            config = load_lra_config(task, protocol, str(recipe) if recipe else None, _overrides(cli, set_))
            config.overwrite, config.run_dir = overwrite or None, str(run_dir) if run_dir else None
            return config

        if methods is not None:
            config = _guard(build)
            target = folder or Path(config.output_dir) / f"compare-lra-{task}"
            summary = _guard(lambda: run_lra_compare(config, [m.strip() for m in methods.split(",") if m.strip()],
                                                     list(_int_list(seeds, "--seeds")), target, console=console))
            console.print(lra_table(summary), soft_wrap=True, highlight=False)
            return
        results = _guard(lambda: run_lra(_guard(build), console=console))
    console.print(summary_line(results), soft_wrap=True, highlight=False)


@app.command()
def demo(
    method: str = typer.Option("luna", "--method", "-m"),
    output_dir: str = typer.Option("outputs", "--output-dir"),
    set_: List[str] = typer.Option([], "--set", help="Recipe overrides key=value."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads [1, or OMP_NUM_THREADS "
                                          "when set]: this model is too small to gain from more."),
) -> None:
    """Offline quickstart: the digits-vit recipe (the small ViT shipped with the package, on scikit-learn
    digits), converted and trained back in under a minute on a CPU."""
    from .run.recipes import apply_overrides, load_recipe

    def build():
        return apply_overrides(load_recipe("digits-vit"), _overrides({"method": method, "output_dir": output_dir}, set_))

    config = _guard(build)
    import torch

    # One thread by default: on a shared 2-core machine (load 5), two threads waiting on each other made a
    # finetune step of this model 9x slower than one (measured 4.5 s vs 0.5 s); its matrices are 64 wide.
    previous_threads = torch.get_num_threads()  # restored after: the demo must not change its caller's torch
    if threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads or 1)
    console.print(f"demo: a small softmax ViT that reads scikit-learn's 8x8 digits (shipped with luna-convert) is "
                  f"converted to {config.method} linear attention, trained back briefly and scored against its "
                  "original on the same held-out digits", soft_wrap=True, highlight=False)
    try:
        results = _guard(lambda: _run_pipeline(config))
    finally:
        torch.set_num_threads(previous_threads)
    _print_results(results)
    if results is not None and _is_main():
        run_dir = Path(results.run_dir)
        console.print(f"results in {run_dir}: {RESULTS_FILE}, {MODEL_CARD_FILE} (model card), {CURVES_FILE} "
                      f"(training curves), {MODEL_DIR}/ (the converted model; `luna-convert eval {run_dir}` "
                      "re-scores it)", soft_wrap=True, highlight=False)


@app.command()
def bench(
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Default: outputs/bench-<time>/."),
    quick: bool = typer.Option(False, "--quick", help="Few lengths and repeats (a smoke run)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Comma-separated sequence lengths."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated methods (default: all, "
                                          "plus luna:dwc=true); a method with options as METHOD:NAME=VALUE, "
                                          "e.g. hedgehog:window=64."),
    no_models: bool = typer.Option(False, "--no-models", help="Attention layers only, skip whole models."),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, help="Timed runs per measurement (median)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads for the run."),
    timer: str = typer.Option("wall", "--timer", help="wall, or cpu: the thread's CPU time (one thread; for a "
                              "machine shared with other work)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    background_load: int = typer.Option(0, "--background-load", min=0, help="Also time the layers while this "
                                        "many processes multiply matrices (a busy machine), beside the idle run."),
    long_models: bool = typer.Option(False, "--long-models", help="Also time ModernBERT-base at 1k-8k tokens, "
                                     "original vs converted (minutes on a CPU)."),
    long_lengths: Optional[str] = typer.Option(None, "--long-lengths", help="Comma-separated lengths for --long-models."),
    dtype: str = typer.Option("float32", "--dtype", help="Attention layers in float32 or bf16 (bf16 autocast, "
                              "sums in float32; the GPU setting)."),
) -> None:
    """Time and memory of softmax vs every method as sequence length grows."""
    from datetime import datetime

    from .tools.bench import run_benchmark

    out = output_dir or Path("outputs") / f"bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    kwargs = {"models": not no_models, "quick": quick, "device": device, "repeats": repeats, "threads": threads,
              "timer": timer, "background_load": background_load, "dtype": dtype, "long_models": long_models}
    if long_lengths:
        kwargs["long_lengths"] = _int_list(long_lengths, "--long-lengths")
    if lengths:
        kwargs["lengths"] = _int_list(lengths, "--lengths")
    if methods:
        kwargs["methods"] = [m.strip() for m in methods.split(",") if m.strip()]
    _guard(lambda: run_benchmark(out, **kwargs))
    console.print(f"wrote {out}")


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, e.g. 1024,4096; got {text!r}",
                                 param_hint=option) from None


def _layer_list(text: str | None, auto: bool = False) -> list[int] | str | None:
    """--keep-softmax-layers: layer indices, or (``auto``: where the command can choose them) auto."""
    if text is not None and "auto" in text.lower():
        if not auto:
            raise LunaConvertError("--keep-softmax-layers auto chooses the layers in `luna-convert run`; here pass "
                                   "the layers, e.g. 0,5")
        if text.strip().lower() != "auto":
            raise LunaConvertError(f"--keep-softmax-layers {text}: auto chooses the layers itself; pass auto or a "
                                   "list of layers, not both")
        return "auto"
    return None if text is None else list(_int_list(text, "--keep-softmax-layers"))


@app.command()
def export(
    path: Path = typer.Argument(..., help="A run folder or a saved converted model (luna_convert.save)."),
    output: Path = typer.Option(..., "--output", "-o", help="The file to write (e.g. model.onnx)."),
    fmt: str = typer.Option("onnx", "--format", help="onnx (for ONNX Runtime) or pt2 (a torch.export program)."),
    length: int = typer.Option(16, "--length", help="Tokens of the example batch the graph is traced and "
                               "checked on (text models; any length runs afterwards)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --output file."),
) -> None:
    """Export a converted model to ONNX or torch.export, checked against PyTorch before it is written."""
    from .export import export_model
    from .serialization import load

    result = _guard(lambda: export_model(load(path), output, fmt, length, overwrite))
    dynamic = "; ".join(f"{name}: {', '.join(axes)}" for name, axes in result.dynamic.items())
    console.print(f"wrote {result.path} ({result.format}, {result.path.stat().st_size / 1e6:.1f} MB) in "
                  f"{result.seconds:.0f} s; inputs {', '.join(result.input_names)} (dynamic {dynamic}), output 0: "
                  f"{result.output_name}; matches PyTorch to {result.relative_error:.1e} of the output's scale",
                  soft_wrap=True, highlight=False)


@app.command("attention-map")
def attention_map(
    path: Path = typer.Argument(..., help="A run folder (outputs/<run>) or a converted model folder."),
    text: Optional[str] = typer.Option(None, "--text", help="Text model: the sentence to look at."),
    image: Optional[str] = typer.Option(None, "--image", help="Image model: an image file, or digits:N "
                                        "(scikit-learn's digit N, for the demo model)."),
    layer: int = typer.Option(-1, "--layer", help="Converted attention layer, 0-based; -1: the last."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="PNG to write "
                                          "[attention-map-<run>-layer<L>.png]."),
    original: str = typer.Option("converted", "--original", help="Softmax row from: converted (the same "
                                 "model's q, k), teacher (the run's original model) or a model folder."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing PNG."),
) -> None:
    """CLS attention of softmax vs linear attention for one input (the LUNA paper's Figure 4), as a PNG."""
    from .tools.attention_map import attention_map_command

    out, amap = _guard(lambda: attention_map_command(path, text=text, image=image, layer=layer, output=output,
                                                     original=original, overwrite=overwrite))
    console.print(f"wrote {out} (layer {amap.layer} of 0..{amap.num_layers - 1}, softmax row from {amap.original})",
                  soft_wrap=True, highlight=False)


def _guard(fn):
    """Run ``fn``; a user error becomes one line on stderr and exit code 2."""

    try:
        return fn()
    except LunaConvertError as e:
        if DEBUG["on"]:
            raise
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as e:
        run_dir = getattr(e, "run_dir", None)  # errors.RunInterrupted: a run whose folder exists
        err_console.print(f"interrupted; resume with: luna-convert run --resume {run_dir}" if run_dir else
                          "interrupted", highlight=False, soft_wrap=True)
        raise typer.Exit(130)


def main() -> None:
    keep_heap()  # before the first large tensor: freed buffers are reused, not faulted in again (tools.heap)
    if "--debug" in sys.argv[2:]:  # accepted anywhere on the line: moved to where the group option goes
        sys.argv.remove("--debug")
        sys.argv.insert(1, "--debug")
    app()


if __name__ == "__main__":
    main()
