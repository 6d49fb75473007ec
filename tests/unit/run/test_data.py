"""Data pipeline: alpaca loading, the prompt template, response-only labels, truncation."""

import json
from pathlib import Path

import pytest

from healthcheck.config import ALPACA_PROMPT, DataConfig
from healthcheck.errors import InvalidInput
from healthcheck.run.data import IGNORE_INDEX, collate, load_rows, read_alpaca_json, synthetic_rows, tokenize_rows
from healthcheck.run.modeling import byte_level_tokenizer

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
GSM8K = SHARED / "gsm8k_alpaca.json"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def test_synthetic_rows_are_deterministic_alpaca():
    rows = synthetic_rows(50)
    assert rows == synthetic_rows(50)
    assert all(set(r) == {"instruction", "input", "output"} and r["output"] for r in rows)
    assert any(r["input"] == "" for r in rows) and any(r["input"] for r in rows)


def test_response_only_labels_mask_the_prompt(tokenizer):
    row = {"instruction": "Say hi.", "input": "politely", "output": "Hello there."}
    [sample] = tokenize_rows([row], tokenizer, DataConfig())
    prompt = ALPACA_PROMPT.format(instruction="Say hi.", input="politely")
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert sample.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert tokenizer.decode(sample.labels[n_prompt:-1]) == "Hello there."
    assert sample.labels[-1] == tokenizer.eos_token_id
    assert sample.response_tokens == len("Hello there.") + 1


def test_loss_on_prompt_when_disabled(tokenizer):
    [sample] = tokenize_rows(synthetic_rows(1), tokenizer, DataConfig(response_only_loss=False))
    assert sample.labels == sample.input_ids


def test_truncation_can_remove_every_response_token(tokenizer):
    row = {"instruction": "x" * 300, "input": "", "output": "answer"}
    [sample] = tokenize_rows([row], tokenizer, DataConfig(max_length=64))
    assert len(sample.input_ids) == 64
    assert sample.response_tokens == 0


def test_collate_pads_and_masks(tokenizer):
    samples = tokenize_rows(synthetic_rows(3), tokenizer, DataConfig())
    batch = collate(samples, tokenizer.pad_token_id)
    lengths = [len(s.input_ids) for s in samples]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert (batch["labels"][short, min(lengths):] == IGNORE_INDEX).all()


@pytest.mark.skipif(not GSM8K.exists(), reason="../shared/data is not beside this checkout")
def test_real_alpaca_json_gsm8k(tokenizer):
    rows = read_alpaca_json(GSM8K)
    assert len(rows) == 7473
    samples = tokenize_rows(rows[:200], tokenizer, DataConfig(max_length=128))
    # The real set has long math prompts: at 128 tokens some responses vanish entirely.
    assert any(s.response_tokens == 0 for s in samples)
    assert all(len(s.input_ids) <= 128 for s in samples)


def test_jsonl_and_datasets_parquet(tmp_path, tokenizer):
    rows = synthetic_rows(20)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(DataConfig(source="json", path=str(jsonl))) == rows

    import datasets

    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    loaded = load_rows(DataConfig(source="datasets", path=str(parquet), max_samples=10))
    assert loaded == rows[:10]
    assert load_rows(DataConfig(source="datasets", path=str(jsonl))) == rows


def test_bad_data_files_are_one_line(tmp_path):
    with pytest.raises(InvalidInput, match="data.path: file not found"):
        load_rows(DataConfig(source="json", path=str(tmp_path / "missing.json")))
    broken = tmp_path / "broken.json"
    broken.write_text("[{\"instruction\": ")
    with pytest.raises(InvalidInput, match="not alpaca JSON"):
        load_rows(DataConfig(source="json", path=str(broken)))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([{"question": "q"}]))
    with pytest.raises(InvalidInput, match="lacks the alpaca keys"):
        load_rows(DataConfig(source="json", path=str(wrong)))
