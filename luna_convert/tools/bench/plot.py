"""``bench.png``: layer time and memory against N, and the whole models' time ratios."""

from __future__ import annotations

import io
from pathlib import Path

from ...fileio import atomic_write_bytes
from .layers import SOFTMAX, SOFTMAX_EAGER


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    layers = results.get("layers")
    models = results.get("models")
    panels = [("fwd_ms", "forward time (ms)"), ("fwd_bwd_ms", "forward+backward time (ms)"),
              ("fwd_bwd_peak_mb", "forward+backward peak memory (MiB)")]
    fig, axes = plt.subplots(1, len(panels) + (1 if models else 0), figsize=(4.2 * (len(panels) + (1 if models else 0)), 3.6))
    if layers:
        methods = layers["config"]["methods"]
        for ax, (key, label) in zip(axes, panels):
            for m in methods:
                pts = sorted((r["n"], r[key]) for r in layers["results"] if r["method"] == m and r.get(key))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1.2, label=m,
                            ls="--" if m in (SOFTMAX, SOFTMAX_EAGER) else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_title(label, fontsize=9)
            ax.grid(True, which="both", lw=0.3)
        axes[0].legend(fontsize=7)
    if models:
        ax = axes[-1]
        labels, ratios = [], []
        for r in models["vit"]:
            labels.append(f"ViT {r['image_size']}px")
            ratios.append(r["ratio"])
        for r in models["bert"]:
            labels.append(f"BERT {r['tokens']}")
            ratios.append(r["ratio"])
        if models.get("bert_train"):
            labels.append("BERT train")
            ratios.append(models["bert_train"]["ratio"])
        ys = list(range(len(labels)))
        colors = ["tab:green" if x < 1 else "tab:orange" for x in ratios]
        ax.hlines(ys, 1.0, ratios, colors=colors, lw=2)
        ax.scatter(ratios, ys, c=colors, s=18, zorder=3)
        for y, x in zip(ys, ratios):
            ax.annotate(f"{x:.2f}", (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        lo, hi = min([*ratios, 1.0]) / 1.25, max([*ratios, 1.0]) * 1.3
        ax.set_xlim(lo, hi)
        ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0) if lo <= t <= hi]
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(ys, labels)
        ax.set_title(f"whole models: {models['method']} / original time", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="x", which="both", lw=0.3)
        ax.invert_yaxis()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
