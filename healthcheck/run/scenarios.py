"""The fault-injection catalogue: named faults built only from ``--set`` overrides of the default probe.

    healthcheck scenarios list
    healthcheck scenarios run lr-x10 s1-2 --seeds 3     # exit 1 when any run was not caught

A :class:`Scenario` is a handful of config overrides (a seed policy, a data setting, or one rank's
``rank_overrides``), never a special case inside the metrics code, plus the checks expected to fire
and the rank(s) they must name. :func:`run_named` runs each against the default probe's baseline
and prints one line per run. Scenario seeds start at :data:`FIRST_SEED`, away from the seeds a
baseline is recorded with (42, 43, ...), so a clean run is judged out of sample.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path
from typing import Callable, Optional, Sequence

from healthcheck.config import ProbeConfig, load_config
from healthcheck.errors import ExitCode, InvalidInput

#: First train.seed of scenario runs (baselines are recorded from seed 42 upwards).
FIRST_SEED = 1000


#: The bitflip scenario's step: past the metrics warm-up, and off the every-10 parameter and reduction checks.
BITFLIP_STEP = 25

#: In a scenario's sets and ``expected_ranks``: the rank :func:`seeded_rank` picks from the run's seed.
SEEDED_RANK = "{rank}"


def _on_faulty_rank(section: str, body: str) -> str:
    """The ``--set`` that gives the seeded rank (:func:`seeded_rank`) the config ``{section: {body}}``."""
    return f"rank_overrides={{{SEEDED_RANK}: {{{section}: {{{body}}}}}}}"


def seeded_rank(seed: int, world_size: int) -> int:
    """The faulted rank of a seeded scenario: any rank but 0, spread over the seeds (a hash, not ``seed % n``).

    Every one-rank fault of the catalogue hits a different rank on each seed, so a detection row shows
    that the guard names whichever rank it is: the catalogue used to fault a fixed rank 3, which a check
    could have learned. Rank 0 is left out so that naming it can never be a rank-0 accident (S1-2 is the
    paper's own rank-0 setting and keeps it).

    >>> sorted({seeded_rank(seed, 8) for seed in range(1000, 1020)})
    [1, 2, 3, 4, 5, 6, 7]
    """
    z = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    z = ((z ^ (z >> 31)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    return 1 + (z ^ (z >> 29)) % (world_size - 1) if world_size > 1 else 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One named fault.

    Attributes:
        name: Catalogue name (``healthcheck scenarios run NAME``).
        description: What goes wrong, in one line.
        sets: ``--set`` expressions applied on top of the default probe.
        expected_checks: Finding ids (fnmatch patterns, e.g. ``envelope.*``) any of which catches it.
        expected_ranks: ``"0"`` (a fixed rank), ``"all"`` (every rank is named), ``"{rank}"`` (the seeded rank,
            see :func:`seeded_rank`; ``sets`` then say ``{rank}`` where the rank goes), or ``""`` (nothing may fire).
        fsdp_checks: The expected checks under ``distributed.strategy=fsdp`` when sharding changes which
            audit sees the fault (None: the same as ``expected_checks``).
        fsdp_not_applicable: Why the fault cannot exist under FSDP2 ("" when it can).
    """

    name: str
    description: str
    sets: tuple[str, ...]
    expected_checks: tuple[str, ...]
    expected_ranks: str
    fsdp_checks: Optional[tuple[str, ...]] = None
    fsdp_not_applicable: str = ""

    def under(self, strategy: str) -> Scenario:
        """This scenario as judged under ``strategy`` (its FSDP2 expectations when ``fsdp``)."""
        if strategy != "fsdp" or self.fsdp_checks is None:
            return self
        return dataclasses.replace(self, expected_checks=self.fsdp_checks)

    def expected_rank_set(self, world_size: int, seed: int = FIRST_SEED) -> set[int]:
        if self.expected_ranks == "all":
            return set(range(world_size))
        if self.expected_ranks == SEEDED_RANK:
            return {seeded_rank(seed, world_size)}
        return {int(r) for r in self.expected_ranks.split(",") if r}

    def config(self, seed: int, base_sets: Sequence[str] = ()) -> ProbeConfig:
        """The default probe with ``base_sets``, this scenario's overrides and ``train.seed``."""
        sets = list(self.sets)
        if any(SEEDED_RANK in s for s in sets):
            rank = seeded_rank(seed, load_config(None, list(base_sets)).distributed.nproc)
            sets = [s.replace(SEEDED_RANK, str(rank)) for s in sets]
        return load_config(None, [*base_sets, *sets, f"train.seed={seed}"])


CLEAN = Scenario("clean", "no fault: nothing may fire (the false-alarm row)", (), (), "")

CATALOGUE: tuple[Scenario, ...] = (
    Scenario(
        "s1-2",
        "rank 0 seeds itself differently (seed_policy rank0_differs: seed+999)",
        ("seed_policy=rank0_differs",),
        ("audit.seeds", "audit.data_shards"),
        "0",
    ),
    Scenario("s1-3", "every rank has its own seed (seed_policy per_rank: seed+rank)", ("seed_policy=per_rank",), ("audit.seeds",), "all"),
    Scenario(
        "identical-data",
        "every rank reads the same samples (data.sharding replicated)",
        ("data.sharding=replicated",),
        ("audit.data_shards",),
        "all",
    ),
    Scenario(
        "missing-set-epoch",
        "sampler.set_epoch never called: every epoch repeats epoch 0 (256 samples, so the probe crosses epochs)",
        ("train.set_epoch=false", "data.max_samples=256"),
        ("audit.data_shards",),
        "all",
    ),
    Scenario(
        "loss-x2",
        "one rank multiplies its loss by 2 (a gradient-accumulation normalisation bug)",
        (_on_faulty_rank("train", "loss_scale: 2.0"),),
        ("envelope.*", "audit.rank_outliers"),
        SEEDED_RANK,
    ),
    Scenario(
        "fp32-vs-bf16",
        "one rank trains in bf16 autocast, the others in fp32",
        (_on_faulty_rank("train", "precision: bf16"),),
        ("audit.environment",),
        SEEDED_RANK,
    ),
    Scenario(
        "lr-x10",
        "one rank uses 10x the learning rate (1e-2 instead of 1e-3)",
        (_on_faulty_rank("train", "lr: 0.01"),),
        ("audit.param_equality",),
        SEEDED_RANK,
        # Under FSDP2 no rank holds a replica that could drift: each updates only its own shard, and the
        # gathered full parameters are the same on every rank. What is left of the fault is a rank whose
        # optimizer disagrees, which the sharded-state audit compares at every check step.
        fsdp_checks=("audit.sharded_state",),
    ),
    Scenario(
        "label-mask-bug",
        "one rank trains on prompt tokens too (data.response_only_loss false)",
        (_on_faulty_rank("data", "response_only_loss: false"),),
        ("envelope.*", "audit.rank_outliers"),
        SEEDED_RANK,
    ),
    Scenario(
        "grad-noise",
        "one rank's local gradient gets Gaussian noise of 2x its RMS (silent corruption)",
        (_on_faulty_rank("faults", "grad_noise_std: 2.0"),),
        ("envelope.*", "audit.rank_outliers"),
        SEEDED_RANK,
        fsdp_not_applicable=(
            "the fault is injected by per-parameter gradient hooks, and under FSDP2 those do not see a rank's "
            "local gradient (it is reduce-scattered from FSDP's own flat buffers)"
        ),
    ),
    Scenario(
        "straggler",
        "one rank sleeps 50 ms in every step",
        (_on_faulty_rank("faults", "step_sleep_ms: 50"),),
        ("audit.stragglers",),
        SEEDED_RANK,
    ),
    Scenario(
        "bad-device",
        "one rank's matmul outputs are off by 1e-3 relative from step 10 (a device that computes slightly wrong)",
        (_on_faulty_rank("faults", "matmul_error: 0.001, matmul_error_from_step: 10"),),
        ("audit.replay",),
        SEEDED_RANK,
    ),
    Scenario(
        "bitflip",
        f"one rank flips exponent bit 28 of the loss it backpropagates at step {BITFLIP_STEP} "
        "(x2^32 for that step's loss and local gradient)",
        (_on_faulty_rank("faults", f"bitflip_at_step: {BITFLIP_STEP}"),),
        ("audit.spikes",),
        SEEDED_RANK,
        # The flip is in the loss, not in one gradient element (faults.flip_float32_bit says why), so it needs
        # no gradient hook and exists under FSDP2 too, where the monitor reads the same local loss and norm.
    ),
    Scenario(
        "nan",
        "one rank's loss turns NaN at step 15",
        (_on_faulty_rank("faults", "nan_at_step: 15"),),
        ("audit.nonfinite",),
        SEEDED_RANK,
    ),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (*CATALOGUE, CLEAN)}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one scenario run did: which checks fired, which ranks they named, and whether that was right."""

    scenario: str
    seed: int
    exit_code: int
    status: str
    fired: tuple[str, ...]
    named: tuple[int, ...]
    detected: bool  #: an expected check fired (for clean: nothing fired)
    right_rank: bool  #: the expected checks that fired named every expected rank
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.detected and self.right_rank

    def line(self) -> str:
        fired = ", ".join(self.fired) or "-"
        named = ",".join(map(str, self.named)) or "-"
        if self.scenario == CLEAN.name:
            verdict = "clean, nothing fired" if self.ok else "FALSE ALARM"
        else:
            verdict = "detected" + (", right rank" if self.right_rank else ", WRONG RANK") if self.detected else "NOT DETECTED"
        return f"{self.scenario:<18} seed {self.seed:<5} exit {self.exit_code}  fired: {fired}  ranks: {named}  -> {verdict}"


def assess(
    scenario: Scenario,
    failed: Sequence[tuple[str, Sequence[int]]],
    world_size: int,
    *,
    seed: int,
    exit_code: int,
    status: str = "complete",
    run_dir: str = "",
) -> Outcome:
    """Judge one run: ``failed`` lists ``(check id, ranks named)`` for every failed finding.

    >>> lr = SCENARIOS["lr-x10"]  # seed 1 faults rank 7 (seeded_rank(1, 8))
    >>> assess(lr, [("audit.param_equality", [7]), ("envelope.loss_std", [5])], 8, seed=1, exit_code=1).ok
    True
    >>> assess(lr, [("audit.param_equality", [5])], 8, seed=1, exit_code=1).right_rank
    False
    """
    fired = tuple(sorted({check for check, _ in failed}))
    expected = [(c, r) for c, r in failed if any(fnmatch.fnmatchcase(c, p) for p in scenario.expected_checks)]
    named = tuple(sorted({rank for _, ranks in expected for rank in ranks}))
    if scenario.name == CLEAN.name or not scenario.expected_checks:
        detected = right = status == "complete" and not fired
    else:
        detected = status == "complete" and bool(expected)
        right = detected and scenario.expected_rank_set(world_size, seed) <= set(named)
    return Outcome(scenario.name, seed, exit_code, status, fired, named, detected, right, run_dir)


def run_scenario(scenario: Scenario, seed: int, baseline, *, baseline_path: str, runs_root: Path, base_sets: Sequence[str] = ()) -> Outcome:
    """Run one probe with the scenario's faults, judge it against ``baseline`` and write its verdict."""
    from healthcheck.artifacts import default_run_dir
    from healthcheck.judge.verdict import judge, write_verdict
    from healthcheck.run.probe import run_probe

    config = scenario.config(seed, base_sets)
    run_dir = default_run_dir(f"scenario-{scenario.name}-seed{seed}", runs_root)
    result, run_dir = run_probe(config, run_dir)
    assert result is not None  # run_named is never used under an external launcher
    world = config.distributed.nproc
    if result.status != "complete":
        return assess(scenario, [], world, seed=seed, exit_code=int(ExitCode.PROBE_FAILED), status=result.status, run_dir=str(run_dir))
    verdict = judge(result, baseline, baseline_path=baseline_path)
    write_verdict(run_dir, verdict)
    failed = [(f.check, f.ranks) for f in verdict.failures]
    return assess(scenario, failed, world, seed=seed, exit_code=verdict.exit_code, run_dir=str(run_dir))


def resolve(names: Sequence[str]) -> list[Scenario]:
    """Scenarios by name (``all``: the whole catalogue), or a one-line error listing the known names."""
    out: list[Scenario] = []
    for name in names:
        if name == "all":
            out.extend(CATALOGUE)
        elif name in SCENARIOS:
            out.append(SCENARIOS[name])
        else:
            known = ", ".join(SCENARIOS)
            raise InvalidInput(f"scenarios run: unknown scenario {name!r} (known: {known}, or all)")
    return out


def for_strategy(chosen: Sequence[Scenario], strategy: str) -> tuple[list[Scenario], list[str]]:
    """The scenarios that can exist under ``strategy``, with its expectations, and one line per skipped one.

    >>> applicable, skipped = for_strategy([SCENARIOS["lr-x10"], SCENARIOS["grad-noise"]], "fsdp")
    >>> [(s.name, s.expected_checks) for s in applicable]
    [('lr-x10', ('audit.sharded_state',))]
    >>> skipped[0].split(":")[0]
    'grad-noise         not applicable under fsdp'
    """
    applicable, skipped = [], []
    for scenario in chosen:
        if strategy == "fsdp" and scenario.fsdp_not_applicable:
            skipped.append(f"{scenario.name:<18} not applicable under fsdp: {scenario.fsdp_not_applicable}")
        else:
            applicable.append(scenario.under(strategy))
    return applicable, skipped


def run_named(
    names: Sequence[str],
    *,
    seeds: int = 1,
    baseline: Optional[Path] = None,
    runs_root: Path = Path("runs"),
    base_sets: Sequence[str] = (),
    first_seed: int = FIRST_SEED,
    emit: Callable[[str], None] = print,
) -> int:
    """Run each named scenario over ``seeds`` seeds against the baseline; 1 if any run was missed, else 0.

    A run counts as caught when an expected check fired and named the expected rank(s); ``clean``
    counts when nothing fired. Raises :class:`InvalidInput` (exit 2) for an unknown name, a bad
    ``--seeds`` or a missing baseline, before any probe starts.
    """
    from healthcheck.judge.baseline import load_baseline

    if seeds < 1:
        raise InvalidInput(f"--seeds: expected at least 1, got {seeds}")
    chosen = resolve(names)
    # The base sets pick the probe the faults are injected into, and with it the default baseline
    # (baselines/default-fsdp.json under distributed.strategy=fsdp).
    base = load_config(None, list(base_sets))
    strategy = base.distributed.strategy
    path = Path(baseline) if baseline is not None else base.baseline_path()
    loaded = load_baseline(path)
    outcomes = []
    applicable, skipped = for_strategy(chosen, strategy)
    for line in skipped:
        emit(line)
    for scenario in applicable:
        for seed in range(first_seed, first_seed + seeds):
            outcome = run_scenario(scenario, seed, loaded, baseline_path=str(path), runs_root=runs_root, base_sets=base_sets)
            emit(outcome.line())
            outcomes.append(outcome)
    missed = [o for o in outcomes if not o.ok]
    emit(
        f"{len(outcomes) - len(missed)}/{len(outcomes)} runs caught as expected"
        + (f"; missed: {', '.join(f'{o.scenario} (seed {o.seed})' for o in missed)}" if missed else "")
    )
    return int(ExitCode.INCONSISTENT) if missed else int(ExitCode.PASS)


def catalogue_text() -> str:
    """The ``scenarios list`` table: name, expected checks and ranks, the overrides, what goes wrong."""
    rows = [("name", "expected check", "rank", "overrides (--set)", "fault")]
    for s in CATALOGUE:
        rows.append((s.name, " or ".join(s.expected_checks), s.expected_ranks, "  ".join(s.sets), s.description))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4] for row in rows]
    fsdp = [f"  {s.name}: expects {' or '.join(s.fsdp_checks)}" for s in CATALOGUE if s.fsdp_checks] + [
        f"  {s.name}: not applicable ({s.fsdp_not_applicable})" for s in CATALOGUE if s.fsdp_not_applicable
    ]
    if fsdp:
        lines.append("\nUnder --set distributed.strategy=fsdp:\n" + "\n".join(fsdp))
    lines.append(
        f"\nRun: healthcheck scenarios run NAME... [--seeds R]   (seeds {FIRST_SEED}, {FIRST_SEED + 1}, ...; "
        f"'clean' runs the unfaulted probe; 'all' runs the catalogue)"
    )
    return "\n".join(lines)


def print_catalogue() -> None:
    print(catalogue_text())
