"""The script branch of the audit assembly: the shard plan rebuilt from the samplers the ranks reported."""

from __future__ import annotations

from torch.utils.data.distributed import DistributedSampler

from healthcheck.artifacts import RankEvidence, SamplerPlan
from healthcheck.judge.assemble import script_shard_audit


def evidence(rank: int, world: int, seed: int, n: int = 64, take: int = 8, sampler: bool = True) -> RankEvidence:
    order = list(DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed, shuffle=True))[:take]
    plan = SamplerPlan(seed=seed, num_replicas=world, rank=rank, shuffle=True, drop_last=False, dataset_size=n)
    return RankEvidence(consumed=[(0, order[:4]), (0, order[4:])], sampler=plan if sampler else None,
                        shard_source="sampler" if sampler else "loader")


def test_a_shared_sampler_seed_passes_in_the_planned_order():
    outcome = script_shard_audit([evidence(r, 4, seed=5) for r in range(4)])
    assert outcome.passed and outcome.signature == "disjoint" and "planned order" in outcome.message


def test_one_rank_with_its_own_sampler_seed_departs_from_the_majority_plan():
    ranks = [evidence(r, 4, seed=5 if r != 2 else 99) for r in range(4)]
    outcome = script_shard_audit(ranks)
    assert not outcome.passed and outcome.ranks == (2,)


def test_without_a_distributed_sampler_only_overlap_is_judged():
    disjoint = [evidence(r, 4, seed=5, sampler=False) for r in range(4)]
    assert script_shard_audit(disjoint).passed and "order was not checked" in script_shard_audit(disjoint).message
    same = [evidence(0, 4, seed=5, sampler=False) for _ in range(4)]
    assert script_shard_audit(same).signature == "identical"


def test_a_group_samplers_reads_shared_by_ranks_pass_and_split_groups_are_named():
    # GRPO: 8 completions of each prompt, ranks of 4, so each prompt's reads go to both ranks, at the same steps.
    groups = {"data.sample_group": "8", "data.group_rounds": "1"}

    def rank(consumed, facts=groups):
        return RankEvidence(consumed=consumed, extra=dict(facts), sampler=None, shard_source="loader")

    shared = [rank([(0, [3] * 4), (0, [9] * 4)]) for _ in range(2)]
    outcome = script_shard_audit(shared)
    assert outcome.passed and "whole groups of 8" in outcome.message, outcome.message
    assert script_shard_audit([r.model_copy(update={"extra": {}}) for r in shared]).signature == "identical"
    twice = [rank([(0, [3] * 4), (0, [3] * 4)]) for _ in range(2)]  # 16 reads of prompt 3 in one epoch: one group too many
    assert script_shard_audit(twice).signature == "identical"
    more = [rank([(0, [3] * 4), (0, [9] * 4)]), rank([(0, [3] * 4), (0, [3] * 4)])]  # 12 reads of prompt 3
    assert script_shard_audit(more).signature == "overlap 0-1"
    apart = [rank([(0, [3] * 4), (0, [9] * 4)]), rank([(0, [5] * 4), (0, [9] * 4)])]  # rank 1's sampler drew prompt 5
    outcome = script_shard_audit(apart)
    assert outcome.signature == "split-groups 0-1" and "no whole group of 8" in outcome.message, outcome.message
    # A rank with its own group size: judged as if each prompt were read once (the environment audit names it).
    assert not script_shard_audit([shared[0], rank(shared[1].consumed, {"data.sample_group": "4", "data.group_rounds": "1"})]).passed


def test_no_batches_is_not_measured():
    outcome = script_shard_audit([RankEvidence(shard_source="none") for _ in range(2)])
    assert outcome.passed and not outcome.measured and outcome.message.startswith("not measured")


def test_accelerates_dispatch_is_neither_an_environment_difference_nor_a_shard_verdict():
    # Rank 0 reads every rank's batch from one DataLoader and sends each its part; the others read none.
    from healthcheck.artifacts import RankInfo
    from healthcheck.judge.assemble import environment_from_evidence

    info = [RankInfo(rank=r, local_rank=r, node="n", device="cpu", device_name="cpu", precision="fp32") for r in range(3)]
    settings = {"data.batch_size": "2", "data.drop_last": "False", "optimizer.lr": "0.001"}
    dispatched = [RankEvidence(extra=settings if r == 0 else {"optimizer.lr": "0.001"}, shard_source="loader" if r == 0 else "forward",
                               contents=[(0, [10 * r + 1, 10 * r + 2])]) for r in range(3)]
    assert environment_from_evidence(info, dispatched).passed
    outcome = script_shard_audit(dispatched)
    assert not outcome.measured and outcome.message.startswith("not measured: only rank 0 fetched from a DataLoader")
    # Every rank with a DataLoader: their settings are compared, and one of its own is named.
    own = [evidence.model_copy(update={"extra": {**settings, "data.batch_size": "4" if r == 2 else "2"}})
           for r, evidence in enumerate(dispatched)]
    assert environment_from_evidence(info, own).ranks == (2,)


def with_digest(rank_evidence: RankEvidence, digest: str) -> RankEvidence:
    return rank_evidence.model_copy(update={"dataset_digest": digest})


def test_a_rank_whose_sampler_splits_another_dataset_is_named():
    # Rank 3 loaded another file of the same length: its indices follow the plan, its samples do not.
    ranks = [with_digest(evidence(r, 4, seed=5), "64 samples, sha256 b" if r == 3 else "64 samples, sha256 a") for r in range(4)]
    outcome = script_shard_audit(ranks)
    assert not outcome.passed and outcome.ranks == (3,) and "different datasets" in outcome.message
    # The same without a DistributedSampler (accelerate's shards): the majority's dataset decides.
    loose = [with_digest(evidence(r, 4, seed=5, sampler=False), "b" if r == 1 else "a") for r in range(4)]
    assert script_shard_audit(loose).ranks == (1,)


def test_ranks_that_split_the_data_themselves_are_not_judged_by_index():
    # split_dataset_by_node, then the same shuffled loader: equal indices, different samples (it was "identical").
    own = [with_digest(evidence(0, 4, seed=5, sampler=False), f"16 samples, sha256 {r}") for r in range(4)]
    outcome = script_shard_audit(own)
    assert outcome.passed and not outcome.measured and "its own dataset" in outcome.message
    # Two ranks that took the same part of the split read the same samples: judged between them only.
    twice = [with_digest(evidence(0, 4, seed=5, sampler=False), f"16 samples, sha256 {min(r, 2)}") for r in range(4)]
    outcome = script_shard_audit(twice)
    assert not outcome.passed and set(outcome.ranks) == {2, 3}


def test_accelerates_padding_is_excused_with_the_dataset_size_every_rank_reported():
    # accelerate's even_batches: 38 samples in batches of 2 on 5 ranks, rank 4's last batch wraps to the first two.
    # No DistributedSampler plan holds the size here: it comes from the loader's dataset, a typed field of the
    # evidence (it was read back out of the digest's "38 samples, ..." text).
    batches = [[2 * i, 2 * i + 1] for i in range(19)] + [[0, 1]]
    ranks = [RankEvidence(consumed=[(0, batches[step * 5 + r]) for step in range(4)], shard_source="loader",
                          dataset_digest="38 samples, sha256 a", dataset_size=38) for r in range(5)]
    outcome = script_shard_audit(ranks)
    assert outcome.passed and "2 read twice where the sampler padded an epoch's end" in outcome.message, outcome.message
    unsized = [rank_evidence.model_copy(update={"dataset_size": None}) for rank_evidence in ranks]
    assert not script_shard_audit(unsized).passed  # without a length, the wrapped batch reads as overlap


BATCH = {"input_ids": "int64[3,40] 1a2b3c4d", "labels": "int64[3,40] 5e6f7a8b"}
NO_EOS = {"input_ids": "int64[3,39] 0badc0de", "labels": "int64[3,39] 0ddba11a"}


def with_batch(rank_evidence: RankEvidence, facts: dict) -> RankEvidence:
    return rank_evidence.model_copy(update={"dataset_digest": "64 samples, sha256 a", "batch_facts": facts})


def test_a_rank_whose_loader_makes_another_batch_of_the_same_samples_is_named_before_its_shards():
    for rank in (0, 2, 3):  # not always rank 3
        ranks = [with_batch(evidence(r, 4, seed=5), NO_EOS if r == rank else BATCH) for r in range(4)]
        outcome = script_shard_audit(ranks)
        assert not outcome.passed and outcome.ranks == (rank,), outcome
        assert outcome.message.startswith("the ranks' DataLoaders make different batches of the same samples: input_ids differs: ")
        assert f"rank {rank} int64[3,39] 0badc0de; labels differs: " in outcome.message
    # One field apart: only that field is listed.
    masked = {**BATCH, "labels": "int64[3,40] 99999999"}
    outcome = script_shard_audit([with_batch(evidence(r, 4, seed=5), masked if r == 1 else BATCH) for r in range(4)])
    assert outcome.ranks == (1,) and "labels differs" in outcome.message and "input_ids" not in outcome.message


def test_batches_are_compared_only_where_every_rank_made_one_of_one_dataset():
    same = [with_batch(evidence(r, 4, seed=5), BATCH) for r in range(4)]
    outcome = script_shard_audit(same)
    assert outcome.passed and outcome.message.endswith("every rank's DataLoader makes the same batch of the dataset's "
                                                       "first, middle and last samples")
    # A rank whose collate is not reproducible (its own generator) made none: the batches are not compared.
    unknown = [with_batch(evidence(r, 4, seed=5), {} if r == 0 else (NO_EOS if r == 2 else BATCH)) for r in range(4)]
    outcome = script_shard_audit(unknown)
    assert outcome.passed and "same batch" not in outcome.message
    # Each rank on its own part of the data (split_dataset_by_node): other samples, so other batches, rightly.
    own = [with_digest(evidence(0, 4, seed=5, sampler=False), f"16 samples, sha256 {r}").model_copy(
        update={"batch_facts": {"x": f"int64[3] {r}"}}) for r in range(4)]
    assert not script_shard_audit(own).measured  # and no sample hashes: nothing to tell the parts apart by
    hashed = [rank.model_copy(update={"contents": [(0, [100 * r + i for i in range(4)])]}) for r, rank in enumerate(own)]
    outcome = script_shard_audit(hashed)
    assert outcome.passed and outcome.measured and outcome.message.startswith("ranks 0-3 trained on different samples")
    hashed[2] = hashed[2].model_copy(update={"contents": hashed[0].contents})  # rank 2 split off rank 0's part
    assert script_shard_audit(hashed).ranks == (0, 2)


def test_a_rank_with_its_own_warmup_is_explained_only_when_param_equality_names_it():
    from healthcheck.judge.assemble import explained_by_learning_rate
    from healthcheck.judge.audit_outcome import AuditOutcome
    from healthcheck.measure.records import rank_rows

    def rows(odd_rank, steps=4, world=4):
        out = []
        for step in range(steps):  # warmup over 2 steps, over 4 on the odd rank: step 0 is 0 on every rank
            lr = [step / (4 if rank == odd_rank else 2) for rank in range(world)]
            data = {"per_rank_loss": [1.0] * world, "per_rank_grad_norm": [1.0] * world, "cosine_to_mean": [1.0] * world,
                    "per_rank_extras": {"lr": lr}}
            out += rank_rows(step, data)
        return out

    failed = AuditOutcome(False, "rank 1's parameters differ", "params 0,2-3|1", (1,))
    assert explained_by_learning_rate(failed, rows(1), 4).message.endswith(
        "rank 1 stepped with another learning rate from step 1: ranks 0, 2-3 0.5; rank 1 0.25")
    assert explained_by_learning_rate(failed, rows(3), 4) == failed  # another rank's rate explains nothing here
    passed = AuditOutcome(True, "bit-identical", "identical")
    assert explained_by_learning_rate(passed, rows(1), 4) == passed
    without = [{k: v for k, v in row.items() if k != "lr"} for row in rows(1)]  # the built-in trainer's rows
    assert explained_by_learning_rate(failed, without, 4) == failed
