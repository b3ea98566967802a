"""Loading the models a run starts from, with what they need to read their inputs.

``model`` strings:
  a folder written by luna_convert.save   (converted or original; offline)
  a transformers folder or hub id          (text or image classifier)
  ``timm:<name>``                          (timm ViT/DeiT with pretrained weights)
  a sentence-transformers folder           (the embedding task: encoder, pooling, normalisation)
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import LunaConvertError
from ..folder_layout import CONVERSION_FILE, HF_CONFIG_FILE, MODEL_DIR
from ..model_building import LoadedModel, create_timm_model
from ..sentence_embedding import SentenceEmbedder, is_sentence_transformers_folder, read_layout
from ..serialization import load, read_metadata
from ..task_kinds import TaskKind, check_head, kind_named
from .teachers import builtin_dir, is_packaged

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model", "merges.txt")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _offline_hint(source: str, error: Exception) -> LunaConvertError:
    return LunaConvertError(
        f"cannot load model {source!r} ({type(error).__name__}: {str(error).splitlines()[0][:160]}). "
        "If the hub is unreachable, download the checkpoint elsewhere and pass --model /path/to/folder "
        "(and --data-dir for the data)"
    )


def _square_side(size) -> int | None:
    """The side of the square an image processor's ``size``/``crop_size`` asks for, or None.

    transformers 4 gives a dict, 5 a ``SizeDict`` (attributes), older processors an int;
    ``shortest_edge`` processors resize the short side to it.
    """
    if isinstance(size, bool) or size is None:
        return None
    if isinstance(size, (int, float)):
        return int(size)
    read = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    height, width, shortest = read("height"), read("width"), read("shortest_edge")
    if height and width:
        if int(height) != int(width):
            raise ValueError(f"non-square size {height}x{width}")
        return int(height)
    return int(shortest) if shortest else None


def _image_config_from_processor(processor, source: str) -> dict:
    where = f"the image processor in {source} (preprocessor_config.json)"
    try:
        cropped = _square_side(getattr(processor, "crop_size", None)) if getattr(processor, "do_center_crop", False) else None
        side = cropped or _square_side(getattr(processor, "size", None))
    except (TypeError, ValueError) as e:
        raise LunaConvertError(f"cannot use {where}: {e}; luna-convert feeds square images, set "
                               '"size": {"height": N, "width": N} there') from None
    if side is None:
        raise LunaConvertError(f"cannot read the image size from {where} (size={getattr(processor, 'size', None)!r}); "
                               'set "size": {"height": N, "width": N} there')
    return {"mean": tuple(getattr(processor, "image_mean", None) or IMAGENET_MEAN),
            "std": tuple(getattr(processor, "image_std", None) or IMAGENET_STD), "size": side}


def _timm_image_config(model: nn.Module) -> dict:
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    return {"mean": tuple(cfg["mean"]), "std": tuple(cfg["std"]), "size": int(cfg["input_size"][-1])}


def _is_vision_config(config) -> bool:
    return hasattr(config, "image_size") and hasattr(config, "patch_size")


def example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """A made-up batch of one input, as (args, kwargs) for ``model``'s forward: an image of the
    model's configured size (timm or transformers ViT) or a few token ids (text)."""
    import torch

    ref = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    config = getattr(model, "config", None)
    if config is None:  # timm: forward(x)
        patch_embed = model.patch_embed
        image = torch.randn(1, patch_embed.proj.in_channels, *patch_embed.img_size, generator=g)
        return (image.to(ref),), {}
    if _is_vision_config(config):
        size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
        image = torch.randn(1, getattr(config, "num_channels", 3), *size, generator=g)
        return (), {"pixel_values": image.to(ref)}
    tokens = min(8, getattr(config, "max_position_embeddings", None) or 8)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=g)
    return (), {"input_ids": ids.to(ref.device)}


def load_model(source: str, num_labels: int | None = None, kind: TaskKind | str = "sequence") -> LoadedModel:
    """Load a classifier and its preprocessing. ``num_labels`` sizes a fresh head only when the
    checkpoint has none (a base model); a finetuned head is kept as it is. ``kind`` is the task's kind
    (:mod:`luna_convert.task_kinds`, or its name): its ``auto_class`` loads its head (a prediction a token for
    NER, start and end logits a token for QA); a ``sentence_encoder`` kind loads a sentence encoder
    (:func:`load_sentence_embedder`). A checkpoint whose head (its ``architectures``) is of another kind is
    refused."""
    kind = kind_named(kind)
    path = Path(source)
    if path.is_dir() and (path / CONVERSION_FILE).is_file():
        meta = read_metadata(path)
        if meta["model"]["library"] == "transformers":
            kind.check_encoder(meta["model"].get("sentence_embedding") is not None, source)
            check_head(kind, [meta["model"]["class"]], source)
        model = load(path)
        if meta["model"]["library"] == "timm":
            return LoadedModel(model, "image", image_config=meta.get("image_config") or _timm_image_config(model),
                               source=source)
        return _with_transformers_preprocessing(model, path, source)
    if source.startswith("timm:"):
        try:
            model = create_timm_model(source[5:], pretrained=True)
        except Exception as e:  # noqa: BLE001 - any download/parse failure gets the same advice
            raise _offline_hint(source, e) from None
        return LoadedModel(model, "image", image_config=_timm_image_config(model), source=source)
    if source.startswith("builtin:"):
        folder = builtin_dir(source[8:], "outputs")
        if not (folder / CONVERSION_FILE).is_file() and not is_packaged(source[8:]):
            raise LunaConvertError(f"the built-in teacher {source} is not trained yet; run a recipe that uses it "
                                   "(e.g. `luna-convert demo`) first")
        return load_model(str(folder), num_labels, kind)
    if kind.sentence_encoder:
        return load_sentence_embedder(source)
    if missing_local_folder(source):
        raise LunaConvertError(f"model folder {source} does not exist; pass a local folder or a hub id")
    if path.is_dir():
        check_model_folder(path)
    elif path.exists():
        raise LunaConvertError(f"--model {source} is a file; pass the folder that holds the model's files")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(source)
        kwargs = {"num_labels": num_labels} if num_labels and not getattr(config, "id2label", None) else {}
        if _is_vision_config(config):
            auto = transformers.AutoModelForImageClassification
        else:
            check_head(kind, list(getattr(config, "architectures", None) or []), source)
            auto = getattr(transformers, kind.auto_class)
        model = auto.from_pretrained(source, **kwargs)
    except LunaConvertError:
        raise
    except (OSError, ValueError) as e:
        if path.is_dir():
            raise _local_load_error(source, e) from e
        raise _offline_hint(source, e) from None
    except Exception as e:  # noqa: BLE001 - a local folder's files are user input: say which and why
        if not path.is_dir():
            raise
        raise _local_load_error(source, e) from e
    return _with_transformers_preprocessing(model, source, source)


def load_sentence_embedder(source: str) -> LoadedModel:
    """A sentence encoder: a sentence-transformers folder (its Transformer, Pooling and Normalize modules,
    see :func:`luna_convert.sentence_embedding.read_layout`) or a transformers encoder (folder or hub id)
    with mean pooling; ``LoadedModel.note`` says which pooling was chosen and why."""
    import transformers

    path = Path(source)
    if path.is_dir() and is_sentence_transformers_folder(path):
        layout = read_layout(path)
        encoder_dir, pooling, normalize, max_length = (layout.encoder_dir, layout.pooling, layout.normalize,
                                                       layout.max_length)
        note = (f"sentence-transformers model: {pooling} pooling" + (", normalized" if normalize else "")
                + " (modules.json)")
    else:
        if missing_local_folder(source):
            raise LunaConvertError(f"model folder {source} does not exist; pass a local folder or a hub id")
        if path.is_dir():
            check_model_folder(path)
        encoder_dir, pooling, normalize, max_length = source, "mean", False, None
        note = f"{source} has no modules.json (not a sentence-transformers model): mean pooling of its encoder"
    if Path(encoder_dir).is_dir():
        check_model_folder(Path(encoder_dir))
    try:
        encoder = transformers.AutoModel.from_pretrained(str(encoder_dir))
    except (OSError, ValueError) as e:
        if Path(encoder_dir).is_dir():
            raise _local_load_error(str(encoder_dir), e) from e
        raise _offline_hint(source, e) from None
    if _is_vision_config(encoder.config):
        raise LunaConvertError(f"{source} is a vision model; --task embedding needs a text encoder")
    loaded = _with_transformers_preprocessing(SentenceEmbedder(encoder, pooling, normalize, max_length),
                                              encoder_dir, source)
    loaded.note = note
    return loaded


def _local_load_error(source: str, error: Exception) -> LunaConvertError:
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return LunaConvertError(f"cannot load the model in {source} ({type(error).__name__}: {reason}); the folder must "
                            "hold a complete transformers checkpoint (config.json and its weights) of a "
                            "sequence-, token- or image-classification, question-answering or encoder model")


def missing_local_folder(source: str) -> bool:
    """Whether ``source`` names a local folder that is not there rather than a hub id ("org/name"): it does not
    exist and starts with . / or ~, has more than one slash, or has one and its first part is a local folder
    (``outputs/<run>`` mistyped would otherwise be sent to the hub as a repository of "outputs")."""
    path = Path(source)
    if path.exists():
        return False
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or (source.count("/") == 1
                                                                          and path.parent.is_dir())


def check_model_folder(path: Path) -> None:
    """A local --model folder: a transformers checkpoint with whole weight files (read before any work)."""
    import json

    config_file = path / HF_CONFIG_FILE
    if (path / MODEL_DIR / CONVERSION_FILE).is_file():
        raise LunaConvertError(f"{path} is a luna-convert run folder, not a model: its converted model is {path / 'model'} "
                               f"(evaluate it with `luna-convert eval {path}`); to convert, pass the original model")
    if not config_file.is_file():
        raise LunaConvertError(f"{path} is not a model folder (no config.json or linear_attention.json); pass a folder "
                               "holding a transformers checkpoint or one written by luna_convert.save")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"{config_file} is not valid JSON ({e}); restore the model's config.json") from None
    if isinstance(config, dict) and "method" in config and "train" in config and "model_type" not in config:
        raise LunaConvertError(f"{path} is an unfinished luna-convert run (no model/ yet), not a model; resume it "
                               f"with `luna-convert run --resume {path}` or pass the original model")
    from safetensors import SafetensorError, safe_open

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError, ValueError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise LunaConvertError(f"{weights} is truncated or corrupt ({reason}); copy or download the model again") from None


def _with_transformers_preprocessing(model: nn.Module, files, source: str) -> LoadedModel:
    import transformers

    if _is_vision_config(model.config):
        try:
            processor = transformers.AutoImageProcessor.from_pretrained(files)
        except (OSError, ValueError):  # no processor saved: the model's own size, ViT's usual normalisation
            processor = None
        if processor is not None:
            image_config = _image_config_from_processor(processor, source)
        else:
            image_config = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "size": int(model.config.image_size)}
        return LoadedModel(model, "image", image_processor=processor, image_config=image_config, source=source)
    if Path(files).is_dir() and not any((Path(files) / name).is_file() for name in TOKENIZER_FILES):
        # transformers 5 would build a vocabulary-less tokenizer here: every word [UNK], silently
        raise LunaConvertError(f"no tokenizer files in {source} (looked for {', '.join(TOKENIZER_FILES[:4])}, ...); "
                               "save the tokenizer beside the model: tokenizer.save_pretrained(folder)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(files)
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"no tokenizer found for {source} ({e.__class__.__name__}); save the tokenizer "
                               "files beside the model") from None
    return LoadedModel(model, "text", tokenizer=tokenizer, source=source)
