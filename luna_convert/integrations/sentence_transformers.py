"""The sentence-transformers folder layout: reading a model's modules (``modules.json``, the Pooling config,
Normalize) and writing a converted :class:`~luna_convert.sentence_embedding.SentenceEmbedder` so that
``SentenceTransformer(folder)`` loads it.

A saved embedding model folder lists :class:`LunaTransformer` (this module's class, named by import path) as
its first module, then sentence-transformers' own Pooling (and Normalize). ``LunaTransformer.load`` rebuilds the
converted encoder with :func:`luna_convert.load` (safetensors only). Its ``load(path)`` takes the folder alone,
the loading convention both sentence-transformers 5.x and 6.x keep for custom modules. Nothing here imports
sentence-transformers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import LunaConvertError
from ..sentence_embedding import SentenceEmbedder

MODULES_FILE = "modules.json"
POOLING_DIR, NORMALIZE_DIR = "1_Pooling", "2_Normalize"
MODULE_CONFIG_FILE = "config.json"  # a Pooling module's settings, in its folder
SBERT_CONFIG_FILE = "sentence_bert_config.json"  # the input module's max_seq_length
# sentence-transformers' legacy Pooling keys (1_Pooling/config.json) -> the pooling mode each switches on
LEGACY_POOLING_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                       "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
SUPPORTED = "a Transformer, a Pooling (mean, cls or max) and optionally a Normalize module"


@dataclass(frozen=True)
class SentenceTransformersLayout:
    """What a sentence-transformers folder's modules say: where the encoder is, its pooling, normalisation and
    the longest input (``max_seq_length``; None when not given)."""

    encoder_dir: Path
    pooling: str
    normalize: bool
    max_length: int | None


def is_sentence_transformers_folder(path: Path) -> bool:
    return (Path(path) / MODULES_FILE).is_file()


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LunaConvertError(f"{path} ({what}) is unreadable ({type(e).__name__}); restore the model's file") from None


def _pooling_mode(config: dict, where: Path) -> str:
    """The one pooling mode of a Pooling config: the legacy ``pooling_mode_*`` switches or a ``pooling_mode``."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"] if isinstance(config["pooling_mode"], list) else [config["pooling_mode"]]
    else:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in ("mean", "cls", "max"):
        raise LunaConvertError(f"{where} asks for pooling {'+'.join(map(str, modes))}; luna-convert pools with one of "
                               "mean, cls or max (set one pooling_mode_* to true)")
    return modes[0]


def read_layout(folder: str | Path) -> SentenceTransformersLayout:
    """The modules of the sentence-transformers model in ``folder``; any other module type is refused."""
    folder = Path(folder)
    modules = _read_json(folder / MODULES_FILE, "the sentence-transformers module list")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise LunaConvertError(f"{folder / MODULES_FILE} must be a list of modules with a 'type' each; restore it")
    encoder_dir = pooling = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module["type"]).rsplit(".", 1)[-1]
        where = folder / str(module.get("path") or "")
        if kind == "Transformer" and encoder_dir is None:
            encoder_dir = where
        elif kind == "Pooling" and pooling is None:
            config_file = where / MODULE_CONFIG_FILE
            if not config_file.is_file():
                raise LunaConvertError(f"missing pooling config {config_file}; the sentence-transformers folder is "
                                       "incomplete, copy or download it again")
            pooling = _pooling_mode(_read_json(config_file, "the pooling config"), config_file)
        elif kind == "Normalize":
            normalize = True
        else:
            raise LunaConvertError(f"{folder / MODULES_FILE} lists module {module['type']} ({module.get('name', '?')}), "
                                   f"which luna-convert cannot convert; it reads {SUPPORTED}")
    if encoder_dir is None or pooling is None:
        missing = "Transformer" if encoder_dir is None else "Pooling"
        raise LunaConvertError(f"{folder / MODULES_FILE} has no {missing} module; luna-convert reads {SUPPORTED}")
    max_length = None
    sbert_config = encoder_dir / SBERT_CONFIG_FILE
    if sbert_config.is_file():
        max_length = _read_json(sbert_config, "the input settings").get("max_seq_length")
    return SentenceTransformersLayout(encoder_dir, pooling, normalize, max_length)


def write_layout(model: SentenceEmbedder, folder: Path) -> None:
    """modules.json, the Pooling config, Normalize and sentence_bert_config.json for ``model`` saved in ``folder``
    by :func:`luna_convert.save` (weights, config and tokenizer at the folder's root)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{__name__}.{LunaTransformer.__name__}"},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"}]
    if model.normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
        (folder / NORMALIZE_DIR).mkdir(exist_ok=True)
    (folder / POOLING_DIR).mkdir(exist_ok=True)
    # the legacy keys: what every sentence-transformers version reads
    pooling = {"word_embedding_dimension": int(model.config.hidden_size),
               **{key: mode == model.pooling for key, mode in LEGACY_POOLING_KEYS.items()}}
    (folder / POOLING_DIR / MODULE_CONFIG_FILE).write_text(json.dumps(pooling, indent=2))
    (folder / MODULES_FILE).write_text(json.dumps(modules, indent=2))
    if model.max_length:
        (folder / SBERT_CONFIG_FILE).write_text(json.dumps({"max_seq_length": int(model.max_length),
                                                            "do_lower_case": False}, indent=2))


class LunaTransformer(nn.Module):
    """sentence-transformers' input module for a luna-convert embedding model: tokenizes texts and gives the
    (converted) encoder's token embeddings; the Pooling and Normalize modules after it are sentence-transformers'
    own."""

    def __init__(self, embedder: SentenceEmbedder, tokenizer, max_seq_length: int | None = None):
        super().__init__()
        self.embedder = embedder
        self.tokenizer = tokenizer
        positions = getattr(embedder.config, "max_position_embeddings", None) or 512
        self.max_seq_length = int(max_seq_length or min(getattr(tokenizer, "model_max_length", positions), positions))

    @staticmethod
    def load(input_path: str) -> LunaTransformer:
        """The module saved in ``input_path`` (a luna-convert embedding model folder)."""
        import transformers

        from ..serialization import load

        embedder = load(input_path)
        if not isinstance(embedder, SentenceEmbedder):
            raise LunaConvertError(f"{input_path} holds a {type(embedder).__name__}, not a luna-convert sentence "
                                   "embedding model")
        return LunaTransformer(embedder, transformers.AutoTokenizer.from_pretrained(input_path), embedder.max_length)

    def tokenize(self, texts: list, **kwargs) -> dict[str, torch.Tensor]:
        """Padded, cut input tensors for ``texts`` (strings, or pairs as tuples)."""
        if texts and isinstance(texts[0], (tuple, list)):
            parts = [[t[0] for t in texts], [t[1] for t in texts]]
        else:
            parts = [[str(t) for t in texts]]
        return dict(self.tokenizer(*parts, padding=True, truncation="longest_first", max_length=self.max_seq_length,
                                   return_tensors="pt"))

    def forward(self, features: dict, **kwargs) -> dict:
        features["token_embeddings"] = self.embedder.token_embeddings(
            features["input_ids"], features.get("attention_mask"), features.get("token_type_ids"))
        return features

    def get_word_embedding_dimension(self) -> int:
        return int(self.embedder.config.hidden_size)

    def save(self, output_path: str, *args, **kwargs) -> None:
        """The encoder's files (luna_convert.save's) into ``output_path``; sentence-transformers writes the rest."""
        from ..serialization import save

        with tempfile.TemporaryDirectory() as tmp:
            written = save(self.embedder, Path(tmp) / "model", tokenizer=self.tokenizer)
            shutil.copytree(written, output_path, dirs_exist_ok=True)
