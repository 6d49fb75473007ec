"""The replay audit's pure judgement: majority within device groups, the tolerance mode, and the report text."""

from __future__ import annotations

from healthcheck.artifacts import FailFastPolicy, ReplayDifference, ReplayEvidence, ReplayRound
from healthcheck.judge.fail_fast import FailFast
from healthcheck.judge.replay_audit import (
    ADVICE,
    TOLERANCE_FLOOR,
    replay_audit,
    replay_tolerance,
    split_replays,
    tolerance_labels,
)


def _difference(rank: int, reproduced: bool = True) -> ReplayDifference:
    return ReplayDifference(
        rank=rank, reference_rank=0, max_abs=3.1e-4, rel_l2=1.2e-3, first_tensor="transformer.wte.weight",
        reproduced=reproduced, repeat_rel_l2=1.2e-3 if reproduced else 0.0,
    )


def _evidence(*rounds: ReplayRound, groups=((0, 1, 2, 3, 4, 5, 6, 7),), mode="bitwise", tolerance=0.0) -> ReplayEvidence:
    return ReplayEvidence(mode=mode, mode_reason="why", tolerance=tolerance, device_groups=[list(g) for g in groups],
                          every=15, rounds=list(rounds))


def _clean(step: int, world: int = 8) -> ReplayRound:
    return ReplayRound(step=step, source_rank=1, groups=[list(range(world))])


def test_the_rank_outside_the_majority_is_named_against_a_majority_rank():
    hashes = [(1, 2)] * 8
    hashes[5] = (1, 3)
    split = split_replays(hashes, [list(range(8))])
    assert split.odd == [5] and split.references == {5: 0} and split.no_majority == []
    assert split.groups == [[0, 1, 2, 3, 4, 6, 7], [5]]


def test_a_faulty_rank_zero_is_measured_against_another_rank():
    split = split_replays(["bad", "ok", "ok", "ok"], [[0, 1, 2, 3]])
    assert split.references == {0: 1}


def test_ranks_are_compared_only_within_their_device_group():
    # Two device models: each group agrees with itself, although the groups' bits differ.
    labels = ["a100", "h100", "a100", "h100"]
    assert split_replays(labels, [[0, 2], [1, 3]]).references == {}
    # The same labels in one group have no majority: every rank is suspect.
    split = split_replays(labels, [[0, 1, 2, 3]])
    assert split.no_majority == [[0, 1, 2, 3]] and split.odd == [1, 2, 3]


def test_tolerance_is_measured_from_repeats_with_a_floor():
    assert replay_tolerance([0.0] * 8) == TOLERANCE_FLOOR
    assert replay_tolerance([1e-6, 3e-6]) == 1.2e-5


def test_tolerance_labels_group_near_ranks_and_separate_a_far_one():
    near, far = 5e-7, 2e-3
    world = 5
    distances = [[0.0 if i == j else (far if 3 in (i, j) else near) for j in range(world)] for i in range(world)]
    labels = tolerance_labels(distances, 1e-6, [list(range(world))])
    assert split_replays(labels, [list(range(world))]).references == {3: 0}
    # A tolerance above the fault's size hides it: the bound really decides.
    assert split_replays(tolerance_labels(distances, 1e-2, [list(range(world))]), [list(range(world))]).references == {}


def test_clean_rounds_pass_and_state_the_mode():
    outcome = replay_audit(_evidence(_clean(0), _clean(15), _clean(30), _clean(45)))
    assert outcome.passed and outcome.measured and outcome.signature == "agreed"
    assert outcome.message == ("ranks 0-7 computed bit-identical gradients of the same micro-batch in 4 replays "
                               "(steps 0, 15, 30, 45) [bitwise]")
    assert outcome.details["replay_steps"] == [0, 15, 30, 45]
    tolerant = replay_audit(_evidence(_clean(0), mode="tolerance", tolerance=2e-6))
    assert tolerant.passed and "[tolerance: relative L2 ≤ 2.0e-06]" in tolerant.message


def test_a_disagreeing_rank_is_named_with_step_size_repeat_and_advice():
    bad = ReplayRound(step=15, source_rank=2, groups=[[0, 1, 2, 3, 4, 6, 7], [5]], differences=[_difference(5)])
    outcome = replay_audit(_evidence(_clean(0), bad, bad.model_copy(update={"step": 30})))
    assert not outcome.passed and outcome.ranks == (5,) and outcome.signature == "differs 5"
    message = outcome.message
    assert message.startswith("rank 5 computed a different gradient at step 15: every rank replayed rank 2's micro-batch")
    for part in ("max |Δ| 3.1e-04", "relative L2 1.2e-03", "reproduced on a second replay (persistent)",
                 "(again at step 30)", "[bitwise]", ADVICE):
        assert part in message, part
    assert "drain the node and rerun `healthcheck probe` on the rest" in message


def test_a_rank_whose_settings_differ_is_not_sent_to_be_drained():
    # Another config or matmul precision on a sound device: the environment audit has the cause.
    bad = ReplayRound(step=0, source_rank=3, groups=[[0, 1, 3], [2]], differences=[_difference(2)])
    outcome = replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]), settings_differ=(2,))
    assert not outcome.passed and outcome.ranks == (2,)
    assert ADVICE not in outcome.message
    assert outcome.message.endswith("rank 2 also runs with other settings (audit.environment), which explains a "
                                    "different gradient: fix them before suspecting the device")
    # Settings that differ on another rank explain nothing about this one.
    assert ADVICE in replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]), settings_differ=(1,)).message


def test_a_rank_with_its_own_module_hooks_is_sent_to_check_them():
    # transformers' NEFTune on one Trainer rank: a forward hook on the embeddings, no setting the environment reads.
    from healthcheck.artifacts import RankEvidence
    from healthcheck.judge.assemble import hooks_difference

    hooks = hooks_difference([RankEvidence(hints={"hooks.Embedding": "1x forward neftune_post_forward_hook"} if r == 2 else {})
                              for r in range(4)])
    bad = ReplayRound(step=0, source_rank=3, groups=[[0, 1, 3], [2]], differences=[_difference(2)])
    outcome = replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]), hooks_differ=hooks)
    assert not outcome.passed and outcome.ranks == (2,) and ADVICE not in outcome.message
    assert ("rank 2 also runs other hooks on the model's modules (hooks.Embedding differs: ranks 0-1, 3 <unset>; rank 2 "
            "1x forward neftune_post_forward_hook)") in outcome.message
    assert outcome.message.endswith("check them before suspecting the device")
    # Hooks on rank 0 alone (a script logging activations there) explain nothing about rank 2.
    rank0 = hooks_difference([RankEvidence(hints={"hooks.Linear": "4x forward log"} if r == 0 else {}) for r in range(4)])
    assert ADVICE in replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]), hooks_differ=rank0).message
    assert hooks_difference([RankEvidence(hints={"hooks.Linear": "1x forward log"}) for _ in range(4)]) is None


def test_a_transient_difference_still_fails_and_says_so():
    bad = ReplayRound(step=15, source_rank=2, groups=[[0, 1, 2], [3]], differences=[_difference(3, reproduced=False)])
    outcome = replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]))
    assert not outcome.passed and "not reproduced on a second replay (transient" in outcome.message


def test_no_majority_names_every_rank_of_the_group():
    split_round = ReplayRound(step=0, source_rank=0, groups=[[0], [1]], differences=[_difference(1)], no_majority=[[0, 1]])
    outcome = replay_audit(_evidence(split_round, groups=[(0, 1)]))
    assert not outcome.passed and outcome.ranks == (0, 1) and outcome.signature == "no-majority 0|1"
    assert "no majority" in outcome.message


def test_rounds_on_differing_parameters_are_not_blamed_on_a_device():
    diverged = ReplayRound(step=15, source_rank=2, groups=[[0, 1, 2], [3]], params_agree=False)
    outcome = replay_audit(_evidence(_clean(0, 4), diverged, groups=[(0, 1, 2, 3)]))
    assert outcome.passed and "param_equality names the rank" in outcome.message


def test_nothing_to_compare_is_not_measured():
    assert not replay_audit(_evidence()).measured
    assert not replay_audit(_evidence(_clean(0, 2), groups=[(0,), (1,)])).measured


def test_a_replay_failure_stops_the_probe():
    bad = ReplayRound(step=15, source_rank=2, groups=[[0, 1, 2], [3]], differences=[_difference(3)])
    gate = FailFast(FailFastPolicy())
    assert gate.judge(15, {"replay": replay_audit(_evidence(bad, groups=[(0, 1, 2, 3)]))})
    assert gate.stop is not None and gate.stop.check == "replay" and gate.stop.step == 15
