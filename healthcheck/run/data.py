"""The data pipeline under test: alpaca rows → prompt template → token ids with response-only labels.

Sources: built-in synthetic rows (deterministic, no download), an alpaca JSON list / JSONL file, or
``datasets.load_dataset`` on a local parquet/JSON file or a hub name. Every row keeps its index as
a ``sample_id`` so the shard audit can say exactly which samples each rank consumed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from healthcheck.config import DataConfig, TrainConfig
from healthcheck.errors import InvalidInput
from healthcheck.files import read_text

IGNORE_INDEX = -100
ALPACA_KEYS = ("instruction", "input", "output")

# --------------------------------------------------------------------------- rows


_WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor iris juniper kestrel lumen maple nectar "
    "orbit pebble quartz raven sierra tundra umber velvet willow xenon yarrow zephyr"
).split()


def synthetic_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Deterministic alpaca-format rows whose responses follow from their inputs (so loss falls).

    >>> synthetic_rows(2)[0].keys()
    dict_keys(['instruction', 'input', 'output'])
    >>> synthetic_rows(3) == synthetic_rows(3)
    True
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        kind = rng.randrange(6)
        words = rng.sample(_WORDS, rng.randint(2, 6))
        numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 5))]
        if kind == 0:
            row = ("Add the numbers.", f"{numbers[0]} and {numbers[1]}", f"{numbers[0]} + {numbers[1]} = {numbers[0] + numbers[1]}.")
        elif kind == 1:
            row = ("Reverse the order of the words.", " ".join(words), " ".join(reversed(words)))
        elif kind == 2:
            row = ("Spell the word backwards.", words[0], words[0][::-1])
        elif kind == 3:
            row = ("Sort these numbers in ascending order.", ", ".join(map(str, numbers)), ", ".join(map(str, sorted(numbers))))
        elif kind == 4:
            row = ("Convert the text to upper case.", " ".join(words), " ".join(words).upper())
        else:
            start = numbers[0] % 20
            row = (f"Count from {start} to {start + len(words)}.", "", " ".join(str(i) for i in range(start, start + len(words) + 1)))
        rows.append(dict(zip(ALPACA_KEYS, row, strict=True)))
    return rows


def read_alpaca_json(path: Path) -> list[dict[str, Any]]:
    """An alpaca JSON list (``[{instruction, input, output}, ...]``) or a JSONL file of such objects."""
    text = read_text(path, missing=f"data.path: file not found: {path}", unreadable=f"data.path: cannot read {path}")
    try:
        stripped = text.lstrip()
        if stripped.startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"data.path: {path} is not alpaca JSON or JSONL (line {exc.lineno}: {exc.msg})") from None
    return rows


def read_with_datasets(config: DataConfig) -> list[dict[str, Any]]:
    """``datasets.load_dataset`` on a local parquet/JSON file or directory, or a hub dataset name."""
    import datasets

    assert config.path is not None
    path = Path(config.path).expanduser()
    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
    if path.is_file():
        if path.suffix not in builders:
            raise InvalidInput(f"data.path: expected a .parquet, .json or .jsonl file, got {path.name}")
        dataset = datasets.load_dataset(builders[path.suffix], data_files=str(path), split=config.split)
    elif path.is_dir():
        dataset = datasets.load_dataset(str(path), split=config.split)
    elif config.path.startswith((".", "/", "~")):
        raise InvalidInput(f"data.path: file not found: {config.path}")
    else:
        dataset = datasets.load_dataset(config.path, split=config.split)
    return [dict(row) for row in dataset]


def load_rows(config: DataConfig) -> list[dict[str, Any]]:
    if config.source == "synthetic":
        rows = synthetic_rows(config.synthetic_samples)
    elif config.source == "json":
        rows = read_alpaca_json(Path(config.path or "").expanduser())
    else:
        rows = read_with_datasets(config)
    if config.max_samples is not None:
        rows = rows[: config.max_samples]
    _check_rows(rows, config)
    return rows


def _check_rows(rows: list[dict[str, Any]], config: DataConfig) -> None:
    where = config.path or "synthetic data"
    if not rows:
        raise InvalidInput(f"data.path: {where} has no rows")
    for index, row in enumerate(rows[:1000]):
        if not isinstance(row, dict) or "instruction" not in row or "output" not in row:
            raise InvalidInput(f"data.path: {where} row {index} lacks the alpaca keys instruction/output")


def check_data_inputs(config: DataConfig) -> None:
    """Pre-flight: fail before any worker starts when a local data file is missing."""
    if config.source == "json":
        path = Path(config.path or "").expanduser()
        if not path.is_file():
            raise InvalidInput(f"data.path: file not found: {config.path}")
    if config.source == "datasets":
        path = Path(config.path or "").expanduser()
        if config.path and config.path.startswith((".", "/", "~")) and not path.exists():
            raise InvalidInput(f"data.path: file not found: {config.path}")


# --------------------------------------------------------------------------- tokenization


@dataclass
class TokenizedSample:
    sample_id: int
    input_ids: list[int]
    labels: list[int]

    @property
    def response_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def format_prompt(row: dict[str, Any], config: DataConfig) -> str:
    if str(row.get("input") or "").strip():
        return config.prompt_template.format(instruction=row["instruction"], input=row["input"])
    return config.prompt_template_no_input.format(instruction=row["instruction"])


def tokenize_rows(rows: list[dict[str, Any]], tokenizer, config: DataConfig) -> list[TokenizedSample]:
    """Prompt + response + EOS, truncated to ``max_length``; prompt tokens masked when response-only.

    A row whose response is truncated away entirely keeps zero label tokens; the trainer weights
    by token count, so such a batch contributes nothing instead of a NaN.
    """
    prompts = [format_prompt(row, config) for row in rows]
    responses = [str(row["output"]) for row in rows]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    samples = []
    for index, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        ids = (prompt + response + eos)[: config.max_length]
        if config.response_only_loss:
            labels = ([IGNORE_INDEX] * len(prompt) + response + eos)[: config.max_length]
        else:
            labels = list(ids)
        samples.append(TokenizedSample(index, ids, labels))
    return samples


# The launcher tokenizes once before forking its workers; a worker whose data config is the same
# reuses that work instead of tokenizing the whole set again on a shared core.
_TOKENIZED_CACHE: dict[str, list[TokenizedSample]] = {}


def prepare_samples(config: DataConfig, tokenizer, cache_key: str = "") -> list[TokenizedSample]:
    key = cache_key + config.model_dump_json()
    if key not in _TOKENIZED_CACHE:
        _TOKENIZED_CACHE[key] = tokenize_rows(load_rows(config), tokenizer, config)
    return _TOKENIZED_CACHE[key]


# --------------------------------------------------------------------------- batching


class SampleDataset:
    """Map-style dataset over tokenized samples (what ``DataLoader``/``DistributedSampler`` expect)."""

    def __init__(self, samples: list[TokenizedSample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TokenizedSample:
        return self.samples[index]


def collate(samples: list[TokenizedSample], pad_token_id: int) -> dict[str, Any]:
    """Right-pad to the longest sequence; padding is masked from attention and loss."""
    import torch

    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        labels[row, :n] = torch.tensor(sample.labels)
        attention[row, :n] = 1
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention,
        "sample_ids": [s.sample_id for s in samples],
    }


@dataclass
class ShardPlan:
    """How this rank's sampler splits the data (recorded in result.json for the audits)."""

    seed: int
    rank: int
    replicas: int


def shard_plan(data: DataConfig, train: TrainConfig, rank: int, world_size: int) -> ShardPlan:
    seed = train.data_seed if train.data_seed is not None else train.seed
    if data.sharding == "replicated":
        return ShardPlan(seed=seed, rank=0, replicas=1)
    return ShardPlan(seed=seed, rank=rank, replicas=world_size)


class MicroBatches:
    """Endless micro-batches from a ``DistributedSampler``-driven ``DataLoader``, epoch after epoch.

    ``set_epoch`` is called at each epoch boundary unless ``train.set_epoch`` is False, which
    reproduces the common bug where every epoch repeats the first epoch's order.
    """

    def __init__(self, samples: list[TokenizedSample], plan: ShardPlan, train: TrainConfig, pad_token_id: int):
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        dataset = SampleDataset(samples)
        if len(dataset) < plan.replicas * train.micro_batch_size:
            raise InvalidInput(
                f"data: {len(dataset)} samples cannot fill one micro-batch of {train.micro_batch_size} on {plan.replicas} ranks"
            )
        self.sampler: Any = DistributedSampler(
            dataset,  # type: ignore[arg-type]  # a map-style dataset; torch's stub wants its Dataset class
            num_replicas=plan.replicas,
            rank=plan.rank,
            shuffle=train.shuffle,
            seed=plan.seed,
            drop_last=True,
        )
        self.loader: Any = DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=train.micro_batch_size,
            sampler=self.sampler,
            drop_last=True,
            collate_fn=lambda batch: collate(batch, pad_token_id),
        )
        self.call_set_epoch = train.set_epoch
        self.epoch = 0
        self._iterator: Iterator[dict[str, Any]] = iter(self.loader)

    def planned_reads(self, micro_batches: int) -> list[tuple[int, list[int]]]:
        """``(epoch, sample ids)`` of this rank's first ``micro_batches`` micro-batches, read off its sampler's
        plan: what :meth:`next` will return from a fresh start, epoch boundaries included. Nothing is consumed;
        the fail-fast shard check judges these before the first step.
        """
        from torch.utils.data.distributed import DistributedSampler

        sampler, size = self.sampler, self.loader.batch_size
        samples = self.loader.dataset.samples
        reads: list[tuple[int, list[int]]] = []
        epoch = 0
        while len(reads) < micro_batches:
            twin: Any = DistributedSampler(
                range(len(samples)),  # type: ignore[arg-type]  # any sized sequence works
                num_replicas=sampler.num_replicas,
                rank=sampler.rank,
                shuffle=sampler.shuffle,
                seed=sampler.seed,
                drop_last=sampler.drop_last,
            )
            twin.set_epoch(epoch if self.call_set_epoch else 0)
            order = list(twin)
            for start in range(0, len(order) - size + 1, size):
                if len(reads) == micro_batches:
                    break
                reads.append((epoch, [samples[index].sample_id for index in order[start : start + size]]))
            epoch += 1
        return reads

    def next(self) -> dict[str, Any]:
        try:
            return next(self._iterator)
        except StopIteration:
            self.epoch += 1
            if self.call_set_epoch:
                self.sampler.set_epoch(self.epoch)
            self._iterator = iter(self.loader)
            return next(self._iterator)
