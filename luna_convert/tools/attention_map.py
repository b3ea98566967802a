"""Attention maps: where the CLS token looks, under softmax and under linear attention
(the LUNA paper's Figure 4).

For one input and one converted attention layer, the q and k that layer computes are captured
with a forward pre-hook on its :class:`~luna_convert.layers.attention.LinearAttention`. From them:

    softmax row  softmax(q_cls k^T * scale) over real keys   (linear_attention.softmax_attention_weights)
    linear row   phi(q_cls)^T phi(k_j) / sum_m phi(q_cls)^T phi(k_m)   (LinearAttention.attention_weights)

each averaged over heads. By default both rows come from the same forward pass of the converted
model (``original="converted"``): the softmax row is what softmax attention would do with the
converted model's own queries and keys. ``original="teacher"`` (a run folder: the original
model its config names) or ``original=<model folder>`` takes the softmax row from the original,
unconverted model instead, run exactly as softmax (a converted copy in distillation mode, which
computes softmax attention and hands q and k to the same hook). The linear map is the kernel
attention matrix only; LUNA's depthwise-convolution branch adds to the layer output outside it.

Text: a heat strip over the tokens. Images: the CLS row over the patch grid (prefix tokens such
as registers left out), drawn as an alpha-tinted overlay on the picture the model saw.
"""

from __future__ import annotations

import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LunaConvertError
from ..folder_layout import CONFIG_FILE, CONVERSION_FILE, MODEL_DIR
from ..adapters import vision_grid
from ..conversion import CONFIG_ATTR, convert, is_converted, linear_attention_modules
from ..data import image_transform
from ..engine.head_fit import captured_inputs
from ..engine.training import forward_logits
from ..fileio import atomic_write_bytes
from ..layers.attention import AttentionMode
from ..ops.reference import softmax_attention_weights
from ..run.config import RunConfig
from ..run.models import load_model
from ..run.teachers import builtin_dir

ORIGINAL_CHOICES = "converted, teacher or a model folder"


@dataclass
class AttentionMap:
    """CLS rows of one layer, averaged over heads (``*_heads``: per head), for one input."""

    kind: str  # "text" | "image"
    layer: int  # index among the converted attention layers, 0-based
    num_layers: int
    method: str
    softmax: np.ndarray  # [N], sums to 1
    linear: np.ndarray  # [N], sums to 1 (up to the kernel's eps)
    softmax_heads: np.ndarray  # [H, N]
    linear_heads: np.ndarray  # [H, N]
    original: str = "converted"  # where the softmax row comes from
    query_index: int | None = 0  # the CLS position; None: no class token, rows averaged over queries
    tokens: list[str] | None = None  # text
    picture: np.ndarray | None = None  # image: [H, W, 3] in [0, 1], what the model saw
    grid: tuple[int, int] | None = None
    num_prefix: int = 0

    def patch_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """Image: the two rows over the patch grid ([gh, gw] each; prefix tokens dropped)."""
        if self.grid is None:
            raise ValueError("not an image attention map")
        gh, gw = self.grid
        return tuple(row[self.num_prefix:self.num_prefix + gh * gw].reshape(gh, gw) for row in (self.softmax, self.linear))


# ---------------------------------------------------------------------- capture
def _layer(model, layer: int):
    layers = linear_attention_modules(model)
    if not layers:
        raise LunaConvertError("this model has no linear attention layers: attention maps compare a converted "
                               "model's softmax and linear attention; pass a run folder or a converted model")
    index = layer + len(layers) if layer < 0 else layer
    if not 0 <= index < len(layers):
        raise LunaConvertError(f"--layer {layer} is out of range: the model has {len(layers)} converted attention "
                               f"layers (0..{len(layers) - 1}, or -1 for the last)")
    return layers, index


def capture_qk(model, forward, layer: int = -1) -> dict:
    """Run ``forward()`` (no grad) and return what the chosen layer's linear attention received:
    ``{"module", "index", "num_layers", "q", "k", "key_mask"}`` with q, k of shape [B, H, N, d]."""
    import torch

    layers, index = _layer(model, layer)
    module = layers[index]
    with captured_inputs([module]) as calls, torch.no_grad():
        forward()
    seen = {name: calls[0][-1][name] for name in ("q", "k", "key_mask")} if calls[0] else {}  # the last call
    if not seen:
        raise LunaConvertError("the chosen attention layer was not called by the forward pass")
    return {"module": module, "index": index, "num_layers": len(layers), **seen}


def attention_rows(captured: dict, query_index: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-head query rows of the softmax and linear attention matrices of the first example:
    ([H, N], [H, N]). ``query_index`` None averages the rows of all real queries."""
    import torch

    module, q, k, mask = captured["module"], captured["q"], captured["k"], captured["key_mask"]
    with torch.no_grad():
        soft = softmax_attention_weights(q, k, module.softmax_scale, mask)[0]  # [H, N, N]
        lin = module.attention_weights(q, k, mask)[0]
    if query_index is not None:
        return soft[:, query_index].cpu().numpy(), lin[:, query_index].cpu().numpy()
    real = slice(None) if mask is None else mask[0]
    return soft[:, real].mean(1).cpu().numpy(), lin[:, real].mean(1).cpu().numpy()


def _as_softmax_model(model):
    """The original (unconverted) model, run as exact softmax attention with q and k exposed: a
    converted copy whose linear layers run as softmax (``AttentionMode.SOFTMAX``)."""

    if is_converted(model):
        raise LunaConvertError("the --original model is already converted; pass the original softmax model")
    twin = copy.deepcopy(model)
    convert(twin, "t2r")  # any method: softmax mode never uses its feature map
    for module in linear_attention_modules(twin):
        module.set_mode(AttentionMode.SOFTMAX)  # for good: the twin is this command's own copy
    return twin.eval()


# ----------------------------------------------------------------------- inputs
def _text_inputs(loaded, text: str) -> tuple[dict, list[str]]:
    if loaded.tokenizer is None:
        raise LunaConvertError("this is an image model: pass --image PATH instead of --text")
    if not text.strip():
        raise LunaConvertError("--text is empty; pass a sentence")
    encoded = loaded.tokenizer(text, return_tensors="pt", truncation=True,
                               max_length=getattr(loaded.model.config, "max_position_embeddings", 512))
    inputs = {k: v for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    return inputs, loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())


def open_image(spec: str):
    """A PIL RGB image from a file, or ``digits:N``: scikit-learn's digit image N, upscaled to 32x32
    like the digits task (offline; handy with the demo model)."""
    from PIL import Image, UnidentifiedImageError

    if spec.startswith("digits:"):
        from sklearn.datasets import load_digits

        digits = load_digits()
        try:
            index = int(spec.split(":", 1)[1])
            pixels = digits.images[index]
        except (ValueError, IndexError):
            raise LunaConvertError(f"--image {spec}: use digits:N with N in 0..{len(digits.images) - 1}") from None
        array = np.clip(np.rint(pixels * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        return Image.fromarray(array).resize((32, 32), Image.NEAREST).convert("RGB")
    path = Path(spec)
    if not path.is_file():
        raise LunaConvertError(f"image {spec} does not exist; pass an image file (or digits:N)")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise LunaConvertError(f"cannot read image {spec} ({type(e).__name__}); pass a PNG or JPEG file") from None


def _image_inputs(loaded, image) -> tuple[dict, np.ndarray]:
    if loaded.kind != "image":
        raise LunaConvertError("this is a text model: pass --text \"...\" instead of --image")
    cfg = loaded.image_config
    pixels = image_transform(cfg["mean"], cfg["std"], cfg["size"], train=False)(image)
    mean, std = (np.asarray(cfg[k], dtype=np.float32)[:, None, None] for k in ("mean", "std"))
    picture = np.clip(pixels.numpy() * std + mean, 0, 1).transpose(1, 2, 0)
    return {"pixel_values": pixels[None]}, picture


def _prefix_and_grid(model, num_tokens: int) -> tuple[int, tuple[int, int]]:
    grid = vision_grid(model)
    prefix = getattr(model, "num_prefix_tokens", None)
    if grid is None or prefix is None:
        side = int(np.sqrt(num_tokens))
        grid = grid if grid is not None and grid[0] * grid[1] <= num_tokens else (side, side)
        prefix = num_tokens - grid[0] * grid[1] if prefix is None else prefix
    return int(prefix), tuple(grid)


def _query_index(model, kind: str) -> int | None:
    if kind == "image" and hasattr(model, "cls_token") and getattr(model, "cls_token") is None:
        return None  # a timm ViT pooled without a class token
    return 0


# ------------------------------------------------------------------------- maps
def compute_attention_map(loaded, text: str | None = None, image=None, layer: int = -1, original_model=None,
                          original_name: str = "converted") -> AttentionMap:
    """The CLS rows of ``layer`` for one text or one PIL image. ``loaded``: a
    :class:`~luna_convert.model_building.LoadedModel` of a converted model; ``original_model``: the
    unconverted model for the softmax row (None: the converted model's own q, k)."""

    if (text is None) == (image is None):
        raise LunaConvertError("pass exactly one of --text \"...\" or --image PATH")
    model = loaded.model.eval()
    if text is not None:
        inputs, tokens = _text_inputs(loaded, text)
        picture = None
    else:
        inputs, picture = _image_inputs(loaded, image)
        tokens = None
    kind = "text" if text is not None else "image"
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    captured = capture_qk(model, lambda: forward_logits(model, inputs), layer)
    query = _query_index(model, kind)
    soft_heads, lin_heads = attention_rows(captured, query)
    if original_model is not None:
        teacher = _as_softmax_model(original_model).to(device)
        teacher_captured = capture_qk(teacher, lambda: forward_logits(teacher, inputs), captured["index"])
        soft_heads, _ = attention_rows(teacher_captured, query)
    conversion = getattr(model, CONFIG_ATTR, None)
    amap = AttentionMap(kind=kind, layer=captured["index"], num_layers=captured["num_layers"],
                        method=conversion.method if conversion is not None else "linear",
                        softmax=soft_heads.mean(0), linear=lin_heads.mean(0), softmax_heads=soft_heads,
                        linear_heads=lin_heads, original=original_name, query_index=query, tokens=tokens,
                        picture=picture)
    if kind == "image":
        amap.num_prefix, amap.grid = _prefix_and_grid(model, len(amap.softmax))
    return amap


# ------------------------------------------------------------------------ render
def render(amap: AttentionMap, path: str | Path, title: str | None = None) -> Path:
    """Draw the two rows (softmax above linear) and write a PNG atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    who = "CLS" if amap.query_index is not None else "mean query"
    soft_label = "softmax" + (" (original model)" if amap.original != "converted" else "")
    lin_label = f"linear ({amap.method})"
    heading = title or f"{who} attention, layer {amap.layer + 1} of {amap.num_layers}, averaged over heads"
    if amap.kind == "text":
        fig = _render_text(Figure, amap, soft_label, lin_label, heading)
    else:
        fig = _render_image(Figure, amap, soft_label, lin_label, heading)
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    path = Path(path)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _render_text(Figure, amap: AttentionMap, soft_label: str, lin_label: str, heading: str):
    n = len(amap.tokens)
    fig = Figure(figsize=(min(40.0, max(6.0, 0.5 * n + 1.5)), 3.2))
    axes = fig.subplots(2, 1, sharex=True)
    vmax = float(max(amap.softmax.max(), amap.linear.max()))
    for ax, row, label in zip(axes, (amap.softmax, amap.linear), (soft_label, lin_label)):
        image = ax.imshow(row[None, :], aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax)
        ax.set_yticks([0], [label])
        for j, value in enumerate(row):
            ax.text(j, 0, f"{value:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 0.6 * vmax else "black")
    axes[-1].set_xticks(range(n), amap.tokens, rotation=60, ha="right", fontsize=9)
    fig.colorbar(image, ax=list(axes), fraction=0.025, pad=0.01)
    fig.suptitle(heading, fontsize=10)
    return fig


def _overlay(picture: np.ndarray, patch_map: np.ndarray, vmin: float, vmax: float, cmap) -> np.ndarray:
    """RGB picture tinted by the map: colour from ``cmap``, opacity growing with attention."""
    from PIL import Image

    h, w = picture.shape[:2]
    scaled = np.clip((patch_map - vmin) / max(vmax - vmin, 1e-12), 0, 1).astype(np.float32)
    upsampled = np.asarray(Image.fromarray(scaled).resize((w, h), Image.NEAREST))
    colour = cmap(upsampled)[..., :3]
    alpha = 0.15 + 0.7 * upsampled[..., None]
    return (1 - alpha) * picture + alpha * colour


def _render_image(Figure, amap: AttentionMap, soft_label: str, lin_label: str, heading: str):
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    soft, lin = amap.patch_maps()
    # One colour scale for both panels, from the lowest to the highest patch weight of either:
    # the two maps stay comparable, and a nearly uniform map still shows its structure.
    vmin, vmax = float(min(soft.min(), lin.min())), float(max(soft.max(), lin.max()))
    cmap = colormaps["inferno"]
    fig = Figure(figsize=(10.5, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].imshow(amap.picture, interpolation="nearest")
    axes[0].set_title("input", fontsize=9)
    for ax, grid_map, row, label in zip(axes[1:], (soft, lin), (amap.softmax, amap.linear), (soft_label, lin_label)):
        ax.imshow(_overlay(amap.picture, grid_map, vmin, vmax, cmap), interpolation="nearest")
        prefix = float(row[:amap.num_prefix].sum())
        note = f"\n{100 * prefix:.0f}% on prefix tokens" if amap.num_prefix else ""
        ax.set_title(f"{label}{note}", fontsize=9)
    for ax in axes:
        ax.set_axis_off()
    fig.colorbar(ScalarMappable(Normalize(vmin, vmax), cmap), ax=list(axes[1:]), fraction=0.03, pad=0.02,
                 label="attention weight per patch")
    fig.suptitle(heading, fontsize=10)
    return fig


# ------------------------------------------------------------------------ the command
def _resolve(path: Path) -> tuple[Path, RunConfig | None]:
    """(converted model folder, run config or None) for a run folder or a saved model folder."""
    if not path.exists():
        raise LunaConvertError(f"{path} does not exist; pass a run folder (outputs/<run>) or a converted model folder")
    if (path / MODEL_DIR / CONVERSION_FILE).is_file():
        try:
            config = RunConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        except (OSError, ValueError, LunaConvertError):  # only --original teacher needs it, and says so
            config = None
        return path / MODEL_DIR, config
    if (path / CONVERSION_FILE).is_file():
        return path, None
    if (path / CONFIG_FILE).is_file() and not (path / MODEL_DIR).exists():
        raise LunaConvertError(f"{path} has no converted model (a transformers checkpoint, or a run that has not "
                               "finished): pass a finished run folder or a folder written by luna_convert.save")
    raise LunaConvertError(f"{path} is not a run folder or a converted model folder (no linear_attention.json); "
                           "pass outputs/<run> or a folder written by luna_convert.save")


def _original_model(original: str, run_dir: Path, run_config: RunConfig | None, num_labels: int):
    if original == "converted":
        return None, "converted"
    if original == "teacher":
        if run_config is None:
            raise LunaConvertError("--original teacher needs a run folder (its config names the original model); "
                                   "for a saved model pass --original /path/to/original/model")
        source = str(run_config.model)
        if source.startswith("builtin:"):
            name = source.split(":", 1)[1]

            # shipped in the package (checked), or cached beside the run
            candidates = [builtin_dir(name, run_dir.parent), builtin_dir(name, run_config.output_dir)]
            found = next((c for c in candidates if (c / CONVERSION_FILE).is_file()), None)
            if found is None:
                raise LunaConvertError(f"the run's original model {source} is not cached (looked in "
                                       f"{', '.join(map(str, candidates))}); pass --original PATH")
            source = str(found)
        return load_model(source, num_labels).model, source
    path = Path(original)
    if not path.exists():
        raise LunaConvertError(f"--original must be {ORIGINAL_CHOICES}; {original} does not exist")
    return load_model(str(path), num_labels).model, str(path)


def attention_map_command(path: str | Path, text: str | None = None, image: str | None = None, layer: int = -1,
                          output: str | Path | None = None, original: str = "converted",
                          overwrite: bool = False) -> tuple[Path, AttentionMap]:
    """What ``luna-convert attention-map`` does: load, compute, render; returns (PNG path, map)."""

    if (text is None) == (image is None):
        raise LunaConvertError("pass exactly one of --text \"...\" or --image PATH")
    model_dir, run_config = _resolve(Path(path))
    name = Path(path).resolve().name if model_dir.name != MODEL_DIR else model_dir.parent.resolve().name
    picture = open_image(image) if image is not None else None
    out = Path(output) if output is not None else Path(f"attention-map-{name}-layer{layer}.png")
    if out.exists() and not overwrite:
        raise LunaConvertError(f"{out} already exists; pass --overwrite or another --output")
    if out.suffix.lower() != ".png":
        raise LunaConvertError(f"--output {out} must end in .png")
    loaded = load_model(str(model_dir))
    original_model, original_name = _original_model(original, model_dir.parent, run_config, loaded.num_labels)
    amap = compute_attention_map(loaded, text=text, image=picture, layer=layer, original_model=original_model,
                                 original_name=original_name)
    return render(amap, out), amap
