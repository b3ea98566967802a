"""The bench's results as tables: rich tables on the console, GitHub markdown in ``bench.md``."""

from __future__ import annotations

from .long_models import LONG_VARIANTS

VIEWS_IN_BRACKETS = "in brackets, those that only make a view (no data moved)"


def operator_calls_cell(row: dict) -> str:
    """A layer's calls per forward for a table, "37 (17)": all of them, and in brackets the views among them
    (rows of bench.json written before views were counted show the total alone)."""
    views = row.get("fwd_view_ops")
    return str(row["fwd_ops"]) if views is None else f"{row['fwd_ops']} ({views})"


def _ms_and_ratio(cell: dict, key: str) -> str:
    """``"1234 (x0.81)"`` for a long-model cell's value and its ratio to the original; "-" where not measured."""
    if key not in cell:
        return "-"
    ratio = cell.get(f"{key}_ratio")
    return f"{cell[key]:.0f}" + (f" (x{ratio:.2f})" if ratio is not None else "")


def print_tables(results: dict, console) -> None:
    from rich.table import Table

    for section in ("layers", "layers_busy"):
        layers = results.get(section)
        if not layers:
            continue
        methods = layers["config"]["methods"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        lengths = layers["config"]["lengths"]
        for key, title in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
            table = Table(title=f"Attention layer {title} time, ms (speed-up vs softmax)  "
                                f"[{layers['config']['heads']}x{layers['config']['head_dim']}, batch {layers['config']['batch']}]"
                                + _load_label(layers))
            table.add_column("N", justify="right")
            for m in methods:
                table.add_column(m, justify="right")
            for n in lengths:
                cells = []
                for m in methods:
                    r = by.get((m, n))
                    if r is None:
                        cells.append("-")
                        continue
                    sp = r.get("fwd_speedup_vs_softmax" if key == "fwd_ms" else "fwd_bwd_speedup_vs_softmax")
                    cells.append(f"{r[key]:.1f}" + (f" ({sp:.1f}x)" if sp else ""))
                table.add_row(str(n), *cells)
            slope_key = key.replace("_ms", "")
            table.add_row("slope", *[f"{s:.2f}" if (s := layers['slopes'][m].get(slope_key)) is not None else "-" for m in methods])
            console.print(table)
    layers = results.get("layers")
    if layers:
        methods, lengths = layers["config"]["methods"], layers["config"]["lengths"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}

        def per_length_table(title: str, key: str, cell) -> None:
            """One row per N, one column per method: ``cell(result)`` where the result has ``key``."""
            if not any(key in r for r in layers["results"]):
                return
            table = Table(title=title)
            table.add_column("N", justify="right")
            for m in methods:
                table.add_column(m, justify="right")
            for n in lengths:
                table.add_row(str(n), *[cell(by[(m, n)]) if key in by.get((m, n), {}) else "-" for m in methods])
            console.print(table)

        per_length_table(f"Attention layer aten operator calls per forward (no grad); {VIEWS_IN_BRACKETS}", "fwd_ops",
                         operator_calls_cell)
        per_length_table("Attention layer peak tensor memory, MiB: forward (no grad) / forward+backward",
                         "fwd_peak_mb", lambda r: f"{r['fwd_peak_mb']:.0f} / {r['fwd_bwd_peak_mb']:.0f}")
    models = results.get("models")
    if models:
        table = Table(title=f"Whole models, original vs converted ({models['method']}), ms (median)")
        for col in ("model", "input", "original", "converted", "converted/original"):
            table.add_column(col, justify="right" if col != "model" else "left")
        for r in models["vit"]:
            table.add_row("ViT-B/16 inference", f"{r['image_size']}px, {r['tokens']} tok", f"{r['original_ms']:.0f}",
                          f"{r['converted_ms']:.0f}", f"{r['ratio']:.2f}")
        for r in models["bert"]:
            table.add_row("BERT-base inference", f"{r['tokens']} tok", f"{r['original_ms']:.0f}", f"{r['converted_ms']:.0f}",
                          f"{r['ratio']:.2f}")
        if models.get("bert_train"):
            r = models["bert_train"]
            table.add_row("BERT-base train step", f"{r['batch']}x{r['tokens']} tok", f"{r['original_ms']:.0f}",
                          f"{r['converted_ms']:.0f}", f"{r['ratio']:.2f}")
        console.print(table)
    long = results.get("long_models")
    if long:
        table = Table(title=f"{long['model']}, batch 1, original vs converted ({long['method']}): inference / train "
                            "step ms (x original)")
        table.add_column("tokens", justify="right")
        for v in LONG_VARIANTS:
            table.add_column(v, justify="right")
        for r in long["rows"]:
            table.add_row(str(r["tokens"]), *[f"{_ms_and_ratio(r[v], 'fwd_ms')} / {_ms_and_ratio(r[v], 'train_ms')}"
                                              for v in LONG_VARIANTS])
        console.print(table)
        table = Table(title=f"{long['dinov2_model']} inference, positions interpolated, ms")
        for col in ("image", "tokens", "original", "converted", "converted/original"):
            table.add_column(col, justify="right")
        for r in long["dinov2"]:
            table.add_row(f"{r['image_size']}px", str(r["tokens"]), f"{r['original_ms']:.0f}", f"{r['converted_ms']:.0f}",
                          f"{r['ratio']:.2f}")
        console.print(table)


def _load_label(layers: dict) -> str:
    """Title suffix of a layer table timed under a background load ("" for the idle run)."""
    load = layers.get("background")
    if not load:
        return ""
    return (f", with {load['processes']} background process(es) multiplying {load['matmul_size']}x"
            f"{load['matmul_size']} matrices ({load['matmuls']} products during the timing)")


def markdown_tables(results: dict) -> str:
    """The result tables as GitHub markdown (what ``bench.md`` holds)."""
    lines: list[str] = []
    layers, models = results.get("layers"), results.get("models")
    for section in ("layers", "layers_busy"):
        if not results.get(section):
            continue
        cfg = results[section]["config"]
        methods, lengths = cfg["methods"], cfg["lengths"]
        by = {(r["method"], r["n"]): r for r in results[section]["results"]}
        for key, title in (("fwd_ms", "forward (no grad)"), ("fwd_bwd_ms", "forward + backward")):
            speed = "fwd_speedup_vs_softmax" if key == "fwd_ms" else "fwd_bwd_speedup_vs_softmax"
            lines += [f"**Attention layer, {title}: median ms (speed-up vs softmax SDPA)**, "
                      f"{cfg['heads']} heads x {cfg['head_dim']}, batch {cfg['batch']}, {cfg['dtype']}"
                      + _load_label(results[section]), "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = []
                for m in methods:
                    r = by.get((m, n))
                    cells.append("-" if r is None else f"{r[key]:.1f}" + (f" ({r[speed]:.1f}x)" if r.get(speed) else ""))
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            slope_key = key.replace("_ms", "")
            cells = [f"{s:.2f}" if (s := results[section]["slopes"][m].get(slope_key)) is not None else "-"
                     for m in methods]
            lines += ["| log-log slope | " + " | ".join(cells) + " |", ""]
    if layers:
        methods, lengths = layers["config"]["methods"], layers["config"]["lengths"]
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        if any("fwd_ops" in r for r in layers["results"]):
            lines += [f"**Attention layer, aten operator calls per forward (no grad); {VIEWS_IN_BRACKETS}**", "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = [operator_calls_cell(by[(m, n)]) if "fwd_ops" in by.get((m, n), {}) else "-" for m in methods]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
        if any("fwd_bwd_peak_mb" in r for r in layers["results"]):
            lines += ["**Attention layer, peak tensor memory: forward / forward + backward, MiB**", "",
                      "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
            for n in lengths:
                cells = [f"{by[(m, n)]['fwd_peak_mb']:.1f} / {by[(m, n)]['fwd_bwd_peak_mb']:.1f}"
                         if (m, n) in by and "fwd_peak_mb" in by[(m, n)] else "-" for m in methods]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    if models:
        lines += [f"**Whole models, original vs converted with `{models['method']}` (random init), median ms**", "",
                  "| model | input | original | converted | converted / original |", "|---|---:|---:|---:|---:|"]
        for r in models["vit"]:
            lines.append(f"| ViT-B/16 inference | {r['image_size']} px ({r['tokens']} tokens) | {r['original_ms']:.0f} | "
                         f"{r['converted_ms']:.0f} | {r['ratio']:.2f} |")
        for r in models["bert"]:
            lines.append(f"| BERT-base inference | {r['tokens']} tokens | {r['original_ms']:.0f} | {r['converted_ms']:.0f} | "
                         f"{r['ratio']:.2f} |")
        if models.get("bert_train"):
            r = models["bert_train"]
            lines.append(f"| BERT-base train step (AdamW) | {r['batch']} x {r['tokens']} tokens | {r['original_ms']:.0f} | "
                         f"{r['converted_ms']:.0f} | {r['ratio']:.2f} |")
        lines.append("")
    long = results.get("long_models")
    if long:
        lines += [f"**{long['model']} ({long['layers']} layers, {long['hidden']} wide, local window {long['window']}), "
                  f"batch 1, original vs converted with `{long['method']}` (random init), median ms "
                  "(x original); train step peak tensor memory, MiB**", "",
                  "| tokens | " + " | ".join(f"{v}: inference | {v}: train step | {v}: train memory"
                                             for v in LONG_VARIANTS) + " |",
                  "|---:|" + "---:|" * (3 * len(LONG_VARIANTS))]
        for r in long["rows"]:
            cells = []
            for v in LONG_VARIANTS:
                x = r[v]
                cells += [_ms_and_ratio(x, key) for key in ("fwd_ms", "train_ms", "train_peak_mb")]
            lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
        skipped = [f"{r['tokens']} tokens, {v}: {r[v]['train_skipped']}" for r in long["rows"] for v in LONG_VARIANTS
                   if "train_skipped" in r[v]]
        if skipped:
            lines += ["", "Training steps skipped (they would not fit in memory): " + "; ".join(skipped) + "."]
        lines += ["", f"**{long['dinov2_model']} inference at other resolutions (positions interpolated), batch 1, "
                  f"original vs converted with `{long['method']}`, median ms**", "",
                  "| image | tokens | original | converted | converted / original |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['image_size']} px | {r['tokens']} | {r['original_ms']:.0f} | {r['converted_ms']:.0f} | "
                  f"{r['ratio']:.2f} |" for r in long["dinov2"]]
        lines.append("")
    return "\n".join(lines)
