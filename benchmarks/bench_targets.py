"""The speed and memory targets (docs/benchmarks.md, *Performance targets*), checked on a bench run.

``luna-convert bench`` measures; this script says which targets its measurements meet (a target left out
when the run did not measure what it needs):

    luna-convert bench --output-dir outputs/bench --long-models --background-load 1
    python benchmarks/bench_targets.py outputs/bench/bench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from luna_convert.tools.bench.layers import LUNA_DWC, SLOPE_RANGE, SOFTMAX, SOFTMAX_EAGER
from luna_convert.tools.bench.long_models import LONG_VARIANTS
from luna_convert.tools.bench.timing import loglog_slope


def evaluate(results: dict) -> list[dict]:
    """The targets, evaluated on what a bench run measured (``bench.json``'s content; missing data: not listed).
    Each is ``{target, value, op, threshold, met}``."""
    layers, models = results.get("layers"), results.get("models")
    layers_busy, long_models = results.get("layers_busy"), results.get("long_models")
    targets: list[dict] = []

    def add(name, value, op, threshold):
        if value is None:
            return
        met = value >= threshold if op == ">=" else value <= threshold if op == "<=" else value < threshold
        targets.append({"target": name, "value": value, "op": op, "threshold": threshold, "met": bool(met)})

    if layers:
        by = {(r["method"], r["n"]): r for r in layers["results"]}
        lengths = sorted({r["n"] for r in layers["results"]})
        for variant in ("luna", LUNA_DWC):
            label = "LUNA layer" if variant == "luna" else "LUNA layer with DWC"
            for n, need in ((4096, 5.0), (16384, 20.0)):
                r = by.get((variant, n))
                add(f"{label}: forward speed-up vs softmax (SDPA) at N={n}", r and r.get("fwd_speedup_vs_softmax"), ">=", need)
            for n in lengths:
                luna, t2r = by.get((variant, n)), by.get(("t2r", n))
                if n < 1024 or not luna or not t2r:
                    continue
                add(f"{label}: forward time / T2R at N={n}", luna["fwd_ms"] / t2r["fwd_ms"], "<=", 2.0)
                add(f"{label}: fwd+bwd time / T2R at N={n}", luna["fwd_bwd_ms"] / t2r["fwd_bwd_ms"], "<=", 2.0)
                if luna.get("fwd_bwd_peak_mb") and t2r.get("fwd_bwd_peak_mb"):
                    add(f"{label}: fwd+bwd peak memory / T2R at N={n}", luna["fwd_bwd_peak_mb"] / t2r["fwd_bwd_peak_mb"], "<=", 2.0)
            r = by.get((variant, 4096))
            add(f"{label}: fwd+bwd peak memory / softmax (SDPA) at N=4096", r and r.get("fwd_bwd_memory_vs_softmax"), "<=", 0.25)
            add(f"{label}: fwd+bwd peak memory / eager softmax (N x N) at N=4096 [context]",
                r and r.get("fwd_bwd_memory_vs_softmax_eager"), "<=", 0.25)
        if max(lengths) >= SLOPE_RANGE[1] and min(lengths) <= SLOPE_RANGE[0]:
            for m, s in layers["slopes"].items():
                if m in (SOFTMAX, SOFTMAX_EAGER):
                    continue
                add(f"{m}: log-log slope of forward time, N={SLOPE_RANGE[0]}..{SLOPE_RANGE[1]}", s.get("fwd"), "<=", 1.1)
                add(f"{m}: log-log slope of fwd+bwd time, N={SLOPE_RANGE[0]}..{SLOPE_RANGE[1]}", s.get("fwd_bwd"), "<=", 1.1)
    if layers_busy:
        by = {(r["method"], r["n"]): r for r in layers_busy["results"]}
        load = f"{layers_busy['background']['processes']} background process(es)"
        luna, t2r = by.get(("luna", 4096)), by.get(("t2r", 4096))
        for key, what in (("fwd", "forward"), ("fwd_bwd", "fwd+bwd")):
            if luna and t2r:
                add(f"LUNA layer, {load}: {what} time / T2R at N=4096", luna[f"{key}_ms"] / t2r[f"{key}_ms"], "<=", 1.5)
            add(f"LUNA layer, {load}: {what} speed-up vs softmax (SDPA) at N=4096",
                luna and luna.get(f"{key}_speedup_vs_softmax"), ">=", 3.0)
    if long_models:
        rows = {r["tokens"]: r for r in long_models["rows"]}
        for variant in LONG_VARIANTS[1:]:
            if 8192 in rows:
                r = rows[8192][variant]
                add(f"{long_models['model']} 8192 tokens, {variant}: inference time / original", r["fwd_ms_ratio"], "<=", 0.5)
                add(f"{long_models['model']} 8192 tokens, {variant}: train step time / original", r.get("train_ms_ratio"), "<=", 0.5)
            peaks = {n: r[variant]["train_peak_mb"] for n, r in rows.items() if "train_peak_mb" in r[variant]}
            if len(peaks) >= 2:  # over the lengths whose step was measured (a step that would not fit is skipped)
                slope, _ = loglog_slope(peaks, 1024, 8192)
                add(f"{long_models['model']}, {variant}: log-log slope of train-step peak memory, "
                    f"{min(peaks)}..{max(peaks)} tokens", slope, "<=", 1.1)
        for r in long_models.get("dinov2", []):
            if r["image_size"] >= 1024:
                add(f"{long_models['dinov2_model']} inference {r['image_size']}px: converted / original time",
                    r["ratio"], "<=", 0.5)
    if models:
        m = models["method"]
        if models.get("bert_train"):
            r = models["bert_train"]
            add(f"BERT-base train step {r['batch']}x{r['tokens']}: {m} / original time", r["ratio"], "<=", 1.5)
        for r in models["vit"]:
            if r["image_size"] == 224:
                add(f"ViT-B/16 inference 224px: {m} / original time", r["ratio"], "<=", 1.3)
            if r["image_size"] >= 1024:
                add(f"ViT-B/16 inference {r['image_size']}px: {m} / original time", r["ratio"], "<", 1.0)
        for r in models["bert"]:
            if r["tokens"] >= 4096:
                add(f"BERT-base inference {r['tokens']} tokens: {m} / original time", r["ratio"], "<", 1.0)
    return targets


def markdown(targets: list[dict]) -> str:
    lines = ["| target | measured | needed | met |", "|---|---:|---:|:---:|"]
    lines += [f"| {t['target']} | {t['value']:.2f} | {t['op']} {t['threshold']:g} | {'yes' if t['met'] else '**no**'} |"
              for t in targets]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path, help="a bench run's bench.json")
    args = parser.parse_args()
    print(markdown(evaluate(json.loads(args.bench_json.read_text()))), end="")


if __name__ == "__main__":
    main()
