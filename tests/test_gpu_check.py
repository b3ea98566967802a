"""scripts/gpu_check.py's checks (every method's layer and converted models in bfloat16 and float16 against
float64, compiled layers against eager) on the CPU here; on a lent GPU the script runs them on CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_low_precision_checks_pass_on_the_cpu(capsys):
    assert _script().main(["--device", "cpu", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "layer luna fp16" in out and "converted vit bf16" in out and " 0 failed" in out


def test_a_wrong_layer_fails_the_check(monkeypatch):
    gpu_check = _script()
    real = gpu_check.LinearAttention

    class Shifted(real):  # in low precision, one output value off by 25 % of the scale: 32 eps of bfloat16
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.dtype == torch.float64:
                return out
            return out + 0.25 * out.detach().abs().max() * (torch.arange(out.numel()).view_as(out) == 0)

    monkeypatch.setattr(gpu_check, "LinearAttention", Shifted)
    assert gpu_check.layer_error("t2r", torch.bfloat16, "cpu") > gpu_check.LAYER_C


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checks_pass_on_cuda():
    assert _script().main(["--device", "cuda"]) == 0
