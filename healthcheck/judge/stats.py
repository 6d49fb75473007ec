"""The one tail probability every persistence test uses.

Ranks that run the same code on shards of one shuffled dataset are exchangeable: at any step each
rank is equally likely to be on either side of the others, or to hold an extreme. How often a rank
does so over n steps is then binomial, and its upper tail is the false-alarm probability of naming it.
"""

from __future__ import annotations

import math


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p).

    >>> round(binomial_tail(2, 2, 0.5), 3), binomial_tail(0, 5, 0.1)
    (0.25, 1.0)
    """
    if k <= 0 or n <= 0:
        return 1.0
    if k > n:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def sign_test_p(successes: int, trials: int) -> float:
    """One-sided P(X >= successes) for X ~ Binomial(trials, 1/2): how surprising so many same-side steps are.

    Exact in rational arithmetic (no float underflow of 0.5**n for long windows).

    >>> sign_test_p(44, 58) < 1e-4 < sign_test_p(43, 58)
    True
    >>> round(sign_test_p(10, 10), 5)
    0.00098
    """
    if trials <= 0:
        return 1.0
    return sum(math.comb(trials, k) for k in range(max(successes, 0), trials + 1)) / 2**trials
