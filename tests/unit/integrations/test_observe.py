"""What a script reveals: DataLoader fetches per epoch, the DistributedSampler behind them, settings."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from healthcheck.integrations.script import loaders, observe
from healthcheck.integrations.script.patches import Patches, install
from healthcheck.integrations.script.seeds import SeedCalls


class Session:
    def __init__(self):
        self.loaders = loaders.LoaderRecorder()
        self.seeds = SeedCalls()

    def on_ddp(self, ddp):
        pass

    def on_process_group(self):
        pass

    def owns_comm_hook(self, ddp):
        return False


def test_fetches_are_recorded_per_epoch_with_the_samplers_plan():
    session = Session()
    data = list(range(40))
    sampler = DistributedSampler(data, num_replicas=4, rank=1, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=3, sampler=sampler)
    patches = install(session)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = [int(i) for batch in loader for i in batch]
            record = session.loaders.training_loader()
            assert [i for e, ids in record.batches if e == epoch for i in ids] == seen == list(sampler)
    finally:
        patches.restore()
    assert record.plan.model_dump() == {"seed": 7, "num_replicas": 4, "rank": 1, "shuffle": True, "drop_last": False,
                                        "dataset_size": 40}
    assert record.dataset_size == 40 and record.epochs_started == 2


def test_the_sampler_is_found_through_nested_batch_samplers_and_absent_otherwise():
    inner = DistributedSampler(list(range(10)), num_replicas=2, rank=0, seed=3)
    assert loaders.sampler_plan(BatchSampler(inner, 2, False)).seed == 3
    assert loaders.sampler_plan(BatchSampler(RandomSampler(range(10)), 2, False)) is None


def test_trls_group_sampler_is_read_through_accelerates_shard_as_groups_of_reads():
    # TRL's RepeatSampler (GRPO's): each prompt 8 times in a row, the group twice; accelerate shards its batches.
    from accelerate.data_loader import BatchSamplerShard
    from trl.trainer.utils import RepeatSampler

    sampler = RepeatSampler(range(32), mini_repeat_count=8, batch_size=2, repeat_count=2, seed=0)
    shard = BatchSamplerShard(BatchSampler(sampler, batch_size=4, drop_last=False), num_processes=2, process_index=1)
    settings = loaders.loader_settings(shard)
    assert settings["data.sample_group"] == "8" and settings["data.group_rounds"] == "2", settings
    assert "data.sample_group" not in loaders.loader_settings(BatchSampler(RandomSampler(range(8)), batch_size=4, drop_last=False))


def test_the_loader_that_fetched_most_is_the_training_loader():
    session = Session()
    patches = install(session)
    try:
        list(DataLoader(list(range(30)), batch_size=2))
        list(DataLoader(list(range(6)), batch_size=2))
    finally:
        patches.restore()
    assert session.loaders.training_loader().samples == 30


def test_patches_restore_every_original():
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import dataloader

    before = (DistributedDataParallel.__init__, dataloader._BaseDataLoaderIter._next_index)
    install(Session()).restore()
    assert (DistributedDataParallel.__init__, dataloader._BaseDataLoaderIter._next_index) == before
    patches = Patches()
    patches.wrap(object(), "missing", lambda original: None)  # nothing to wrap: left alone
    patches.restore()


def test_a_wrap_that_fails_midway_puts_back_the_ones_already_installed(monkeypatch):
    # One failed install must not leave half the patches in the process (they once broke 14 later tests).
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import dataloader

    before = (DistributedDataParallel.__init__, dist.init_process_group, dist.all_reduce)
    wrap = Patches.wrap

    def failing_wrap(self, owner, name, make):
        if name == "barrier":  # late in the install: DDP, fully_shard, init_process_group, all_reduce are done
            raise RuntimeError("an unexpected torch layout")
        wrap(self, owner, name, make)

    monkeypatch.setattr(Patches, "wrap", failing_wrap)
    try:
        install(Session())
    except RuntimeError as exc:
        assert "unexpected torch layout" in str(exc)
    else:
        raise AssertionError("install() swallowed the failure")
    assert (DistributedDataParallel.__init__, dist.init_process_group, dist.all_reduce) == before
    assert not hasattr(dataloader._BaseDataLoaderIter._next_index, "__wrapped__")


def test_optimizer_facts_hold_the_hyperparameters_a_rank_could_get_wrong():
    model = torch.nn.Linear(2, 2)
    facts = observe.optimizer_facts(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))
    assert facts["optimizer"] == "AdamW" and facts["optimizer.lr"] == "0.0003"
    assert facts["optimizer.weight_decay"] == "0.1" and facts["optimizer.betas"] == "(0.9, 0.999)"
    assert facts["optimizer.params"] == "2 tensors, 6 elements"  # which parameters, counted: not their values


def test_first_forward_facts_read_the_precision_and_the_seed():
    torch.manual_seed(11)
    model = torch.nn.Linear(2, 2)
    facts = observe.first_forward_facts(model)
    assert facts["torch_seed"] == 11 and facts["precision"] == "fp32" and facts["model_dtype"] == "float32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert observe.first_forward_facts(model)["precision"] == "bfloat16 autocast"


def test_a_compiled_model_is_named_however_it_was_compiled(one_rank):
    # The session reads the facts in a pre-hook on DDP's module, run eagerly inside a compiled region.
    from torch.nn.parallel import DistributedDataParallel

    from healthcheck.measure.eager import eager

    def compile_fact(ddp, call):
        seen = []
        handle = ddp.module.register_forward_pre_hook(eager(lambda module, args: seen.append(
            observe.first_forward_facts(module)["module"]["model.compile"])))
        call(torch.ones(3, 2))
        handle.remove()
        return seen[0]

    eager_ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert compile_fact(eager_ddp, eager_ddp) == "none"
    # torch.compile(DDP(model)): nothing in the model's tree shows it; the wrapper calling DDP does.
    assert compile_fact(eager_ddp, torch.compile(eager_ddp, backend="eager")) == "1x DistributedDataParallel (wrapped, eager)"
    inner = torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 2)), backend="eager")  # DDP(torch.compile(model))
    wrapped_first = DistributedDataParallel(inner)
    assert compile_fact(wrapped_first, wrapped_first) == "1x Sequential (wrapped, eager)"
    # The wrapper is no module of the model's: the other facts read as an eager rank's.
    assert observe.first_forward_facts(inner)["module"]["model.eval_modules"] == "none of 2 in eval mode"
    in_place = torch.nn.Sequential(torch.nn.Linear(2, 2))
    in_place[0].compile(backend="eager")
    in_place_ddp = DistributedDataParallel(in_place)
    assert compile_fact(in_place_ddp, in_place_ddp) == "1x Linear (in place, eager)"
    # How it was compiled is part of the fact: a rank autotuning its kernels where the others take inductor's defaults.
    tuned = torch.nn.Sequential(torch.nn.Linear(2, 2))
    tuned[0].compile(mode="max-autotune-no-cudagraphs")
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    plain[0].compile()
    assert observe.first_forward_facts(plain)["module"]["model.compile"] == "1x Linear (in place, inductor)"
    assert (observe.first_forward_facts(tuned)["module"]["model.compile"]
            == "1x Linear (in place, inductor coordinate_descent_tuning=True max_autotune=True)")


def test_the_dataset_digest_reads_samples_without_moving_the_scripts_randomness():
    import random

    class Augmented(torch.utils.data.Dataset):
        """A random transform, as image or noise augmentation draws one."""

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)) + torch.rand(2), "label": i, "name": f"row{i}"}

    torch.manual_seed(3)
    random.seed(3)
    before = (torch.get_rng_state(), random.getstate())
    digests = {loaders.dataset_digest(Augmented()) for _ in range(2)}
    assert len(digests) == 1 and next(iter(digests)).startswith("5 samples, sha256 ")  # seeded alike each time
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert loaders.dataset_digest([1, 2, 3]) != loaders.dataset_digest([1, 9, 3])  # the middle sample differs
    assert loaders.dataset_digest(range(0)) is None and loaders.dataset_digest({"not": "indexable"}) is None


def test_the_dataset_digest_sees_a_changed_block_away_from_the_first_middle_and_last_samples():
    # Another revision of the file: a tenth of the records differ, none of them the first, the middle or the last.
    rows = [f"record {i}" for i in range(1000)]
    revised = rows[:100] + [f"record {i}, revised" for i in range(100, 200)] + rows[200:]
    assert loaders.dataset_digest(rows) != loaders.dataset_digest(revised)
    assert loaders.dataset_digest(rows) == loaders.dataset_digest(list(rows))


def test_the_batch_facts_follow_the_collate_and_not_the_scripts_randomness():
    import random

    from transformers import BatchEncoding

    rows = [{"ids": list(range(i + 2))} for i in range(7)]

    def pad(samples, eos=True, noise=False):  # a collate that pads, and (like MLM masking) may draw randomness
        ids = [row["ids"] + ([99] if eos else []) for row in samples]
        width = max(len(i) for i in ids)
        batch = torch.tensor([i + [0] * (width - len(i)) for i in ids])
        if noise:
            batch = batch + (torch.rand(batch.shape) < 0.5).long()
        return BatchEncoding({"input_ids": batch, "attention_mask": (batch != 0).long()})  # a UserDict, not a dict

    torch.manual_seed(3)
    random.seed(3)
    before = (torch.get_rng_state(), random.getstate())
    facts = loaders.batch_facts(rows, pad)
    assert sorted(facts) == ["attention_mask", "input_ids"] and facts["input_ids"].startswith("int64[3,9] ")
    assert loaders.batch_facts(rows, lambda s: pad(s, noise=True)) == loaders.batch_facts(rows, lambda s: pad(s, noise=True))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    no_eos = loaders.batch_facts(rows, lambda s: pad(s, eos=False))
    assert no_eos["input_ids"].startswith("int64[3,8] ") and no_eos != facts
    # Without automatic batching (batch_size=None) the collate sees one sample at a time.
    assert sorted(loaders.batch_facts(rows, lambda row: torch.tensor(row["ids"]), auto_collation=False)) == ["[0]", "[1]", "[2]"]
    assert loaders.batch_facts(rows, lambda s: 1 / 0) == {} and loaders.batch_facts(range(0), pad) == {}
    # The dataset digest reads a UserDict's contents too (it used to hash BatchEncoding samples by type only).
    encoded = [BatchEncoding({"input_ids": [i, i + 1]}) for i in range(3)]
    assert loaders.dataset_digest(encoded) != loaders.dataset_digest([BatchEncoding({"input_ids": [i, 7]}) for i in range(3)])


def test_a_loaders_first_fetch_records_its_batch_facts():
    session = Session()
    patches = install(session)
    try:
        loader = DataLoader([[i, i + 1] for i in range(10)], batch_size=2, shuffle=False)
        next(iter(loader))
    finally:
        patches.restore()
    (record,) = session.loaders.loaders.values()
    assert sorted(record.batch_facts) == ["[0]", "[1]"] and record.batch_facts["[0]"].startswith("int64[3] ")


def _epochs(session):
    record = session.loaders.training_loader()
    return [(epoch, ids) for epoch, ids in record.batches], record


def _step(session):
    session.loaders.steps += 1


def test_a_batch_taken_to_look_at_before_training_is_no_epoch():
    """``next(iter(loader))`` for a sample or a sanity loss replays the order; counted, it reads as epoch 1
    repeating epoch 0 (a missing set_epoch) on a rank that trains consistently."""
    session = Session()
    loader = DataLoader(list(range(12)), batch_size=2)
    patches = install(session)
    try:
        next(iter(loader))
        for _ in loader:
            _step(session)
        for _ in loader:  # a second epoch: steps ran since the first started
            _step(session)
    finally:
        patches.restore()
    batches, record = _epochs(session)
    assert [epoch for epoch, _ in batches] == [0] * 6 + [1] * 6
    assert record.epochs_started == 2 and record.peeks == 1


def test_a_batch_taken_between_steps_is_dropped_when_training_goes_on_with_the_older_iterator():
    session = Session()
    loader = DataLoader(list(range(12)), batch_size=2)
    patches = install(session)
    try:
        training = iter(loader)
        next(training)
        _step(session)
        next(iter(loader))  # an evaluation that borrows a training batch
        for _ in training:
            _step(session)
    finally:
        patches.restore()
    batches, record = _epochs(session)
    assert batches == [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7]), (0, [8, 9]), (0, [10, 11])]
    assert record.epochs_started == 1 and record.peeks == 1


def test_an_iterator_per_step_and_epochs_within_one_accumulation_window_stay_epochs():
    """The first repeats its order every step (a bug the shard audit must see); the second is an accumulation
    window longer than the epoch, told from a peek by its sampler's set_epoch."""
    session = Session()
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=False)
    patches = install(session)
    try:
        for _ in range(3):
            next(iter(loader))
            _step(session)
        sampler = DistributedSampler(list(range(8)), num_replicas=2, rank=0, seed=3)
        short = DataLoader(list(range(8)), batch_size=2, sampler=sampler)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            list(short)  # two epochs, then one step
        _step(session)
    finally:
        patches.restore()
    records = sorted(session.loaders.loaders.values(), key=lambda r: r.plan is not None)
    assert [r.epochs_started for r in records] == [3, 2] and [r.peeks for r in records] == [0, 0]


def test_a_loader_with_persistent_workers_starts_an_epoch_each_time_its_iterator_is_reset():
    # One iterator object serves every epoch (DataLoader._reset): every epoch was recorded as epoch 0.
    session = Session()
    data = list(range(12))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, seed=1)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=1, persistent_workers=True)
    patches = install(session)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for _ in loader:
                _step(session)
    finally:
        patches.restore()
    batches, record = _epochs(session)
    assert record.epochs_started == 2 and [epoch for epoch, _ in batches] == [0] * 3 + [1] * 3
    sampler.set_epoch(1)
    assert [i for _, ids in batches[3:] for i in ids] == list(sampler)


def test_the_scripts_python_and_numpy_seeds_are_taken_and_healthchecks_own_are_not():
    # transformers.set_seed seeds python and numpy through the module attributes the patches wrap. The batch facts
    # (and the replay) seed them too, then restore their states: that is healthcheck's seeding, not the script's.
    from transformers import set_seed

    session = Session()
    patches = install(session)
    try:
        set_seed(1234)
        state = random.getstate()
        DataLoader([[i, i + 1] for i in range(10)], batch_size=2)  # no fetch yet
        next(iter(DataLoader([[i, i + 1] for i in range(10)], batch_size=2)))  # the batch facts seed with 0
        assert random.getstate() == state and session.seeds.fields() == {"python_seed": 1234, "numpy_seed": 1234}
        np.random.seed(seed=7)
        random.seed(None)  # OS entropy: no seed to compare
    finally:
        patches.restore()
    assert session.seeds.fields() == {"numpy_seed": 7}
    assert random.seed.__module__ == "random" and np.random.seed is not None and not hasattr(random.seed, "__wrapped__")
    (record,) = [r for r in session.loaders.loaders.values() if r.batch_facts]
    assert sorted(record.batch_facts) == ["[0]", "[1]"]


class _Stream(torch.utils.data.IterableDataset):
    """A stream that shards itself: every ``parts``-th row from ``part`` on, each padded to its own length."""

    def __init__(self, part, parts, rows=24):
        self.part, self.parts, self.rows = part, parts, rows

    def __iter__(self):
        return iter([torch.arange(1, 2 + i % 5) + 100 * i for i in range(self.part, self.rows, self.parts)])


def _padded(rows):
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def test_an_iterable_dataset_is_recorded_by_content_and_the_script_runs_on():
    # Its indices are None: recording them once raised in the script's own loop (int(None)).
    session = Session()
    patches = install(session)
    try:
        loader, batches = DataLoader(_Stream(1, 3), batch_size=3, collate_fn=_padded), []
        for _ in range(2):
            batches += list(loader)
            session.loaders.steps += 1  # the session counts the optimizer steps: an epoch trained on, not a peek
    finally:
        patches.restore()
    record = session.loaders.training_loader()
    assert len(batches) == 6 and record.batches == [] and record.samples == 16
    assert [epoch for epoch, _ in record.contents] == [0, 0, 0, 1, 1, 1]
    assert [h for e, h in record.contents if e == 0] == [h for e, h in record.contents if e == 1]  # a stream replays
    assert session.loaders.evidence()["contents"] == record.contents


def test_a_sample_hashes_alike_whatever_batch_pads_it():
    from healthcheck.integrations.script.sample_hashes import sample_hashes

    rows = list(_Stream(0, 1))
    alone = [h for row in rows for h in sample_hashes(_padded([row]))]
    assert [h for i in range(0, 24, 4) for h in sample_hashes(_padded(rows[i: i + 4]))] == alone
    assert len(set(alone)) == 24
    padded = torch.nn.utils.rnn.pad_sequence(rows[:4], batch_first=True)  # no mask: a row is hashed with its padding
    assert sample_hashes(padded)[3] == alone[3] != sample_hashes(padded)[0]


def test_a_batch_without_a_cpu_tensor_leaves_the_loader_unhashed():
    session = Session()
    patches = install(session)
    try:
        list(DataLoader(["a", "b", "c", "d"], batch_size=2))
    finally:
        patches.restore()
    record = session.loaders.training_loader()
    assert not record.hashed and record.contents == [] and session.loaders.evidence()["contents"] == []


def test_each_steps_forward_inputs_are_the_evidence_where_no_dataloader_ran():
    recorder = loaders.LoaderRecorder()
    ids = torch.arange(12).reshape(3, 4)
    recorder.on_step_inputs(0, {"input_ids": ids})
    recorder.on_step_inputs(1, {"__arg0": ids + 1})  # called positionally: model(x)
    recorder.on_step_inputs(2, None)  # no training forward kept: nothing to hash
    evidence = recorder.evidence()
    assert evidence["shard_source"] == "forward" and [step for step, _ in evidence["contents"]] == [0, 1]
    assert len(evidence["contents"][0][1]) == 3 and evidence["contents"][0][1] != evidence["contents"][1][1]
