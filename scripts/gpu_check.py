"""Device checks of converted models, in plain Python (the lent GPU machine has no pytest):

1. every method's layer in bfloat16 and float16 against the float64 reference of the same rounded weights and
   inputs (computed on the CPU): |error| <= LAYER_C x eps(dtype) x max|reference|;
2. a converted BERT and ViT (tiny, from configs) under autocast in bfloat16 and float16 against float64;
3. torch.compile of LUNA's, Hedgehog's and T2R's layers on the device against eager.

    python scripts/gpu_check.py --device cuda        # what scripts/gpu_check.sh runs
    python scripts/gpu_check.py --device cpu         # the same checks on the CPU (tests/test_gpu_check.py)

Prints one line a check and a summary; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from luna_convert import convert
from luna_convert.layers.attention import LinearAttention
from luna_convert.linear_methods.registry import METHODS

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
LAYER_C = 16  # measured on the CPU: every method within 0.5 eps x max (sums in float32, one rounding of the output)
MODEL_TOLERANCE = 0.05  # of the logits' scale (0.1-0.7 % measured on the CPU): the unconverted parts' matmuls are in it too
COMPILED = ("luna", "hedgehog", "t2r")


def padded_qkv(tokens: int = 33, head_dim: int = 16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, tokens, head_dim, generator=g) for _ in range(3))
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, 20:] = False
    return q, k, v, mask


def layer_error(method: str, dtype: torch.dtype, device: str) -> float:
    """|layer in ``dtype`` on ``device`` - float64 reference| / (eps(dtype) x max|reference|)."""
    layer = LinearAttention(method, 16, 2, 16**-0.5, dwc=False).to(dtype)
    q, k, v, mask = padded_qkv()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with torch.no_grad():
        want = layer.double()(q.double(), k.double(), v.double(), mask)
        got = layer.to(device=device, dtype=dtype)(q.to(device), k.to(device), v.to(device), mask.to(device))
    return float((got.double().cpu() - want).abs().max() / (torch.finfo(dtype).eps * want.abs().max()))


def tiny_model(arch: str):
    import transformers

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 initializer_range=0.2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    if arch == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(vocab_size=99, **sizes))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 99, (2, 9), generator=g)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, 6:] = 0
        return model.eval(), {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    model = transformers.ViTForImageClassification(transformers.ViTConfig(image_size=32, patch_size=8, **sizes))
    return model.eval(), {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}


def model_error(arch: str, dtype: torch.dtype, device: str) -> float:
    """|converted model's logits under autocast(dtype) on ``device`` - float64| / max|float64 logits|."""
    model, inputs = tiny_model(arch)
    convert(model, "luna")
    with torch.no_grad():
        want = model.double()(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}).logits
        model.float().to(device)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            got = model(**{k: v.to(device) for k, v in inputs.items()}).logits
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def compiled_error(method: str, device: str) -> float:
    layer = LinearAttention(method, 16, 2, 16**-0.5).to(device)
    q, k, v, mask = (t.to(device) for t in padded_qkv())
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        return float((compiled(q, k, v, mask) - layer(q, k, v, mask)).abs().max())


def run_checks(device: str, methods=None, compile_methods=COMPILED) -> list[tuple[str, float, float, bool]]:
    """(check, measured, bound, passed) for every check."""
    results = []
    for precision, dtype in PRECISIONS.items():
        for method in methods or sorted(METHODS):
            error = layer_error(method, dtype, device)
            results.append((f"layer {method} {precision} (x eps x max)", error, LAYER_C, error <= LAYER_C))
        for arch in ("bert", "vit"):
            error = model_error(arch, dtype, device)
            results.append((f"converted {arch} {precision} (of max |logit|)", error, MODEL_TOLERANCE,
                            error <= MODEL_TOLERANCE))
    for method in compile_methods:
        error = compiled_error(method, device)
        results.append((f"compiled {method} (abs)", error, 1e-4, error <= 1e-4))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="Leave out the torch.compile checks.")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --device cpu for the CPU-side checks")
            return 1
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}")
    start = time.perf_counter()
    results = run_checks(args.device, compile_methods=() if args.no_compile else COMPILED)
    for name, measured, bound, passed in results:
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {measured:.3g} (bound {bound:g})")
    failed = sum(not r[3] for r in results)
    print(f"{len(results) - failed} passed, {failed} failed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
