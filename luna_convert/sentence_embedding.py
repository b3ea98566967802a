"""Sentence embeddings: a text encoder plus pooling, as one module whose forward gives one vector a text.

:class:`SentenceEmbedder` wraps a transformers encoder (``BertModel``, ...) with the pooling of a
sentence-transformers model (mean over the real tokens, the first token, or the max over the real tokens)
and an optional L2 normalisation. It is what the embedding task converts, trains, saves and loads (its
attention modules are the encoder's); ``luna_convert.integrations.sentence_transformers`` reads and writes
the sentence-transformers folder layout around it.
"""

from __future__ import annotations

import inspect

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
