"""CUDA checks: the same layers and a converted model on a GPU agree with the CPU. There is no GPU in
CI or on the development machine; scripts/gpu_check.sh runs this file on a lent device."""

from __future__ import annotations

import pytest
import torch

from luna_convert import convert
from luna_convert.conversion import linear_attention_modules
from luna_convert.layers.attention import LinearAttention

from conftest import example_inputs, make_bert

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _padded_qkv(tokens: int = 33):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, tokens, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, 20:] = False
    return q, k, v, mask


@pytest.mark.parametrize("method", ["luna", "t2r", "hedgehog", "performer", "cosformer", "sorting"])
def test_layer_on_cuda_equals_the_cpu(method):
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products at full precision on both devices
    layer = LinearAttention(method, 16, 2, 16**-0.5, dwc=False)
    q, k, v, mask = _padded_qkv()
    want = layer(q, k, v, mask)
    got = layer.cuda()(q.cuda(), k.cuda(), v.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_converted_bert_trains_on_cuda_in_bf16():
    model = make_bert()
    convert(model, "luna")
    model.cuda().train()
    inputs = {k: v.cuda() for k, v in example_inputs("hf-bert").items()}
    labels = torch.tensor([0, 1], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**inputs, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for la in linear_attention_modules(model) for p in la.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_converted_bert_bf16_logits_are_close_to_float32():
    model = make_bert().eval()
    convert(model, "luna")
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        want = model(**inputs).logits
        model.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = model(**{k: v.cuda() for k, v in inputs.items()}).logits.float().cpu()
    # bf16 keeps 8 bits of mantissa: a relative error of about 4e-3 per product, a few of them deep
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
