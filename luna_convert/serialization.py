"""``save`` / ``load`` for converted models: config JSON + safetensors, nothing pickled.

Folder layout::

    linear_attention.json   method, options, targets, how to rebuild the model, versions
    config.json             transformers model config (transformers models only; a converted model's names the
                            model type luna_convert and holds the conversion record, see adapters/hf_config.py)
    model.safetensors       every weight, original and added
    tokenizer / image-processor files, when given
    modules.json, 1_Pooling/, ...   a sentence embedding model's sentence-transformers layout

``load`` also reads what transformers' ``save_pretrained`` (or ``push_to_hub``) writes for a converted model
(config.json with the record, and the weights as transformers names and shards them) through transformers' own
loader, with a model class that converts itself on construction (``converting_model_class``; the Auto classes
use it too, see integrations/transformers_auto.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
import torch
from torch import nn

from .adapters import MODEL_TYPE, RECORD_KEY
from .conversion import CONFIG_ATTR, convert_as_recorded, linear_attention_modules
from .errors import LunaConvertError
from .fileio import atomic_directory, atomic_write_json
from .folder_layout import CONVERSION_FILE, HF_CONFIG_FILE, MODEL_DIR, WEIGHTS_FILE
from .layers.attention import LinearAttention
from .model_building import TIMM_ARGS_ATTR, create_timm_model, timm_create_args
from .sentence_embedding import SentenceEmbedder, write_layout

FORMAT_VERSION = 1
# linear_attention.json's record of model.safetensors' content, checked at load: flipped bytes that keep the
# file's size and header intact load silently otherwise (and give inf logits).
DIGEST_KEY = "weights_sha256"
logger = logging.getLogger(__name__)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("luna-convert", "torch", "transformers", "timm", "accelerate", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _model_spec(model: nn.Module) -> dict:
    if isinstance(model, SentenceEmbedder):  # the encoder's class, and the pooling around it
        return {"library": "transformers", "class": type(model.encoder).__name__,
                "sentence_embedding": model.spec()}
    if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
        return {"library": "transformers", "class": type(model).__name__}
    if type(model).__module__.startswith("timm.") or hasattr(model, TIMM_ARGS_ATTR):
        return {"library": "timm", **timm_create_args(model)}
    raise LunaConvertError(
        f"cannot record how to rebuild {type(model).__name__}: save a transformers model or a timm ViT "
        "(from timm.create_model or luna_convert.create_timm_model)"
    )


def _float_dtype_name(model: nn.Module) -> str | None:
    """The dtype of the model's floating-point weights ("float32", "bfloat16", ...)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def save(model: nn.Module, directory: str | Path, tokenizer=None, processor=None, overwrite: bool = False,
         extra: dict | None = None) -> Path:
    """Write a converted (or original) model so that :func:`load` rebuilds it offline.

    The folder appears only once complete (written aside, then renamed).
    """
    conversion = getattr(model, CONFIG_ATTR, None)
    meta = {
        "format_version": FORMAT_VERSION,
        "conversion": conversion.to_dict() if conversion is not None else None,
        "model": _model_spec(model),
        "versions": library_versions(),
        "dtype": _float_dtype_name(model),
        **(extra or {}),
    }
    directory = Path(directory)
    with atomic_directory(directory, overwrite=overwrite, overwrite_hint="pass overwrite=True") as tmp:
        if meta["model"]["library"] == "transformers":
            model.config.save_pretrained(tmp)
        save_model(model, str(tmp / WEIGHTS_FILE))
        meta[DIGEST_KEY] = file_sha256(tmp / WEIGHTS_FILE)
        for files in (tokenizer, processor):
            if files is not None:
                files.save_pretrained(tmp)
        if isinstance(model, SentenceEmbedder):  # SentenceTransformer(folder) loads it too
            write_layout(model, tmp)
        atomic_write_json(tmp / CONVERSION_FILE, meta)
    return directory


def _transformers_config(directory: Path) -> dict | None:
    """The fields of the folder's transformers config.json, or None where there is none (or it is no object)."""
    try:
        fields = json.loads((directory / HF_CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return None
    return fields if isinstance(fields, dict) else None


def _is_transformers_checkpoint(directory: Path) -> bool:
    return "model_type" in (_transformers_config(directory) or {})


# How a folder without linear_attention.json was written: transformers' save_pretrained (or push_to_hub) of a
# converted model, whose config.json holds the conversion record (adapters/hf_config.py).
SAVE_PRETRAINED = "save_pretrained"


def _metadata_from_config(fields: dict) -> dict:
    """What linear_attention.json would hold, read from a converted model's config.json."""
    architectures = fields.get("architectures")
    return {"format_version": FORMAT_VERSION, "conversion": fields.get(RECORD_KEY),
            "model": {"library": "transformers",
                      "class": architectures[0] if isinstance(architectures, list) and architectures else None},
            "dtype": fields.get("dtype") or fields.get("torch_dtype"), "saved_with": SAVE_PRETRAINED}


def read_metadata(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / CONVERSION_FILE
    if not path.is_file():
        if not directory.exists():
            raise LunaConvertError(f"{directory} does not exist; pass a run folder or a folder written by luna_convert.save")
        fields = _transformers_config(directory) or {}
        converted = fields.get("model_type") == MODEL_TYPE
        if converted and fields.get("architectures"):  # written by save_pretrained, which names the class
            meta = _metadata_from_config(fields)
            check_metadata(meta, directory / HF_CONFIG_FILE)
            return meta
        hint = "pass a run folder (outputs/<run>) or a folder written by luna_convert.save"
        if converted:
            hint = (f"its {HF_CONFIG_FILE} is a converted model's but names no architecture: restore {CONVERSION_FILE} "
                    "or save the model again")
        elif _is_transformers_checkpoint(directory):
            hint = ("it is a transformers checkpoint: load it with transformers' from_pretrained and convert it with "
                    "luna_convert.convert")
        raise LunaConvertError(f"{directory} is not a luna-convert model folder (no {CONVERSION_FILE}); {hint}")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LunaConvertError(f"{path} is corrupt ({e}); re-run the conversion or restore the file") from None
    check_metadata(meta, path)
    return meta


def check_metadata(meta, path: Path) -> None:
    """linear_attention.json holds what :func:`load` reads, each field of its type; a folder written by a newer
    format is refused (this version could misread it)."""
    def bad(field: str, what: str) -> LunaConvertError:
        return LunaConvertError(f"{path}: field {field!r} {what}; the file is damaged or was edited: restore it or "
                                "save the model again")

    if not isinstance(meta, dict):
        raise LunaConvertError(f"{path} holds a JSON {type(meta).__name__}, not an object; restore it or save the "
                               "model again")
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise bad("format_version", f"is {version!r}, not a whole number")
    if version > FORMAT_VERSION:
        raise LunaConvertError(f"{path.parent} was saved by a newer luna-convert (format_version {version}; this "
                               f"version reads up to {FORMAT_VERSION}): upgrade luna-convert to load it")
    spec = meta.get("model")
    if not isinstance(spec, dict):
        raise bad("model", "is missing (how to rebuild the model)" if spec is None else "is not an object")
    if spec.get("library") not in ("transformers", "timm"):
        raise bad("model.library", f"is {spec.get('library')!r}, not 'transformers' or 'timm'")
    if spec["library"] == "transformers" and not isinstance(spec.get("class"), str):
        raise bad("model.class", "is missing or not a class name")
    conversion = meta.get("conversion")
    if conversion is not None:
        if not isinstance(conversion, dict):
            raise bad("conversion", "is not an object")
        for field, kind in (("method", str), ("targets", list), ("options", dict)):
            if not isinstance(conversion.get(field), kind):
                raise bad(f"conversion.{field}", f"is missing or not a {kind.__name__}")
    if meta.get(DIGEST_KEY) is not None and not isinstance(meta[DIGEST_KEY], str):
        raise bad(DIGEST_KEY, "is not a hex digest")


def build_model(spec: dict, directory: Path) -> nn.Module:
    """An untrained model of the recorded architecture."""
    if spec["library"] == "timm":
        args = {k: v for k, v in spec.items() if k != "library"}
        return create_timm_model(**args)
    import transformers

    config_file = directory / HF_CONFIG_FILE
    try:
        fields = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise LunaConvertError(f"{config_file} is missing; the folder is incomplete, restore it or save the model "
                               "again") from None
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"{config_file} is corrupt ({type(e).__name__}: {str(e)[:200]}); restore it or save "
                               "the model again") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise LunaConvertError(f"{config_file}: field 'model_type' is missing; the file is damaged or was edited: "
                               "restore it or save the model again")
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise LunaConvertError(f"{config_file} cannot be read as a {fields['model_type']} config ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:200]}); restore it or save the model again") from None
    cls = getattr(transformers, spec["class"], None)
    if cls is None:
        raise LunaConvertError(f"transformers {transformers.__version__} has no class {spec['class']}; install the "
                               "transformers version that wrote this folder")
    if spec.get("sentence_embedding") is not None:
        return SentenceEmbedder(cls(config), **spec["sentence_embedding"])
    return cls(config)


def load(directory: str | Path) -> nn.Module:
    """Rebuild a model written by :func:`save` (or a run folder's model): architecture, conversion,
    then weights (strict). A converted model's ``save_pretrained`` folder is read by transformers' loader
    (which knows its weight names and shards), built converted."""
    directory = Path(directory)
    if not (directory / CONVERSION_FILE).is_file() and (directory / MODEL_DIR / CONVERSION_FILE).is_file():
        directory = directory / MODEL_DIR  # a run folder: its converted model
    meta = read_metadata(directory)
    dtype = getattr(torch, meta.get("dtype") or "", None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
    if meta.get("saved_with") == SAVE_PRETRAINED:
        return _load_save_pretrained(meta["model"]["class"], directory, dtype)
    model = build_model(meta["model"], directory)
    if dtype is not None:
        # Rebuild in the saved precision: loading bf16 weights into a float32 model would
        # silently give a different (upcast) model than the one saved.
        model = model.to(dtype)
    if meta.get("conversion") is not None:
        convert_as_recorded(model, meta["conversion"])
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise LunaConvertError(f"{weights} is missing; the folder is incomplete, re-run or restore it")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        mismatch = next((line for line in lines if "size mismatch" in line), None)
        if mismatch is not None:  # a whole file, but for another architecture or options
            raise LunaConvertError(
                f"{weights} does not match the recorded model ({mismatch[:300]}); the folder was edited or "
                "written by another version"
            ) from None
        raise LunaConvertError(
            f"{weights} is truncated or corrupt ({lines[0][:300]}); re-run the conversion or restore the file"
        ) from None
    _check_digest(weights, meta.get(DIGEST_KEY))  # after the reader's own checks, which name a truncation
    if missing or unexpected:
        raise LunaConvertError(
            f"{weights} does not match the recorded model (missing {sorted(missing)[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}); the folder was edited or written by another version"
        )
    return model.eval()


# ------------------------------------------------------------------ transformers' loader, building converted
class ConvertingModel:
    """Mixin over a transformers model class: built from the config of a converted model (``Linear<Config>``),
    the model converts itself as the config's record says, so that transformers' ``from_pretrained`` loads the
    linear-attention weights into their modules. What it returns is re-classed to the original class (a
    ``BertForSequenceClassification``, as :func:`~luna_convert.conversion.convert` leaves it)."""

    _original_class: type

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # from_pretrained builds the model on the meta device; the methods' own set-up computes real values,
        # so the new modules are built on the CPU first (then placed beside the model's weights)
        with torch.device("cpu"):
            convert_as_recorded(self, getattr(config, RECORD_KEY))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return _as_original(cls, super().from_pretrained(*args, **kwargs))

    @classmethod
    def _from_config(cls, config, **kwargs):
        return _as_original(cls, super()._from_config(config, **kwargs))


def _as_original(cls: type, loaded):
    """The loaded model re-classed to the original class (``from_pretrained`` may return it with loading info),
    with the buffers no file holds made again."""
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.__class__ = cls._original_class
    restore_unsaved_buffers(model)
    return loaded


_CONVERTING_CLASSES: dict[type, type] = {}


def converting_model_class(base: type) -> type:
    """``base`` converting itself on construction (cached); named as ``base``, which transformers' Auto classes
    match against ``config.architectures``."""
    if base not in _CONVERTING_CLASSES:
        _CONVERTING_CLASSES[base] = type(base.__name__, (ConvertingModel, base),
                                         {"__module__": __name__, "__qualname__": base.__name__,
                                          "_original_class": base})
    return _CONVERTING_CLASSES[base]


def restore_unsaved_buffers(model: nn.Module) -> None:
    """Set every linear-attention buffer that is not saved (index tables and the like, fixed by the options) to the
    value a new layer computes: transformers' loader leaves such buffers of a model built on the meta device
    empty (it makes again only those of its own modules)."""
    for layer in linear_attention_modules(model):
        saved = set(layer.state_dict())
        unsaved = [name for name, _ in layer.named_buffers() if name not in saved]
        if not unsaved:
            continue
        with torch.device("cpu"):
            fresh = LinearAttention(layer.method, layer.head_dim, layer.num_heads, layer.softmax_scale,
                                    spatial=layer.spatial, options=layer.options)
        for name in unsaved:
            owner_name, _, buffer_name = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            current = owner.get_buffer(buffer_name)
            owner.register_buffer(buffer_name, fresh.get_buffer(name).to(device=current.device, dtype=current.dtype),
                                  persistent=False)


def _load_save_pretrained(class_name: str, directory: Path, dtype: torch.dtype | None) -> nn.Module:
    """A converted model's save_pretrained folder through transformers' loader; anything not matched is an error."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise LunaConvertError(f"transformers {transformers.__version__} has no class {class_name}; install the "
                               "transformers version that wrote this folder")
    try:
        config = transformers.AutoConfig.from_pretrained(directory)  # Linear<Config> (integrations/transformers_auto)
        model, info = converting_model_class(cls).from_pretrained(
            directory, config=config, output_loading_info=True, **({} if dtype is None else {"dtype": dtype}))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise LunaConvertError(f"{directory} cannot be loaded ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:300]}); restore it or save the model again") from None
    problems = {kind: sorted(names)[:3] for kind, names in info.items() if names}
    if problems:
        raise LunaConvertError(f"the weights in {directory} do not match the recorded model ({problems}); the folder "
                               "was edited or written by another version")
    return model.eval()


def _check_digest(weights: Path, recorded: str | None) -> None:
    if recorded is None:  # saved before the digest was recorded: nothing to check against
        logger.warning("note: %s has no recorded SHA-256 (saved by an older luna-convert): its content is not "
                       "checked; save it again to record one", weights)
        return
    if file_sha256(weights) != recorded:
        raise LunaConvertError(f"{weights} does not match the SHA-256 recorded when it was saved (its bytes changed "
                               "since: a damaged copy or disk?); copy it again or re-run the conversion")
