"""The patch grid of the image a vision model runs on, for the spatial DWC branch of converted attention."""

from __future__ import annotations

from torch import nn

from ..errors import ConversionError


class PatchGrid:
    """The patch grid of the image a ViT is running on, for the DWC branch of its converted attention.

    A forward hook on the model's patch-embedding convolution records the grid of every input, so
    another resolution (transformers' ``interpolate_pos_encoding``, timm's ``dynamic_img_size``) and
    non-square images get their true grid; the model's converted attention modules share this
    object. Tokens before the grid (CLS, registers, distillation token) are the prefix.
    """

    def __init__(self, configured: tuple[int, int], source: nn.Module | None):
        self.configured = configured
        self.current: tuple[int, int] | None = None  # the grid of the latest input
        self._source = source  # hooked on ``attach`` (then dropped, so copies do not hook it twice)
        self._attached = False

    def attach(self) -> None:
        if self._attached:
            return
        if self._source is None:
            raise ConversionError("cannot find the patch-embedding convolution of this vision model, which tells the "
                                  "DWC branch (and cosformer's prefix tokens) the patch grid of each image; convert "
                                  "with dwc=False (cosformer: prefix_neutral=False)")
        self._source.register_forward_hook(self._record)
        self._source, self._attached = None, True

    def _record(self, module, inputs, output) -> None:
        self.current = (int(output.shape[-2]), int(output.shape[-1]))

    def layout(self, num_tokens: int) -> tuple[tuple[int, int], int]:
        """(grid, number of prefix tokens) of a sequence of ``num_tokens`` tokens."""
        gh, gw = self.current or self.configured
        prefix = num_tokens - gh * gw
        if prefix < 0:
            raise ValueError(f"DWC: {num_tokens} tokens cannot hold the {gh}x{gw} patch grid of this input (tokens "
                             "dropped, e.g. by patch dropout?); the depthwise convolution needs every patch")
        return (gh, gw), prefix


def vision_grid(model: nn.Module) -> tuple[int, int] | None:
    """The patch grid of a ViT (timm or transformers) at its configured image size, or None for a text model."""
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "grid_size", None) is not None:
        return tuple(patch_embed.grid_size)
    config = getattr(model, "config", None)
    image_size, patch_size = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if image_size is None or patch_size is None:
        return None
    pair = lambda x: tuple(x) if isinstance(x, (list, tuple)) else (x, x)  # noqa: E731
    (ih, iw), (ph, pw) = pair(image_size), pair(patch_size)
    return ih // ph, iw // pw


def patch_embedding_conv(model: nn.Module) -> nn.Module | None:
    """The convolution that cuts a ViT's image into patches (its output is the patch grid)."""
    timm_proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    if isinstance(timm_proj, nn.Conv2d):
        return timm_proj
    return next((m for name, m in model.named_modules()
                 if isinstance(m, nn.Conv2d) and "embed" in name and m.stride == m.kernel_size), None)


def patch_grid(model: nn.Module) -> PatchGrid | None:
    """What tells a vision model's DWC branch the patch grid of each input; None for a text model."""
    configured = vision_grid(model)
    return None if configured is None else PatchGrid(configured, patch_embedding_conv(model))
