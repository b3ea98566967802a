"""A converted model still works where users put it: transformers pipelines and torch.compile.

All models are tiny and built here (no downloads). torch.compile runs with the ``aot_eager``
backend by default: Dynamo graph capture and AOTAutograd, the parts that trip over unusual
Python in a model, without Inductor's C++ code generation, which takes minutes on a small CPU
from a cold cache. Set LUNA_TEST_INDUCTOR=1 to also compile with the default Inductor backend.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from luna_convert.conversion import convert
from luna_convert.serialization import load, save

from conftest import example_inputs, logits_of, make_bert, make_hf_vit, make_timm_vit
from builders import write_bert_checkpoint

TEXTS = ["good movie", "the plot was very awful and not fine", "a great film", "bad"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny BERT classifier + its tokenizer, converted with LUNA, saved and loaded back."""
    import transformers

    folder = write_bert_checkpoint(tmp_path_factory.mktemp("bert") / "bert", num_labels=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    convert(model, "luna")
    with torch.no_grad():  # non-trivial added weights (DWC starts at zero)
        for name, p in model.named_parameters():
            if "linear_attn" in name:
                p.add_(0.1 * torch.randn_like(p))
    saved = save(model, tmp_path_factory.mktemp("saved") / "model", tokenizer=tokenizer)
    return load(saved), tokenizer


def probabilities(model, tokenizer, text: str) -> np.ndarray:
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
    return torch.softmax(logits, -1).numpy()


def test_text_classification_pipeline(text_model):
    import transformers

    model, tokenizer = text_model
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu")
    # batch_size 4: the pipeline pads the batch, so the mask must reach linear attention correctly
    predictions = pipe(TEXTS, batch_size=4, top_k=None)
    assert len(predictions) == len(TEXTS)
    for text, scores in zip(TEXTS, predictions):
        expected = probabilities(model, tokenizer, text)  # one unpadded example at a time
        by_label = {s["label"]: s["score"] for s in scores}
        got = np.array([by_label[model.config.id2label[i]] for i in range(len(expected))])
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert {s["label"] for s in predictions[0]} == set(model.config.id2label.values())


def test_image_classification_pipeline(tmp_path):
    import transformers
    from PIL import Image

    model = make_hf_vit()
    convert(model, "luna")
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3)
    reloaded = load(save(model, tmp_path / "vit", processor=processor))
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((40, 48, 3)) * 255).astype("uint8")) for _ in range(3)]
    pipe = transformers.pipeline("image-classification", model=reloaded, image_processor=processor, device="cpu")
    predictions = pipe(images, top_k=3)
    for image, scores in zip(images, predictions):
        with torch.no_grad():
            logits = reloaded(**processor(image, return_tensors="pt")).logits[0]
        expected = torch.softmax(logits, -1)
        best = int(expected.argmax())
        assert scores[0]["label"] == reloaded.config.id2label[best]
        assert scores[0]["score"] == pytest.approx(float(expected[best]), abs=1e-5)
        assert sum(s["score"] for s in scores) == pytest.approx(1.0, abs=1e-5)  # all 3 classes


def _compile_and_compare(model, inputs: dict, backend: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        expected, got = logits_of(model, inputs), logits_of(compiled, inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["luna", "hedgehog"])
def test_torch_compile_matches_eager_on_padded_text(method):
    model = make_bert()
    convert(model, method)
    inputs = example_inputs("hf-bert")  # first row padded: the key mask path is compiled too
    _compile_and_compare(model, inputs, "aot_eager")


def test_torch_compile_trains_like_eager():
    """One backward through the compiled model gives eager's gradients (what a compiled finetune needs)."""
    model = make_timm_vit()
    convert(model, "t2r")
    model.train()
    x = example_inputs("timm-vit")["x"]
    labels = torch.tensor([0, 2])
    grads = []
    for runner in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        torch.nn.functional.cross_entropy(runner(x), labels).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("linear_attn" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("LUNA_TEST_INDUCTOR") != "1",
                    reason="Inductor compiles C++ for minutes on a small CPU; set LUNA_TEST_INDUCTOR=1")
@pytest.mark.parametrize("method", ["luna", "t2r"])
def test_torch_compile_inductor_matches_eager(method):
    model = make_timm_vit()
    convert(model, method)
    _compile_and_compare(model, example_inputs("timm-vit"), "inductor")
