"""sentence-transformers' input module for a luna-convert sentence embedding model.

A saved embedding model folder (:func:`luna_convert.save` of a
:class:`~luna_convert.sentence_embedding.SentenceEmbedder`) lists :class:`LunaTransformer` (named by import path) as
its first module, then sentence-transformers' own Pooling (and Normalize); ``SentenceTransformer(folder,
trust_remote_code=True)`` loads it. ``LunaTransformer.load`` rebuilds the converted encoder with
:func:`luna_convert.load` (safetensors only). Its ``load(path)`` takes the folder alone, the loading convention both
sentence-transformers 5.x and 6.x keep for custom modules. Nothing here imports sentence-transformers.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..errors import LunaConvertError
from ..sentence_embedding import SentenceEmbedder
from ..serialization import load, save


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
        with tempfile.TemporaryDirectory() as tmp:
            written = save(self.embedder, Path(tmp) / "model", tokenizer=self.tokenizer)
            shutil.copytree(written, output_path, dirs_exist_ok=True)
