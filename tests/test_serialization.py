"""save()/load(): exact round trips for every method and architecture, and clear
errors for folders that are incomplete, corrupt or in the way."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from luna_convert.conversion import CONFIG_ATTR, convert, is_converted, linear_attention_modules
from luna_convert.errors import ConversionError, LunaConvertError
from luna_convert.linear_methods import METHODS
from luna_convert.linear_methods.luna import LunaOptions
from luna_convert.linear_methods.registry import ALIASES
from luna_convert.serialization import CONVERSION_FILE, WEIGHTS_FILE, load, read_metadata, save

from conftest import ARCHITECTURES, LAYERS, example_inputs, logits_of, make_bert

ARCHS = sorted(ARCHITECTURES)


def perturb_new_parameters(model, seed: int = 0) -> None:
    """Give the added parameters (DWC is zero at init, Hedgehog is identity) values that a
    fresh conversion would not reproduce, so that loading must really read them from disk."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for la in linear_attention_modules(model):
            for p in la.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_round_trip_is_exact(arch, method, tmp_path):
    model = ARCHITECTURES[arch]()
    convert(model, method)
    perturb_new_parameters(model)
    inputs = example_inputs(arch)
    with torch.no_grad():
        expected = logits_of(model, inputs)
    folder = save(model, tmp_path / "model")
    assert (folder / CONVERSION_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()

    loaded = load(folder)
    assert type(loaded) is type(model) and not loaded.training
    assert is_converted(loaded) and len(linear_attention_modules(loaded)) == LAYERS
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)
    # The conversion record survives, so the loaded model can be saved again.
    assert getattr(loaded, CONFIG_ATTR).to_dict() == getattr(model, CONFIG_ATTR).to_dict()
    meta = read_metadata(folder)
    assert meta["conversion"]["method"] == method
    assert len(meta["conversion"]["targets"]) == LAYERS


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_of_unconverted_model(arch, tmp_path):
    model = ARCHITECTURES[arch]()
    loaded = load(save(model, tmp_path / "m"))
    assert not is_converted(loaded)
    inputs = example_inputs(arch)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), logits_of(model, inputs))


def test_round_trip_keeps_options_and_filter(tmp_path):
    model = make_bert()
    convert(model, "luna", projections=4, channels=2, envelope=True,
            filter_fn=lambda _m, name: name.startswith("bert.encoder.layer.1."))
    perturb_new_parameters(model)
    loaded = load(save(model, tmp_path / "m"))
    assert len(linear_attention_modules(loaded)) == 1
    assert loaded.bert.encoder.layer[1].attention.self.linear_attn.feature_dim == 8
    assert not is_converted(loaded.bert.encoder.layer[0])
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), logits_of(model, inputs))


def test_options_are_one_typed_object_from_convert_through_save_and_load(tmp_path):
    model = make_bert()
    options = LunaOptions(projections=4, channels=2, envelope=True)
    report = convert(model, "luna", options=options)
    config = getattr(model, CONFIG_ATTR)
    # validated once in convert(): every layer holds that object, not a copy rebuilt from a dict
    assert report.options is options and config.options is options
    assert all(la.options is options for la in linear_attention_modules(model))
    perturb_new_parameters(model)
    folder = save(model, tmp_path / "m")
    assert read_metadata(folder)["conversion"]["options"] == asdict(options)
    loaded = load(folder)
    loaded_options = getattr(loaded, CONFIG_ATTR).options
    assert type(loaded_options) is LunaOptions and loaded_options == options
    assert all(la.options is loaded_options for la in linear_attention_modules(loaded))
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), logits_of(model, inputs))
    # keyword overrides on top of an options object; another method's options object is refused
    assert convert(make_bert(), "luna", options=options, channels=4).options == replace(options, channels=4)
    with pytest.raises(ConversionError, match="takes LunaOptions, not T2ROptions"):
        convert(make_bert(), "luna", options=METHODS["t2r"].options())


def test_a_folder_naming_a_former_method_name_loads(tmp_path, monkeypatch):
    model = make_bert()
    convert(model, "hedgehog", dwc=True)
    perturb_new_parameters(model)
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        expected = logits_of(model, inputs)
    folder = save(model, tmp_path / "m")
    meta = json.loads((folder / CONVERSION_FILE).read_text())
    meta["conversion"]["method"] = "hedgehog-old"
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(LunaConvertError, match="hedgehog-old"):  # an unknown name, until it is an alias
        load(folder)
    monkeypatch.setitem(ALIASES, "hedgehog-old", "hedgehog")  # as Method(..., aliases=("hedgehog-old",)) does
    loaded = load(folder)
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), expected)
    # recorded (and saved again) under the method's name
    assert getattr(loaded, CONFIG_ATTR).method == "hedgehog"
    assert {la.method for la in linear_attention_modules(loaded)} == {"hedgehog"}
    assert read_metadata(save(loaded, tmp_path / "again"))["conversion"]["method"] == "hedgehog"


def test_round_trip_keeps_bf16(tmp_path):
    model = make_bert().to(torch.bfloat16)
    convert(model, "t2r")
    loaded = load(save(model, tmp_path / "m"))
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    inputs = example_inputs("hf-bert")
    with torch.no_grad():
        assert torch.equal(logits_of(loaded, inputs), logits_of(model, inputs))


def test_saves_tokenizer_built_offline(tmp_path):
    from transformers import AutoTokenizer, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s"]
    source = tmp_path / "tokenizer"
    source.mkdir()
    (source / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # from_pretrained on a folder with vocab.txt reads the WordPiece vocabulary on transformers 4.57 and 5.x
    # (the constructor's argument is vocab_file on 4.x but vocab on 5.x).
    tokenizer = BertTokenizerFast.from_pretrained(str(source))
    sentences = ["the cat sat", "the cats sat on the mat"]
    ids = tokenizer(sentences[1])["input_ids"]
    assert ids == [vocab.index(w) for w in ["[CLS]", "the", "cat", "##s", "sat", "on", "the", "mat", "[SEP]"]]
    model = make_bert()
    convert(model, "t2r")
    folder = save(model, tmp_path / "m", tokenizer=tokenizer)
    reloaded = AutoTokenizer.from_pretrained(folder)
    batch = reloaded(sentences, padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == tokenizer(sentences, padding=True, return_tensors="pt")["input_ids"].tolist()
    assert batch["input_ids"][1].tolist() == ids
    assert reloaded.decode(ids, skip_special_tokens=True) == sentences[1]
    loaded = load(folder)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


# --------------------------------------------------------------------- errors
def _saved(tmp_path):
    model = make_bert()
    convert(model, "t2r")
    return save(model, tmp_path / "m")


def test_truncated_weights_give_lunaconverterror(tmp_path):
    folder = _saved(tmp_path)
    weights = folder / WEIGHTS_FILE
    data = weights.read_bytes()
    for cut in (len(data) // 2, 7):
        weights.write_bytes(data[:cut])
        with pytest.raises(LunaConvertError, match="truncated or corrupt"):
            load(folder)


def test_missing_weights_give_lunaconverterror(tmp_path):
    folder = _saved(tmp_path)
    (folder / WEIGHTS_FILE).unlink()
    with pytest.raises(LunaConvertError, match="missing"):
        load(folder)


def test_folder_without_metadata_gives_lunaconverterror(tmp_path):
    with pytest.raises(LunaConvertError, match=CONVERSION_FILE):
        load(tmp_path)
    folder = _saved(tmp_path)
    (folder / CONVERSION_FILE).unlink()
    with pytest.raises(LunaConvertError, match="not a luna-convert model folder"):
        load(folder)


def test_corrupt_metadata_gives_lunaconverterror(tmp_path):
    folder = _saved(tmp_path)
    (folder / CONVERSION_FILE).write_text('{"format_version": 1, "conv')
    with pytest.raises(LunaConvertError, match="corrupt"):
        load(folder)


def test_weights_of_another_model_are_refused(tmp_path):
    folder = _saved(tmp_path)
    meta = json.loads((folder / CONVERSION_FILE).read_text())
    meta["conversion"]["method"] = "hedgehog"  # the weights hold T2R feature maps
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(LunaConvertError):
        load(folder)
    meta["conversion"]["method"] = "t2r"
    meta["conversion"]["options"]["dwc"] = True  # extra DWC weights that the file lacks
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(LunaConvertError, match="does not match"):
        load(folder)
    meta["conversion"]["options"].update(dwc=False, feature_dim=16)  # same keys, other shapes
    (folder / CONVERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(LunaConvertError, match="does not match"):
        load(folder)


def test_save_into_non_empty_folder_needs_overwrite(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    model = make_bert()
    convert(model, "t2r")
    with pytest.raises(LunaConvertError, match="not empty"):
        save(model, target)
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folders left behind
    save(model, target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / CONVERSION_FILE).is_file()
    assert is_converted(load(target))


def test_save_into_empty_existing_folder(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    model = make_bert()
    save(model, target)
    assert (target / WEIGHTS_FILE).is_file()


def test_unrecordable_model_is_refused(tmp_path):
    with pytest.raises(LunaConvertError, match="create_timm_model"):
        save(torch.nn.Linear(2, 2), tmp_path / "m")
    assert not (tmp_path / "m").exists()
