"""The pre-flight stage: what every run checks before it writes anything.

``preflight`` answers bad input with one :class:`~luna_convert.errors.LunaConvertError` while the run folder
does not exist yet (or, resumed, is left as it was): the output folder can be written, the model loads and its
attention converts (a dry run), the data of both splits reads in the files' encoding, its columns and labels fit
the model, and every image of an ImageFolder split decodes (up to ``data.DECODE_ALL_UP_TO`` images a split). What
it loaded on the way (the model, the data, the loaders) is handed to the run, which goes on with it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..conversion import convert, is_converted
from ..data import text_encoding
from ..errors import ConversionError, LunaConvertError
from ..linear_methods.options import AttentionOptions
from ..model_building import LoadedModel
from ..task_kinds import kind_of
from .autoconfig import resolve_own_data, task_for
from .config import CONTROL_METHOD, RunConfig
from .models import example_inputs, load_model
from .task_data import TaskData
from .teachers import ensure_builtin


@dataclass
class Checked:
    """What the pre-flight stage loaded, which the run goes on with."""

    loaded: LoadedModel
    data: TaskData
    eval_loaders: dict
    train_loader: object


def preflight(config: RunConfig, run_dir: Path, accelerator, task=None,
              say: Callable[..., None] = lambda *a, **k: None) -> Checked:
    """Check everything a run needs before its folder is written; ``task`` None: own data, resolved from the
    model and the data (``config`` gets what was chosen)."""
    from accelerate.utils import set_seed

    check_writable(run_dir)  # first: a folder that cannot be written fails before minutes of loading
    source = ensure_builtin(config.model, accelerator, config.output_dir, console=say, data_dir=config.data_dir)
    set_seed(config.seed)
    loaded = load_model(source, task.num_labels if task else None, kind=kind_of(task) if task else "sequence")
    if loaded.note:
        say(loaded.note)
    if task is None:
        with text_encoding(config.encoding):
            resolve_own_data(config, loaded, say=say)
        task = task_for(config)
    if is_converted(loaded.model):
        raise LunaConvertError(f"{config.model} is already converted to linear attention; start from the original")
    if config.method != CONTROL_METHOD:
        check_convertible(loaded.model, config.method, config.attention_options(), config.keep_softmax_layers,
                          **config.convert_keywords())
    data = TaskData(config, loaded, task, accelerator)
    # both before conversion: the embedding task's targets are the unconverted model's embeddings
    eval_loaders = data.eval_loaders()
    train_loader = data.train_loader()
    skipped = [path for paths in data.skipped_images.values() for path in paths]
    if skipped:
        say(f"skipped {len(skipped)} unreadable image(s) (--skip-unreadable-images), e.g. {skipped[0]}",
            soft_wrap=True)
    return Checked(loaded, data, eval_loaders, train_loader)


def check_writable(run_dir: Path) -> None:
    """The run folder can be made and written: the nearest folder above it that exists is a folder, and a file
    can be created in it (a probe, removed at once)."""
    existing = Path(run_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise LunaConvertError(f"cannot write the run folder {run_dir}: {existing} is a file; choose another "
                               "--output-dir (or --run-dir)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise LunaConvertError(f"cannot write the run folder {run_dir}: {existing} is not writable "
                               f"({e.strerror or type(e).__name__}); choose another --output-dir (or --run-dir)") from None


def check_convertible(model, method: str, options: AttentionOptions | dict | None = None,
                      keep_softmax_layers: list[int] = (), **convert_keywords) -> None:
    """Dry-run the conversion on the model as the run will use it, so that what only the model can tell
    fails before the run folder is written: no supported attention, attention that cannot be converted
    faithfully, keep_softmax_layers out of range, options that do not fit its heads (the options
    themselves were checked with the config: ``options`` is the object ``RunConfig.attention_options`` made, or
    options by name). A copy of the model that shares its weights (only the module structure is copied) gets
    its first attention module converted and runs one forward pass on a made-up input."""
    import copy

    import torch

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    probe = copy.deepcopy(model, memo=shared).eval()
    chosen: list[str] = []

    def first_only(_module, name: str) -> bool:
        if not chosen:
            chosen.append(name)
        return name == chosen[0]

    with torch.random.fork_rng(devices=[]):  # the run's seeded RNG stream stays as it is
        # raises the explanatory ConversionError
        given = {"options": options} if isinstance(options, AttentionOptions) else dict(options or {})
        convert(probe, method, filter_fn=first_only, keep_softmax_layers=keep_softmax_layers, **given,
                **convert_keywords)
        args, kwargs = example_inputs(probe)
        try:
            with torch.no_grad():
                probe(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            named = options.changed() if isinstance(options, AttentionOptions) else options
            what = f"method {method!r}" + (f" with options {named}" if named else "")
            hint = ("fix --set method_options... (defaults: `luna-convert methods`)" if named else
                    "this model cannot be converted with it (rerun with --debug to see where it failed)")
            raise ConversionError(f"{what} cannot run on {type(model).__name__} (test forward of {chosen[0]}: "
                                  f"{reason}); {hint}") from e
