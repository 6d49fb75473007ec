"""The seeds a script gives python's and numpy's global generators, taken as it gives them.

Why: torch reads its seed back (``torch.initial_seed()``), python and numpy do not. Without the seed, the
seeds audit could tell a rank seeded otherwise from a rank that drew one number more only by the
generator's state, and failed both: a consistent script whose rank 0 picks an example to log with
``random.choice`` before training failed. With each rank's seed, the audit judges the seeds and reports a
state that drew apart under a shared seed (:func:`healthcheck.judge.exact_audits.seed_audit`), as it does
for torch.

``random.seed`` and ``numpy.random.seed`` are wrapped while the script runs (:mod:`.patches`);
``transformers.set_seed`` and accelerate's ``set_seed`` call both. A script that seeds through a name it
imported before healthcheck started (none can: the script runs after the patches) or through its own
``random.Random`` instance is not seen, and its states are judged as before.
"""

from __future__ import annotations

import hashlib
import numbers
import sys
from typing import Any, Optional

#: The generators whose seeding is taken, as the RankInfo fields they fill.
SEED_FIELD = {"python": "python_seed", "numpy": "numpy_seed"}


def seed_value(value: Any) -> Optional[int]:
    """A seed as an int to compare across ranks: an int as it is, another seed value (a string, bytes, an
    array) as a stable 63-bit digest of it, None for None (the generator then draws from OS entropy).

    >>> import numpy as np
    >>> seed_value(42), seed_value(np.uint32(42)), seed_value(None), seed_value("run-7") == seed_value("run-7") != seed_value("run-8")
    (42, 42, None, True)
    """
    if value is None:
        return None
    if isinstance(value, numbers.Integral):  # numpy's integer scalars too
        return int(value)
    try:
        import numpy as np

        raw = np.asarray(value).tobytes() if not isinstance(value, (str, bytes, bytearray, float)) else repr(value).encode()
    except (TypeError, ValueError):
        raw = repr(value).encode()
    return int.from_bytes(hashlib.blake2b(type(value).__name__.encode() + raw, digest_size=8).digest(), "big") >> 1


class SeedCalls:
    """The last seed each generator was given on this rank.

    >>> calls = SeedCalls()
    >>> calls.record("python", 3); calls.record("numpy", None); calls.record("python", 5)
    >>> calls.fields()
    {'python_seed': 5}
    """

    def __init__(self) -> None:
        self._seeds: dict[str, Optional[int]] = {}

    def record(self, generator: str, value: Any) -> None:
        self._seeds[generator] = seed_value(value)

    def fields(self) -> dict[str, int]:
        """The RankInfo fields of the generators seeded with a value (OS entropy: none)."""
        return {SEED_FIELD[g]: seed for g, seed in self._seeds.items() if seed is not None}


def seeding(generator: str, calls: Any) -> Any:
    """A patch maker for ``patches.wrap``: the seed function records its seed (``calls()`` gives the session's
    :class:`SeedCalls`), then seeds. healthcheck's own seeding is not the script's and is not recorded: the batch
    facts and the replay seed every generator alike and restore its state after
    (:func:`healthcheck.measure.replay.replay_rng`)."""

    def make(original: Any) -> Any:
        def seed(*args: Any, **kwargs: Any) -> Any:
            if not sys._getframe(1).f_globals.get("__name__", "").startswith("healthcheck."):
                calls().record(generator, args[0] if args else kwargs.get("a", kwargs.get("seed")))
            return original(*args, **kwargs)

        return seed

    return make
