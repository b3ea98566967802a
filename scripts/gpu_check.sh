#!/usr/bin/env bash
# The prepared GPU check, for when a CUDA device is lent (at most 7.5 minutes: the step limits add up to 450 s).
# The lent machine has no network and no `datasets` (nor, maybe, pytest): the project is installed with
# --no-deps and every step needs only torch, transformers, timm, accelerate, typer, rich, scikit-learn, matplotlib.
#   1. scripts/gpu_check.py: every method's layer and a converted BERT and ViT in bf16 and fp16 against float64,
#      torch.compile on CUDA against eager; then tests/test_cuda.py where pytest is installed;
#   2. every method's layer against SDPA (flash where it applies) at 1k-16k tokens in bf16, CUDA-event timing;
#   3. the pipeline end to end on the GPU through accelerate: the digits demo, 20 finetuning steps, bf16 autocast.
# Results go to ${OUT:-gpu-check}/ (checks.txt, bench.json, bench.md, the demo's run folder, logs).
# Usage: bash scripts/gpu_check.sh     (from the repository root)
# Each step's failure is reported and the next step still runs.
set -uo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg
timeout 30 pip install --quiet --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 \
  || echo "gpu_check: install failed (see $OUT/install.txt)"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
  | tee "$OUT/device.txt"
timeout 120 python scripts/gpu_check.py --device cuda 2>&1 | tee "$OUT/checks.txt" | tail -40 \
  || echo "gpu_check: device checks failed or timed out (see $OUT/checks.txt)"
if python -c "import pytest" 2>/dev/null; then
  timeout 60 python -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.txt" | tail -3 \
    || echo "gpu_check: tests/test_cuda.py failed or timed out (see $OUT/tests.txt)"
else
  echo "gpu_check: pytest is not installed here; tests/test_cuda.py left out (scripts/gpu_check.py ran its checks)"
fi
METHODS="$(python -c "from luna_convert.linear_methods import METHODS; print(','.join(sorted(METHODS)))")"
timeout 180 luna-convert bench --device cuda --dtype bf16 --no-models --lengths 1024,4096,16384 \
  --methods "$METHODS" --repeats 5 --output-dir "$OUT/bench-bf16" 2>&1 \
  | tee "$OUT/bench.txt" | tail -40 || echo "gpu_check: bench failed or timed out (see $OUT/bench.txt)"
timeout 90 luna-convert demo --output-dir "$OUT/demo" --set train.mixed_precision=bf16 --set train.max_steps=20 2>&1 \
  | tee "$OUT/demo.txt" | tail -8 || echo "gpu_check: demo failed or timed out (see $OUT/demo.txt)"
