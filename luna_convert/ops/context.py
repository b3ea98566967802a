"""The per-call context a feature map or kernel may use beyond each token's own vector.

Most maps are token-wise and ignore it. It exists for maps that need where a token sits
among the real tokens of its example (cosFormer's re-weighting), or which keys are real
(a norm stabiliser taken over real keys only, as Performer's), and for ViT's prefix tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttentionContext:
    """What one attention call knows about its tokens.

    key_mask    bool [B, N] over the whole sequence, True = real token (None: all real)
    tokens      N, the whole sequence's length
    num_prefix  tokens before the patch grid (ViT CLS / registers); 0 for text
    grid        (h, w) of the patch grid for images, else None
    role        "query" or "key": which side a shared map is being applied to
    start, stop the tokens of this view (the whole sequence, or one chunk of the streamed path)
    """

    key_mask: torch.Tensor | None
    tokens: int
    num_prefix: int = 0
    grid: tuple[int, int] | None = None
    role: str = "query"
    start: int = 0
    stop: int | None = None

    @property
    def view(self) -> slice:
        return slice(self.start, self.tokens if self.stop is None else self.stop)

    def rows(self, rows: slice) -> "AttentionContext":
        """The context of tokens ``rows`` of this view (``rows`` relative to this view's start)."""
        start, stop, _ = rows.indices(self.view.stop - self.start)
        return replace(self, start=self.start + start, stop=self.start + stop)

    def for_role(self, role: str) -> "AttentionContext":
        return replace(self, role=role)

    @property
    def view_mask(self) -> torch.Tensor | None:
        """key_mask of this view's tokens, [B, n] (None: all real)."""
        return None if self.key_mask is None else self.key_mask[:, self.view]

    @property
    def lengths(self) -> torch.Tensor | None:
        """Real tokens per example, [B] (None: all N are real)."""
        return None if self.key_mask is None else self.key_mask.sum(-1)

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Rank of each token of this view among the real tokens of its example, [B or 1, n] (int64).

        Pads carry the rank of the last real token before them; their features are masked anyway.
        """
        if self.key_mask is None:
            return torch.arange(self.view.start, self.view.stop, device=device)[None]
        return (torch.cumsum(self.key_mask.long(), -1) - 1).clamp_min(0)[:, self.view]
