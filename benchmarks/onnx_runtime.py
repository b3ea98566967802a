"""A converted BERT-base against the original, both exported with ``luna_convert.export_model`` and run by
ONNX Runtime on the CPU: median time of one forward at each length, batch 1.

    python benchmarks/onnx_runtime.py --methods luna,hedgehog,t2r --lengths 512,4096 --threads 1

BERT-base's shape (12 layers, hidden 768, 12 heads) with random weights and 4,096 + 2 positions; the
exports are checked against PyTorch as ``luna-convert export`` checks them. Prints a markdown table. Times are
the calling thread's CPU time (ONNX Runtime with one intra-op thread runs on it), so other jobs do not count.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from thread_timing import median_thread_ms


def bert_base(max_tokens: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(max_position_embeddings=max_tokens + 2, num_labels=2)
    return transformers.BertForSequenceClassification(config).eval()


def median_ms(session, tokens: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(1, 30000, (1, tokens), dtype=np.int64),
            "attention_mask": np.ones((1, tokens), dtype=np.int64),
            "token_type_ids": np.zeros((1, tokens), dtype=np.int64)}
    return median_thread_ms(lambda: session.run(None, feed), repeats, warmup=1)


def main() -> None:
    import onnxruntime

    import luna_convert

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="luna,hedgehog,t2r")
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = args.threads
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for method in ["softmax (original)", *args.methods.split(",")]:
            model = bert_base(max(lengths))
            if not method.startswith("softmax"):
                luna_convert.convert(model, method=method)
            path = Path(folder) / f"{method.split()[0]}.onnx"
            result = luna_convert.export_model(model, path, length=64)
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            times[method] = [median_ms(session, n, args.repeats) for n in lengths]
            print(f"{method}: exported in {result.seconds:.0f} s, ONNX Runtime matches PyTorch to "
                  f"{result.relative_error:.1e}", flush=True)
    base = times["softmax (original)"]
    print("| model | " + " | ".join(f"{n:,} tokens (ms)" for n in lengths) + " | " +
          " | ".join(f"x original at {n:,}" for n in lengths) + " |")
    print("| --- | " + " | ".join("---:" for _ in range(2 * len(lengths))) + " |")
    for method, row in times.items():
        print(f"| {method} | " + " | ".join(f"{t:.0f}" for t in row) + " | " +
              " | ".join(f"{t / b:.2f}" for t, b in zip(row, base)) + " |")


if __name__ == "__main__":
    main()
