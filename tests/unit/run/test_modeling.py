"""Model sources: presets, local directories (the real from_pretrained path), hub ids, errors."""

import pytest

from healthcheck.config import ModelConfig
from healthcheck.errors import InvalidInput
from healthcheck.run.modeling import PRESETS, build_model, byte_level_tokenizer, load_tokenizer, model_source


def test_sources():
    assert model_source("tiny-gpt2") == "preset"
    assert model_source("org/model") == "hub"
    with pytest.raises(InvalidInput, match="unknown preset 'tiny-gpt3'"):
        model_source("tiny-gpt3")
    with pytest.raises(InvalidInput, match="model directory not found"):
        model_source("./no/such/dir")


def test_tokenizer_round_trips_bytes():
    tokenizer = byte_level_tokenizer()
    text = "### Response:\nnaïve 42 ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1


def test_local_directory_uses_from_pretrained(tmp_path):
    tokenizer = byte_level_tokenizer()
    model = build_model(ModelConfig(name="tiny-llama"), len(tokenizer), 256)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = ModelConfig(name=str(tmp_path))
    assert model_source(config.name) == "local"
    loaded = build_model(config, len(tokenizer), 256)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert load_tokenizer(config)("abc")["input_ids"] == tokenizer("abc")["input_ids"]


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "llama-1b"])
def test_presets_build(name):
    model = build_model(ModelConfig(name=name, dtype="bfloat16"), 258, 128)
    assert next(model.parameters()).dtype.is_floating_point
    assert str(next(model.parameters()).dtype) == "torch.bfloat16"
