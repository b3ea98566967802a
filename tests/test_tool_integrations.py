"""The tools around transformers work on a converted model as on the original: pipelines (text with padded
batches, images) read a save_pretrained folder, Trainer trains and saves it, peft puts LoRA on it (its default
targets found by the model type), torch.compile runs it, and bfloat16 round trips keep it converted.
(sentence-transformers: tests/test_embedding.py; accelerate's prepare on two processes: tests/test_integration.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from luna_convert.conversion import convert, is_converted, linear_attention_modules
from luna_convert.serialization import load, save

from builders import saved_tokenizer, write_bert_checkpoint
from conftest import IMAGE, example_inputs, logits_of, make_bert, make_hf_vit

TEXTS = ["good movie", "the plot was very bad and the actor was not good at all", "a fine film", "awful"]


def moved_off_init(model, seed: int = 3):
    """Every added parameter moved off its initial value, so that a reload that skipped them would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in linear_attention_modules(model):
            for p in layer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def text_classifier(tmp_path):
    """(converted BERT classifier, its tokenizer), from a tiny checkpoint with a real vocabulary."""
    from transformers import AutoModelForSequenceClassification

    source = write_bert_checkpoint(tmp_path / "source", num_labels=3)
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    convert(model, "luna")
    return moved_off_init(model), saved_tokenizer(source)


def alone_logits(model, tokenizer, text: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits[0]


# ------------------------------------------------------------------ pipelines
def test_text_classification_pipeline_reads_the_folder_and_pads_batches(text_classifier, tmp_path):
    from transformers import pipeline

    model, tokenizer = text_classifier
    model.save_pretrained(tmp_path / "hub")  # what push_to_hub uploads: the model's and the tokenizer's files
    tokenizer.save_pretrained(tmp_path / "hub")
    classify = pipeline("text-classification", model=str(tmp_path / "hub"), function_to_apply="none", top_k=None)
    assert is_converted(classify.model)
    batched = classify(TEXTS, batch_size=4)  # one padded batch: lengths 4 to 14 tokens
    lengths = {len(tokenizer(t)["input_ids"]) for t in TEXTS}
    assert len(lengths) == len(TEXTS)
    for text, scores in zip(TEXTS, batched):
        got = torch.tensor([s["score"] for s in sorted(scores, key=lambda s: model.config.label2id[s["label"]])])
        torch.testing.assert_close(got, alone_logits(model, tokenizer, text), rtol=0, atol=1e-5)


def test_image_classification_pipeline_reads_the_folder(tmp_path):
    from PIL import Image
    from transformers import ViTImageProcessor, pipeline

    model = moved_off_init(make_hf_vit())
    convert(model, "hedgehog")
    processor = ViTImageProcessor(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    model.save_pretrained(tmp_path / "hub")
    processor.save_pretrained(tmp_path / "hub")
    images = [Image.new("RGB", (40, 24), (200, 30, 60)), Image.new("RGB", (24, 24), (10, 120, 240))]
    classify = pipeline("image-classification", model=str(tmp_path / "hub"), function_to_apply="none", top_k=None)
    assert is_converted(classify.model)
    with torch.no_grad():
        want = model(**processor(images, return_tensors="pt")).logits
    for row, scores in zip(want, classify(images, batch_size=2)):
        got = torch.tensor([s["score"] for s in sorted(scores, key=lambda s: model.config.label2id[s["label"]])])
        torch.testing.assert_close(got, row, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ Trainer
def test_trainer_trains_a_converted_model_and_saves_it_converted(text_classifier, tmp_path):
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments

    model, tokenizer = text_classifier
    rows = [{**tokenizer(text), "labels": i % 3} for i, text in enumerate(TEXTS * 3)]
    before = [p.detach().clone() for layer in linear_attention_modules(model) for p in layer.parameters()]
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorWithPadding(tokenizer))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = [p for layer in linear_attention_modules(model) for p in layer.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the linear-attention weights did not train"
    trainer.save_model(str(tmp_path / "trained"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "trained")
    model.eval()
    for text in TEXTS:
        assert torch.equal(alone_logits(reloaded, tokenizer, text), alone_logits(model, tokenizer, text))


# ------------------------------------------------------------------ peft
def test_peft_lora_on_a_converted_model(text_classifier, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = text_classifier
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, init_lora_weights=False))
    targets = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters() if ".lora_A" in name}
    assert targets == {"query", "value"}  # peft's default for the model type, which stays "bert" in memory
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    peft_model.train()
    peft_model(**batch, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    assert all(p.grad is not None for name, p in peft_model.named_parameters() if "lora_" in name)
    peft_model.eval()
    with torch.no_grad():
        want = peft_model(**batch).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        again = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(**batch).logits
    assert torch.equal(again, want)
    merged = peft_model.merge_and_unload()
    assert is_converted(merged) and len(linear_attention_modules(merged)) == 2
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ torch.compile
def test_torch_compile_runs_a_model_loaded_from_its_folder(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = moved_off_init(make_bert())
    convert(model, "luna")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    inputs = example_inputs("hf-bert")  # a padded batch
    compiled = torch.compile(loaded, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).logits, logits_of(model, inputs), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ bfloat16
def test_a_bfloat16_round_trip_keeps_the_converted_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = moved_off_init(make_bert())
    convert(model, "hedgehog")
    inputs = example_inputs("hf-bert")
    full = logits_of(model, inputs)
    half = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        out = logits_of(half, inputs)
    assert out.dtype == torch.bfloat16 and is_converted(half)
    torch.testing.assert_close(out.float(), full, rtol=0, atol=0.05)  # bf16 keeps about 3 digits
    half.save_pretrained(tmp_path / "pretrained")
    for again in (AutoModelForSequenceClassification.from_pretrained(tmp_path / "pretrained"),
                  load(save(half, tmp_path / "saved"))):
        assert next(again.parameters()).dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(logits_of(again, inputs), out)
    back = half.to(torch.float32)  # the bf16 values, widened: the same model in float32
    rounded = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in rounded.items())
    with torch.no_grad():
        torch.testing.assert_close(logits_of(back, inputs), out.float(), rtol=0, atol=0.05)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)

