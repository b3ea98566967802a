#!/usr/bin/env bash
# The prepared GPU check, for when a CUDA device is lent (a few minutes in all):
#   1. tests/test_cuda.py (layers on CUDA = CPU, a converted BERT in bf16) and the bench's tests;
#   2. the attention layers in bf16 (sums in float32) at 1k-16k tokens, CUDA-event timing, against SDPA;
#   3. the pipeline end to end on the GPU: the digits demo through accelerate, bf16 autocast.
# Results go to ${OUT:-gpu-check}/ (bench.json, bench.md, the demo's run folder, logs).
# Usage: bash scripts/gpu_check.sh     (from the repository root, the project installed)
# Each step's failure is reported and the next step still runs.
set -euo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
  | tee "$OUT/device.txt"
timeout 240 python -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_bench.py 2>&1 \
  | tee "$OUT/tests.txt" | tail -3 || echo "gpu_check: tests failed or timed out (see $OUT/tests.txt)"
timeout 300 luna-convert bench --device cuda --dtype bf16 --no-models --lengths 1024,4096,16384 \
  --methods luna,luna-nodwc,t2r,hedgehog,performer --repeats 5 --output-dir "$OUT/bench-bf16" 2>&1 \
  | tee "$OUT/bench.txt" | tail -25 || echo "gpu_check: bench failed or timed out (see $OUT/bench.txt)"
timeout 240 luna-convert demo --output-dir "$OUT/demo" --set train.mixed_precision=bf16 2>&1 \
  | tee "$OUT/demo.txt" | tail -8 || echo "gpu_check: demo failed or timed out (see $OUT/demo.txt)"
