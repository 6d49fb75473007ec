"""Properties of the pure consistency metrics (no process group, no torch).

    python -m pytest tests/unit/test_metrics.py -q
"""

from __future__ import annotations

import doctest
import json
import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from healthcheck.measure import metrics
from healthcheck.measure.metrics import (
    compute_step_metrics,
    cosine_to_mean,
    dispersion,
    gradient_diversity,
    gram_statistics,
    gram_to_cosine,
    noise_scale_estimators,
    window_summary,
)

coordinate = st.floats(min_value=-100, max_value=100, allow_nan=False).filter(lambda x: x == 0 or abs(x) > 1e-3)


def vectors(min_ranks: int = 1):
    """N gradient vectors of a common dimension, none of them zero."""
    return st.integers(1, 6).flatmap(
        lambda dim: st.lists(
            st.lists(coordinate, min_size=dim, max_size=dim).filter(lambda v: any(v)), min_size=min_ranks, max_size=6
        )
    )


def gram_of(vecs):
    return [[math.fsum(a * b for a, b in zip(u, v)) for v in vecs] for u in vecs]


def metrics_of(vecs, losses, tokens=None, step=0):
    """compute_step_metrics fed from exact vectors, the way exact mode feeds it."""
    gram = gram_of(vecs)
    sqnorms, dots, mean_sqnorm = gram_statistics(gram)
    return compute_step_metrics(
        step=step,
        direction="exact",
        per_rank_loss=losses,
        per_rank_sqnorm=sqnorms,
        dots_with_mean=dots,
        mean_sqnorm=mean_sqnorm,
        gram=gram,
        per_rank_tokens=tokens,
    )


def test_doctests_pass():
    failed, attempted = doctest.testmod(metrics)
    assert attempted > 10 and failed == 0


@given(vectors())
def test_cosines_lie_in_unit_interval(vecs):
    for row in gram_to_cosine(gram_of(vecs)):
        assert all(-1.0 <= value <= 1.0 for value in row)


@given(vectors(min_ranks=2))
def test_cosine_matrix_matches_direct_cosine(vecs):
    cosine = gram_to_cosine(gram_of(vecs))
    for i, u in enumerate(vecs):
        assert cosine[i][i] == 1.0
        for j, v in enumerate(vecs):
            direct = math.fsum(a * b for a, b in zip(u, v)) / (math.hypot(*u) * math.hypot(*v))
            assert math.isclose(cosine[i][j], direct, abs_tol=1e-9)


@given(st.lists(coordinate, min_size=1, max_size=8).filter(any), st.integers(1, 8), coordinate)
def test_identical_gradients_are_perfectly_consistent(vec, n, loss):
    m = metrics_of([vec] * n, [loss] * n)
    assert all(math.isclose(c, 1.0, abs_tol=1e-9) for c in m.cosine_to_mean)
    assert all(math.isclose(c, 1.0, abs_tol=1e-9) for row in m.pairwise_cosine for c in row)
    assert m.loss_std == 0 and m.loss_range == 0
    assert math.isclose(m.grad_norm_std, 0.0, abs_tol=1e-9 * m.mean_grad_norm)
    assert math.isclose(m.gradient_diversity, 1 / n, rel_tol=1e-9)
    assert math.isclose(m.mean_grad_norm, math.hypot(*vec), rel_tol=1e-9)
    if n > 1:
        assert math.isclose(m.cosine_min, 1.0, abs_tol=1e-9) and math.isclose(m.cosine_mean, 1.0, abs_tol=1e-9)
        # No spread between the ranks means no estimated gradient noise.
        assert math.isclose(m.trace_sigma_est, 0.0, abs_tol=1e-9 * m.mean_grad_norm**2)
    assert m.nonfinite_ranks == []


@given(vectors(min_ranks=2), st.data())
def test_permuting_ranks_permutes_outputs(vecs, data):
    n = len(vecs)
    losses = data.draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
    tokens = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))
    base = metrics_of(vecs, losses, tokens)
    permuted = metrics_of([vecs[i] for i in order], [losses[i] for i in order], [tokens[i] for i in order])

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)

    for name in ("per_rank_loss", "per_rank_grad_norm", "cosine_to_mean", "per_rank_tokens"):
        assert all(same(p, getattr(base, name)[i]) for p, i in zip(getattr(permuted, name), order)), name
    for a, i in enumerate(order):
        for b, j in enumerate(order):
            assert same(permuted.pairwise_cosine[a][b], base.pairwise_cosine[i][j])
    for name in ("loss_std", "loss_range", "grad_norm_std", "grad_norm_cv", "cosine_mean", "cosine_min",
                 "gradient_diversity", "mean_grad_norm", "grad_sqnorm_est", "trace_sigma_est"):
        assert same(getattr(permuted, name), getattr(base, name)), name


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=20))
def test_dispersion_matches_statistics(values):
    std, spread, cv = dispersion(values)
    assert math.isclose(std, statistics.pstdev(values), rel_tol=1e-9, abs_tol=1e-6)
    assert spread == max(values) - min(values)
    mean = statistics.fmean(values)
    assert math.isnan(cv) if mean == 0 else math.isclose(cv, std / mean, rel_tol=1e-9, abs_tol=1e-9)


def test_dispersion_ignores_nonfinite_values_and_reports_nan_when_none_are_left():
    assert dispersion([1.0, float("nan"), 3.0, float("inf")]) == (1.0, 2.0, 0.5)
    assert all(math.isnan(x) for x in dispersion([float("nan")]))


@settings(max_examples=200)
@given(
    st.floats(1e-3, 1e3), st.floats(0, 1e3), st.floats(1, 1e3), st.floats(1.5, 64)
)
def test_noise_scale_recovers_constructed_gradient_and_noise(true_sqnorm, trace, b_small, ratio):
    # Expected squared norms of a batch-B gradient: |G|² + tr(Σ)/B (McCandlish et al. eq. A.1).
    b_big = b_small * ratio
    small = true_sqnorm + trace / b_small
    big = true_sqnorm + trace / b_big
    grad_sq, trace_est, b_simple = noise_scale_estimators(small, big, b_small, b_big)
    assert math.isclose(grad_sq, true_sqnorm, rel_tol=1e-6, abs_tol=1e-9 * small)
    assert math.isclose(trace_est, trace, rel_tol=1e-6, abs_tol=1e-9 * small * b_big)
    assert math.isclose(b_simple, trace_est / grad_sq, rel_tol=1e-12)


def test_noise_scale_of_orthogonal_unit_gradients_in_batch_units():
    # Four orthogonal unit gradients: |G_small|² = 1, |G_big|² = 1/4 →  |G|² = 0, S = 1: noise only.
    vecs = [[1.0 if i == j else 0.0 for j in range(4)] for i in range(4)]
    m = metrics_of(vecs, [0.0] * 4)
    assert m.noise_scale_unit == "batches"
    assert math.isclose(m.grad_sqnorm_est, 0.0, abs_tol=1e-12) and math.isclose(m.trace_sigma_est, 1.0)
    assert math.isclose(m.gradient_diversity, 1.0) and m.cosine_min == 0.0


def test_noise_scale_uses_tokens_when_every_rank_gives_them():
    vecs = [[1.0, 0.0], [0.0, 1.0]]
    m = metrics_of(vecs, [0.0, 0.0], tokens=[10, 30])
    assert m.noise_scale_unit == "tokens" and m.per_rank_tokens == [10, 30]
    # B_small = 20, B_big = 40: S = (1 − 1/2) / (1/20 − 1/40) = 20.
    assert math.isclose(m.trace_sigma_est, 20.0)
    assert metrics_of(vecs, [0.0, 0.0], tokens=[10, None]).noise_scale_unit == "batches"


def test_noise_scale_is_nan_for_one_rank():
    assert all(math.isnan(x) for x in noise_scale_estimators(1.0, 1.0, 1.0, 1.0))


def test_cosine_to_mean_and_diversity_on_a_small_example():
    # g_0 = (1, 0), g_1 = (0, 1): ḡ = (1/2, 1/2), ⟨g_i, ḡ⟩ = 1/2, ‖ḡ‖² = 1/2.
    assert all(math.isclose(c, math.sqrt(0.5)) for c in cosine_to_mean([0.5, 0.5], [1.0, 1.0], 0.5))
    assert math.isclose(gradient_diversity([1.0, 1.0], 0.5), 1.0)


def test_nonfinite_rank_is_reported_not_averaged_away():
    nan = float("nan")
    m = compute_step_metrics(
        step=3, direction="sketch", per_rank_loss=[1.0, nan, 3.0], per_rank_sqnorm=[1.0, 4.0, nan],
        dots_with_mean=[nan, nan, nan], mean_sqnorm=nan,
        gram=[[1.0, 0.5, nan], [0.5, 4.0, nan], [nan, nan, nan]],
    )
    assert m.nonfinite_ranks == [1, 2]
    assert (m.loss_std, m.loss_range) == (1.0, 2.0)  # over ranks 0 and 2
    assert math.isclose(m.grad_norm_std, 0.5)  # norms 1 and 2
    assert math.isclose(m.cosine_min, 0.25) and math.isnan(m.noise_scale)
    data = m.to_dict()
    json.dumps(data, allow_nan=False)
    assert data["per_rank_loss"] == [1.0, None, 3.0] and data["pairwise_cosine"][2] == [None] * 3


def test_nonfinite_flag_alone_lists_the_rank():
    m = compute_step_metrics(
        step=0, direction="sketch", per_rank_loss=[1.0, 1.0], per_rank_sqnorm=[1.0, 1.0],
        dots_with_mean=[1.0, 1.0], mean_sqnorm=1.0, gram=[[1.0, 1.0], [1.0, 1.0]], nonfinite_flags=[False, True],
    )
    assert m.nonfinite_ranks == [1]



special = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 5e-324, 1e300, -1.0])


@settings(max_examples=300)
@given(st.integers(1, 7).flatmap(
    lambda n: st.lists(st.lists(st.floats(-1e3, 1e3) | special, min_size=n, max_size=n), min_size=n, max_size=n)
))
def test_cosine_matrix_is_the_scalar_formula_to_the_bit(gram):
    # The vectorised cosines take, entry by entry, the IEEE operations of the formula written out for one
    # entry (a Python float loop until 2026-11-27): the same bits, NaN and the clip at ±1 included.
    import numpy as np

    def one(i, j):
        norm = [math.sqrt(row[k]) if row[k] > 0 and math.isfinite(row[k]) else math.nan for k, row in enumerate(gram)]
        if i == j and not math.isnan(norm[i]):
            return 1.0
        ratio = gram[i][j] / (norm[i] * norm[j]) if norm[i] * norm[j] != 0 else math.nan
        return ratio if math.isnan(ratio) else min(1.0, max(-1.0, ratio))

    expected = [[one(i, j) for j in range(len(gram))] for i in range(len(gram))]
    for got in (gram_to_cosine(gram), gram_to_cosine(np.array(gram))):
        assert json.dumps(got) == json.dumps(expected)  # repr of every float: the bits, NaN and -0.0 included


def test_gram_must_be_square():
    import numpy as np

    for bad in ([[1.0, 2.0]], np.ones((2, 3))):
        try:
            gram_to_cosine(bad)
        except ValueError as error:
            assert "square" in str(error)
        else:
            raise AssertionError("a non-square Gram was accepted")


def test_dispersion_of_huge_values_is_infinite_not_an_error():
    # A float power raised OverflowError past 1.8e308: a diverging run must get a metric, not a crash.
    std, spread, cv = dispersion([1e300, -1e300])
    assert (std, spread) == (math.inf, 2e300) and math.isnan(cv)

def test_window_summary_on_known_values():
    summary = window_summary(range(1, 101))
    assert (summary["median"], summary["min"], summary["max"]) == (50.5, 1.0, 100.0)
    assert math.isclose(summary["p95"], 95.05)  # position 0.95 * 99 = 94.05 → 95 + 0.05 * (96 − 95)
    summary = window_summary([3.0, None, float("nan"), 1.0, 2.0])
    assert (summary["median"], summary["min"], summary["max"]) == (2.0, 1.0, 3.0)
    assert math.isclose(summary["p95"], 2.9)
    assert window_summary([None, float("nan")]) == {"median": None, "p95": None, "min": None, "max": None}


@given(st.lists(st.floats(-1e9, 1e9), min_size=1, max_size=50))
def test_window_summary_matches_linear_interpolation(values):
    ordered = sorted(values)
    summary = window_summary(values)
    assert math.isclose(summary["median"], statistics.median(values), rel_tol=1e-12, abs_tol=1e-6)
    # statistics.quantiles(method="inclusive") is the same linear interpolation as numpy's default.
    if len(values) > 1:
        p95 = statistics.quantiles(values, n=20, method="inclusive")[-1]
        assert math.isclose(summary["p95"], p95, rel_tol=1e-9, abs_tol=1e-6)
    assert (summary["min"], summary["max"]) == (ordered[0], ordered[-1])
