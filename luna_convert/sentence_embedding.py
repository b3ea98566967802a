"""Sentence embeddings: a text encoder plus pooling, as one module whose forward gives one vector a text, and
the sentence-transformers folder layout around it.

:class:`SentenceEmbedder` wraps a transformers encoder (``BertModel``, ...) with the pooling of a
sentence-transformers model (mean over the real tokens, the first token, or the max over the real tokens)
and an optional L2 normalisation. It is what the embedding task converts, trains, saves and loads (its
attention modules are the encoder's). :func:`read_layout` reads a sentence-transformers folder's modules
(``modules.json``, the Pooling config, Normalize); :func:`write_layout` writes them for a saved model, its first
module luna-convert's (``luna_convert.integrations.sentence_transformers.LunaTransformer``).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import LunaConvertError

POOLING_MODES = ("mean", "cls", "max")


def pool(token_embeddings: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """One vector a text from token embeddings [B, S, D] and the attention mask [B, S] (1 on real tokens),
    as sentence-transformers' Pooling computes it: "mean" over the real tokens, "cls" the first real token,
    "max" the elementwise max over the real tokens. Padding never counts."""
    if attention_mask is None:
        attention_mask = torch.ones(token_embeddings.shape[:2], dtype=torch.long, device=token_embeddings.device)
    real = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)  # [B, S, 1]
    if mode == "mean":
        return (token_embeddings * real).sum(1) / real.sum(1).clamp(min=1e-9)
    if mode == "cls":
        first = attention_mask.to(torch.int).argmax(dim=1)  # the first real token (left padding too)
        return token_embeddings[torch.arange(token_embeddings.shape[0], device=first.device), first]
    if mode == "max":
        return token_embeddings.masked_fill(real == 0, float("-inf")).max(dim=1).values
    raise LunaConvertError(f"unknown pooling mode {mode!r}; use one of {', '.join(POOLING_MODES)}")


class SentenceEmbedder(nn.Module):
    """``encoder`` (a transformers base model) followed by ``pooling`` and, if ``normalize``, L2
    normalisation: ``forward(input_ids, attention_mask, token_type_ids)`` gives embeddings [B, D].
    ``max_length``: the longest input in tokens sentence-transformers cuts texts to (None: the tokenizer's)."""

    def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = False,
                 max_length: int | None = None):
        super().__init__()
        if pooling not in POOLING_MODES:
            raise LunaConvertError(f"unknown pooling mode {pooling!r}; use one of {', '.join(POOLING_MODES)}")
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.max_length = max_length
        # DistilBERT-style encoders take no token_type_ids
        self._takes_token_types = "token_type_ids" in inspect.signature(encoder.forward).parameters

    @property
    def config(self):
        """The encoder's transformers config (what the tokenizer and input checks read)."""
        return self.encoder.config

    def spec(self) -> dict:
        """What rebuilds this wrapper around a rebuilt encoder (saved in the model folder's metadata)."""
        return {"pooling": self.pooling, "normalize": self.normalize, "max_length": self.max_length}

    def token_embeddings(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's last hidden states [B, S, D]."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self._takes_token_types:
            inputs["token_type_ids"] = token_type_ids
        return self.encoder(**inputs).last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        pooled = pool(self.token_embeddings(input_ids, attention_mask, token_type_ids), attention_mask, self.pooling)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled


# sentence-transformers' input module of a saved luna-convert embedding model (named, not imported: it imports this)
INPUT_MODULE = "luna_convert.integrations.sentence_transformers.LunaTransformer"
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
    modules = [{"idx": 0, "name": "0", "path": "", "type": INPUT_MODULE},
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
