"""The DataLoaders a training script fetches from, recorded for the shard, seed and environment audits.

:class:`LoaderRecorder` keeps the sample indices every DataLoader fetched, per epoch (a new iterator is a new epoch,
unless it was a peek: see :meth:`LoaderRecorder.on_fetch`), and the DistributedSampler behind them when there is one.
Fetches run ahead of the forwards (prefetching, accelerate's look-ahead), so what is recorded is a prefix that covers
what was trained on: enough for overlap, order and coverage, which the audits judge on prefixes. At a loader's first
fetch, a digest of its dataset (:func:`dataset_digest`, 32 samples) and what its ``collate_fn`` makes of three of them
(:func:`batch_facts`), which every rank must share. And a hash of every sample of every batch it yields
(:mod:`.sample_hashes`): what an ``IterableDataset`` or a per-rank split of the data is judged on, where indices
name no sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator, Optional

from healthcheck.artifacts import SamplerPlan
from healthcheck.integrations.script.sample_hashes import sample_hashes

#: Attributes set on the objects themselves: an iterator's epoch, and which loader an index sampler is.
#: (``id()`` alone is reused once a loader is freed, which would merge two loaders' records.)
_EPOCH_ATTRIBUTE = "_healthcheck_epoch"
#: The id of the sampler iterator the epoch was read from. A DataLoader with ``persistent_workers`` keeps one
#: iterator object for every epoch and gives it a new sampler iterator at each (``_reset``): without this, every
#: epoch was recorded as epoch 0. The old sampler iterator is alive while the new one is made, so ids differ.
_PASS_ATTRIBUTE = "_healthcheck_sampler_iter"
_LOADER_ATTRIBUTE = "_healthcheck_loader"
#: Sample hashes a loader keeps at most (a prefix, as its indices are): gathered from every rank, 64 ranks' hashes
#: stay ~10 MB, and a probe's few dozen steps of a per-device batch of 32 fit 250 steps.
_MAX_HASHES = 8192


@dataclasses.dataclass
class LoaderRecord:
    """The fetches of one DataLoader (its index sampler lives as long as the loader, and is tagged)."""

    dataset_size: Optional[int]
    plan: Optional[SamplerPlan]
    dataset_digest: Optional[str] = None
    batch_facts: dict[str, str] = dataclasses.field(default_factory=dict)
    settings: dict[str, str] = dataclasses.field(default_factory=dict)  #: :func:`loader_settings`
    epochs_started: int = 0
    batches: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    epoch_started_at: int = 0  #: the optimizer steps done when the newest iterator started
    sampler_epoch: Optional[int] = None  #: its DistributedSampler's ``epoch`` then, where it has one
    peeks: int = 0  #: iterators left out as peeks (:meth:`LoaderRecorder.on_fetch`)
    contents: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)  #: (epoch, sample hashes) per batch
    hashed: bool = True  #: every batch yielded so far could be hashed (a batch without a CPU tensor cannot)
    hash_count: int = 0  #: sample hashes kept, up to :data:`_MAX_HASHES`

    def drop_epochs_from(self, epoch: int) -> None:
        """Forget the iterators numbered ``epoch`` and later: they were peeks, and the next epoch reuses the number."""
        self.batches = [(e, ids) for e, ids in self.batches if e < epoch]
        self.contents = [(e, hashes) for e, hashes in self.contents if e < epoch]
        self.hash_count = sum(len(hashes) for _, hashes in self.contents)
        self.peeks += self.epochs_started - epoch
        self.epochs_started = epoch

    @property
    def samples(self) -> int:
        """Samples fetched: by index, or by hash where the loader yields without indices (an IterableDataset)."""
        return sum(len(ids) for _, ids in self.batches) or self.hash_count


class LoaderRecorder:
    """Called with every batch of indices any DataLoader fetches on this rank."""

    def __init__(self) -> None:
        self.loaders: dict[int, LoaderRecord] = {}
        self.steps = 0  #: optimizer steps done, kept by the session
        #: (step, sample hashes) of each step's first training forward's inputs: what a script that reads no
        #: DataLoader (nanoGPT's ``get_batch``) is judged on (:meth:`on_step_inputs`).
        self.forward_contents: list[tuple[int, list[int]]] = []

    def on_fetch(self, iterator: Any, indices: Any) -> None:
        """Record one batch of indices under its iterator's epoch.

        A script may take a batch to look at (``next(iter(loader))`` for a sample, a shape, a sanity loss) before
        or between its epochs. That iterator replays the sampler's current order, so counted as an epoch it would
        read as "epoch 1 repeats epoch 0" (a missing ``set_epoch``) on a rank that trains consistently. It is left
        out when no optimizer step ran between its start and the next iterator's and its DistributedSampler was
        not moved to another epoch in between (an accumulation window longer than an epoch spans two real ones), or
        when an older iterator fetches again after it started (training went on where it was). An iterator made afresh for every step
        (``next(iter(loader))`` as the training loop) is an epoch per step, as it should be: it repeats the order.
        """
        index_sampler = getattr(iterator, "_index_sampler", None)
        key = getattr(index_sampler, _LOADER_ATTRIBUTE, None)
        if key is None:
            key = len(self.loaders)
            try:
                setattr(index_sampler, _LOADER_ATTRIBUTE, key)
            except (AttributeError, TypeError):  # a sampler that takes no attributes: its id, while it lives
                key = id(index_sampler)
        record = self.loaders.get(key)
        if record is None:
            dataset = getattr(iterator, "_dataset", None)
            record = self.loaders[key] = LoaderRecord(
                dataset_size=_size(dataset),
                plan=sampler_plan(index_sampler),
                dataset_digest=dataset_digest(dataset),
                batch_facts=batch_facts(
                    dataset, getattr(iterator, "_collate_fn", None), getattr(iterator, "_auto_collation", True)
                ),
                settings=loader_settings(index_sampler),
            )
        epoch = getattr(iterator, _EPOCH_ATTRIBUTE, None)
        sampler_iter = id(getattr(iterator, "_sampler_iter", iterator))
        if getattr(iterator, _PASS_ATTRIBUTE, sampler_iter) != sampler_iter:
            epoch = None  # the same iterator object, reset for another epoch
        if epoch is None:
            sampler_epoch = getattr(distributed_sampler(index_sampler), "epoch", None)
            if record.epochs_started and record.epoch_started_at == self.steps and sampler_epoch == record.sampler_epoch:
                record.drop_epochs_from(record.epochs_started - 1)
            epoch, record.epoch_started_at, record.sampler_epoch = record.epochs_started, self.steps, sampler_epoch
            record.epochs_started += 1
            setattr(iterator, _EPOCH_ATTRIBUTE, epoch)
            setattr(iterator, _PASS_ATTRIBUTE, sampler_iter)
        elif epoch < record.epochs_started - 1:
            record.drop_epochs_from(epoch + 1)
        ids = indices.tolist() if hasattr(indices, "tolist") else indices
        ids = ids if isinstance(ids, (list, tuple)) else [ids]
        if None not in ids:  # an IterableDataset is fetched with None for indices: its batches are known by hash only
            record.batches.append((epoch, [int(i) for i in ids]))

    def on_batch(self, iterator: Any, batch: Any) -> None:
        """Hash the samples of a batch the iterator yields, under the epoch :meth:`on_fetch` gave it."""
        record = self.loaders.get(getattr(getattr(iterator, "_index_sampler", None), _LOADER_ATTRIBUTE, -1))
        epoch = getattr(iterator, _EPOCH_ATTRIBUTE, None)
        if record is None or epoch is None or not record.hashed or record.hash_count >= _MAX_HASHES:
            return
        hashes = sample_hashes(batch)
        if hashes is None:
            record.hashed, record.contents = False, []
        else:
            record.contents.append((epoch, hashes))
            record.hash_count += len(hashes)

    def on_step_inputs(self, step: int, batch: Any) -> None:
        """Hash the samples of the inputs a step's first training forward ran on (the replay's kept batch). Only
        while no DataLoader has yielded: :meth:`evidence` reads them only then, and a step need not pay for them."""
        if self.loaders:
            return
        kept = sum(len(hashes) for _, hashes in self.forward_contents)  # a few dozen steps: cheap to count again
        hashes = sample_hashes(batch) if batch is not None and kept < _MAX_HASHES else None
        if hashes:
            self.forward_contents.append((step, hashes))

    def training_loader(self) -> Optional[LoaderRecord]:
        """The loader the probe trained on: the one that fetched the most samples (evaluation loaders
        fetch few or none within a probe's steps)."""
        return max(self.loaders.values(), key=lambda r: r.samples, default=None)

    def evidence(self) -> dict[str, Any]:
        """The training loader's fields of a rank's :class:`~healthcheck.artifacts.RankEvidence` so far.

        >>> LoaderRecorder().evidence()  # no batch seen: the script samples its own way
        {'consumed': [], 'shard_source': 'none', 'contents': []}
        """
        loader = self.training_loader()
        if loader is None:  # what each step's first forward ran on, if anything
            return {"consumed": [], "shard_source": "forward" if self.forward_contents else "none", "contents": list(self.forward_contents)}
        return {
            "consumed": list(loader.batches),
            "contents": list(loader.contents) if loader.hashed else [],
            "sampler": loader.plan,
            "shard_source": "sampler" if loader.plan else "loader",
            "dataset_digest": loader.dataset_digest,
            "dataset_size": loader.dataset_size,
            "batch_facts": loader.batch_facts,
        }


def loader_settings(index_sampler: Any) -> dict[str, str]:
    """``data.batch_size`` and ``data.drop_last`` of a DataLoader's index sampler (a ``BatchSampler``, accelerate's
    ``BatchSamplerShard``), where it has them. A rank with its own per-device batch size reads the plan's order
    faster and weighs its samples otherwise; no shard, seed or parameter shows it. A sampler that sizes its
    batches by their tokens has no ``batch_size`` and is not compared. ``data.sample_group`` and
    ``data.group_rounds``: where a sampler it wraps reads each sample several times by design (:func:`sample_groups`).

    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(10), batch_size=4)
    >>> loader_settings(loader.batch_sampler)
    {'data.batch_size': '4', 'data.drop_last': 'False'}
    """
    settings = {}
    for name in ("batch_size", "drop_last"):
        value = getattr(index_sampler, name, None)
        if isinstance(value, (bool, int)):
            settings[f"data.{name}"] = str(value)
    settings.update(sample_groups(index_sampler))
    return settings


def sample_groups(index_sampler: Any) -> dict[str, str]:
    """``data.sample_group`` and ``data.group_rounds`` where a sampler behind a DataLoader's index sampler reads each
    sample it draws several times by design: ``mini_repeat_count`` times in a row (a group), the group read
    ``repeat_count`` times (TRL's ``RepeatSampler``); empty where none says so.

    TRL's GRPO (and RLOO) trainers sample a group of completions per prompt: their sampler yields each prompt
    ``num_generations`` times in a row (one round per step that reuses a generation), and accelerate deals those
    reads out to the ranks, so a group of 8 on ranks of 4 sends one prompt to two ranks, which generate different
    completions of it. Those reads are the design, not an overlap (:func:`~healthcheck.judge.shard_audit.shard_overlap`).

    >>> class GroupSampler:  # the attributes TRL's RepeatSampler keeps
    ...     mini_repeat_count, repeat_count = 8, 2
    >>> import torch
    >>> sample_groups(torch.utils.data.BatchSampler(GroupSampler(), batch_size=4, drop_last=False))
    {'data.sample_group': '8', 'data.group_rounds': '2'}
    >>> sample_groups(torch.utils.data.BatchSampler(range(4), batch_size=4, drop_last=False))
    {}
    """
    for sampler in _nested_samplers(index_sampler):
        group, rounds = getattr(sampler, "mini_repeat_count", None), getattr(sampler, "repeat_count", 1)
        if isinstance(group, int) and isinstance(rounds, int) and group >= 1 and rounds >= 1:
            return {"data.sample_group": str(group), "data.group_rounds": str(rounds)}
    return {}


def _nested_samplers(index_sampler: Any) -> Iterator[Any]:
    """The index sampler and the samplers it wraps, outermost first (a few levels deep at most)."""
    queue, seen = [index_sampler], 0
    while queue and seen < 8:
        current = queue.pop(0)
        seen += 1
        yield current
        queue += [getattr(current, name) for name in ("sampler", "batch_sampler") if getattr(current, name, None) is not None]


def distributed_sampler(index_sampler: Any) -> Any:
    """The DistributedSampler behind a DataLoader's index sampler (a BatchSampler, accelerate's
    BatchSamplerShard, ...), or None."""
    from torch.utils.data.distributed import DistributedSampler

    return next((sampler for sampler in _nested_samplers(index_sampler) if isinstance(sampler, DistributedSampler)), None)


def sampler_plan(index_sampler: Any) -> Optional[SamplerPlan]:
    """The DistributedSampler behind a DataLoader's index sampler, as a plan; None when the data is not sharded
    by one."""
    found = distributed_sampler(index_sampler)
    if found is None:
        return None
    return SamplerPlan(
        seed=int(found.seed),
        num_replicas=int(found.num_replicas),
        rank=int(found.rank),
        shuffle=bool(found.shuffle),
        drop_last=bool(found.drop_last),
        dataset_size=_size(found.dataset) or 0,
    )


#: Samples hashed for :func:`dataset_digest`: this many, evenly spaced from the first to the last (all of a smaller
#: dataset). A rank whose copy differs in a fraction f of its samples (another revision of the file, a filter
#: that kept the length) is told apart with probability ~1 - (1 - f)^32: 97% at f = 10%, where the first, middle
#: and last samples alone gave 27%. Reading them costs one ``__getitem__`` each, once per loader.
_DIGEST_SAMPLES = 32


def dataset_digest(dataset: Any) -> Optional[str]:
    """The dataset's length and a hash of :data:`_DIGEST_SAMPLES` of its samples, evenly spaced from the first to the
    last; None where it cannot be read.

    Why: the shard audit judges overlap by sample index, which means the same sample only where the ranks index the
    same dataset. A script that splits the data per rank itself (``datasets.distributed.split_dataset_by_node``,
    then a shuffled loader) has every rank read indices 0..n of its own part, and was failed as "every rank read
    the same samples". The samples are read with every random generator seeded alike and restored after, so a
    random transform neither tells equal datasets apart nor moves the script's own randomness.

    >>> dataset_digest([[1, 2], [3, 4]]) == dataset_digest([[1, 2], [3, 4]]) != dataset_digest([[1, 2], [3, 5]])
    True
    """
    import hashlib

    from healthcheck.measure.replay import replay_rng

    size = _size(dataset)
    if not size or not hasattr(dataset, "__getitem__"):
        return None
    digest = hashlib.sha256()
    try:
        with replay_rng(0, None):
            for index in _digest_indices(size):
                _feed(digest, dataset[index])
    except Exception:  # a dataset that cannot be indexed this way (or fails on it) gives no digest, not an error
        return None
    return f"{size} samples, sha256 {digest.hexdigest()[:12]}"


def _digest_indices(size: int) -> list[int]:
    """The samples every rank hashes for :func:`dataset_digest`.

    >>> _digest_indices(5), len(_digest_indices(10_000)), _digest_indices(10_000)[:3], _digest_indices(10_000)[-1]
    ([0, 1, 2, 3, 4], 32, [0, 323, 645], 9999)
    """
    if size <= _DIGEST_SAMPLES:
        return list(range(size))
    return sorted({round(i * (size - 1) / (_DIGEST_SAMPLES - 1)) for i in range(_DIGEST_SAMPLES)})


def _shared_indices(size: int) -> list[int]:
    """The samples every rank's collate_fn batches for :func:`batch_facts`: the first, the middle and the last (a
    batch of a few: a collate that pads to the longest sample pads no more than a training batch does)."""
    return sorted({0, size // 2, size - 1})


def batch_facts(dataset: Any, collate_fn: Any, auto_collation: bool = True) -> dict[str, str]:
    """What this rank's DataLoader makes of the dataset's first, middle and last samples: each field of the
    batch (``input_ids``, ``labels``, ``[0]`` for a tuple's first item) with its dtype, shape and a hash. Empty
    where the batch cannot be made, or where making it twice does not give the same batch.

    Why: :func:`dataset_digest` sees what the dataset holds, and tokenizing, truncating, padding or masking in the
    ``collate_fn`` comes after it. A rank whose collate drops the EOS token, pads on the left or truncates shorter
    trains on other tokens from the same samples, and its indices and dataset agree with everyone's. The batch is
    made with every random generator seeded alike and restored after (a random collate, masking say, then gives the
    same batch on every rank); one with its own generator gives another batch each time and is left out.

    >>> import torch
    >>> facts = batch_facts([{"ids": [1, 2], "n": 1}, {"ids": [3, 4], "n": 2}], torch.utils.data.default_collate)
    >>> sorted(facts), facts["n"].split()[0]
    (['ids[0]', 'ids[1]', 'n'], 'int64[2]')
    >>> own = torch.Generator()  # a collate drawing from its own generator: another batch each time
    >>> batch_facts([1, 2], lambda samples: torch.rand(2, generator=own))
    {}
    """
    import hashlib

    from healthcheck.measure.replay import replay_rng

    size = _size(dataset)
    if not size or collate_fn is None or not hasattr(dataset, "__getitem__"):
        return {}
    made: list[dict[str, str]] = []
    try:
        for _ in range(2):
            with replay_rng(0, None):
                samples = [dataset[index] for index in _shared_indices(size)]
                batch = collate_fn(samples) if auto_collation else [collate_fn(sample) for sample in samples]
            fields: dict[str, Any] = {}
            _fields(batch, "", fields)
            made.append({name: _describe(value, hashlib.sha256()) for name, value in fields.items()})
    except Exception:  # a collate that needs other samples (or fails on these) gives no facts, not an error
        return {}
    return made[0] if made[0] == made[1] else {}


def _fields(value: Any, name: str, out: dict[str, Any], depth: int = 0) -> None:
    """A batch's leaves by name: mappings (a dict, transformers' BatchEncoding) by key, lists and tuples
    that hold tensors or mappings by position; anything else is one leaf."""
    import numpy as np
    import torch

    nested = (torch.Tensor, np.ndarray, Mapping)
    if depth < 4 and isinstance(value, Mapping):
        for key in sorted(value, key=str):
            _fields(value[key], f"{name}.{key}" if name else str(key), out, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)) and any(isinstance(item, nested) for item in value):
        for position, item in enumerate(value):
            _fields(item, f"{name}[{position}]", out, depth + 1)
    else:
        out[name or "batch"] = value


def _describe(value: Any, digest: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    _feed(digest, value)
    what = f"{str(dtype).removeprefix('torch.')}[{','.join(str(n) for n in shape)}]" if shape is not None else type(value).__name__
    return f"{what} {digest.hexdigest()[:8]}"


def _feed(digest: Any, value: Any, depth: int = 0) -> None:
    """Feed a sample (tensors, arrays, numbers, strings, and dicts, lists and tuples of them) into ``digest``."""
    import numpy as np
    import torch

    if depth > 4:
        digest.update(type(value).__name__.encode())
    elif isinstance(value, torch.Tensor):
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):  # a dict, or a UserDict such as transformers' BatchEncoding
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _feed(digest, value[key], depth + 1)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(digest, item, depth + 1)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(value).encode())
    else:  # an object whose repr may hold its address: its type only
        digest.update(type(value).__name__.encode())


def _size(dataset: Any) -> Optional[int]:
    try:
        return len(dataset)
    except TypeError:
        return None
