"""Step-time overhead of WorkerConsistencyMonitor: the same DDP fine-tuning step with and without it.

For each (model, world size) one ``launch_local`` starts the CPU/gloo workers. Every worker
builds one model and wraps identical copies of it in separate DDP instances: a ``plain`` arm
with DDP's built-in all-reduce and one arm per monitor mode (``sketch``, ``exact``; every=1).
The arms take turns in blocks of ``--block`` steps, in an order shuffled every round (the same
order on every rank), and every arm of a round trains on the same micro-batches, so drift and
the neighbours' load on a shared machine hit all arms alike. An untimed barrier starts each
block: otherwise one arm's rank skew would be charged to whichever arm runs next. Blocks are 8
steps by default: an arm's asynchronous exchange finishes during the next step, so the last one of
a block runs during another arm's block and is charged to it. With blocks of 2 that was half of the
gathering arm's exchanges, which hid the gather's cost against ``sketch-carry`` (whose last rows ride
on the same arm's next block): on the harness the two measured alike with blocks of 2, and 0.00-0.02
apart in four runs with blocks of 8 (README, Measured figures).

Rank 0 times each full optimizer step with ``time.perf_counter``: forward+backward over the
grad-accum micro-steps (on CPU the all-reduce finishes inside backward), ``end_step``, gradient
clipping and ``optimizer.step``: the probe's own step functions in ``healthcheck.run.trainer``; fetching the
batch is left out of both arms (which makes the ratio slightly pessimistic). Columns:
``ratio`` = median(monitored) / median(plain) over the measured steps; ``ci90`` = 90% interval
of that ratio from a paired bootstrap over rounds; ``paired`` = median over rounds of the
per-round ratio of block means (each round's arms ran seconds apart, so it cancels slow drift);
``cpu_ratio`` = the same ratio of medians for the CPU time of a step summed over all ranks
(process time, so comm threads and kernel copies count, preemption does not): the quiet
measure of the work the monitor adds, which on an oversubscribed host is what it costs.

    python benchmarks/overhead.py --nproc 2 4 8 --models tiny-gpt2 small-gpt2 --modes sketch exact \\
        --steps 64 --warmup 3 --scaling-nproc 4 --scaling-steps 12

The first of ``--models`` runs at every ``--nproc``; the others run at ``--scaling-nproc``
(default: the largest ``--nproc``) with ``--scaling-steps`` steps, to show how the overhead
scales with model size.

``--modes hook-only`` adds an ablation arm: sketch mode's comm hook without the per-step exchange, which
splits the sketch arm's cost between the hook's arithmetic and the exchange. ``--modes sketch-carry``
adds another: sketch mode with ``exchange="carry"``, each step's rows riding on the next step's gradient
all-reduce instead of an all-gather of their own, to measure what that saves. ``--modes sketch-gather``: sketch
mode with ``exchange="gather"``, an all-gather a step, where the ``sketch`` arm (the default, ``"auto"``) writes
the rows to shared memory on one host. ``--modes python-hook`` is no monitor: DDP with torch's own Python
``allreduce_hook``, what any comm hook costs before it measures anything.

``--models harness-llama`` rebuilds the independent harness of issue 13: a 2-layer
``LlamaForCausalLM`` (hidden 128, vocab 512) on random micro-batches of 4 x 128 tokens::

    python benchmarks/overhead.py --nproc 8 --models harness-llama --modes sketch --steps 64
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import random
import statistics
import sys
import time
from typing import Any

PLAIN = "plain"
#: Not a probe preset: the independent harness's model and batches (see the module docstring).
HARNESS = "harness-llama"
HARNESS_BATCH, HARNESS_TOKENS, HARNESS_VOCAB = 4, 128, 512
MODES = ("sketch", "exact")
#: Not a monitor mode: sketch mode's comm hook without the per-step gather (an ablation; ``--modes hook-only``).
HOOK_ONLY = "hook-only"
#: Not a monitor mode either: sketch mode with ``exchange="carry"`` (``--modes sketch-carry``).
SKETCH_CARRY = "sketch-carry"
#: Nor this: sketch mode with ``exchange="gather"``, the all-gather even where every rank is on one host (the
#: default until 2026-11-27; ``--modes sketch-gather``).
SKETCH_GATHER = "sketch-gather"
#: Not a monitor at all: DDP with torch's own Python ``allreduce_hook`` (``--modes python-hook``), the floor under any
#: monitor that is a DDP comm hook (a Python call and a future callback per bucket, where plain DDP stays in C++).
PYTHON_HOOK = "python-hook"
ABLATIONS = (HOOK_ONLY, SKETCH_CARRY, SKETCH_GATHER, PYTHON_HOOK)
#: The ``exchange`` each ablation passes (the others take the monitor's default).
EXCHANGE_OF = {SKETCH_CARRY: "carry", SKETCH_GATHER: "gather"}
SKETCH_DIM = 4096
BOOTSTRAP_RESAMPLES = 2000
#: Distinct step batches the measured rounds cycle through.
BATCH_CYCLE = 8
PG_TIMEOUT_S = 600.0
COLUMNS = ("model", "world", "mode", "plain_ms", "monitored_ms", "ratio", "ci90", "paired", "cpu_ratio")
#: Targets (issue 13), median monitored/plain step time with every=1: the default probe's model and the
#: independent harness, both on 8 CPU ranks.
TARGETS = {("tiny-gpt2", 8): {"sketch": 1.03, "exact": 1.10}, (HARNESS, 8): {"sketch": 1.03}}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One launch: a model measured with and without the monitor in every requested mode."""

    model: str
    modes: tuple[str, ...]
    steps: int
    warmup: int
    block: int = 8
    sketch_dim: int = SKETCH_DIM
    reduction_every: int = 0
    every: int = 1
    order_seed: int = 0

    @property
    def rounds(self) -> int:
        return math.ceil(self.steps / self.block)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: medians in milliseconds and their ratios."""

    model: str
    world: int
    mode: str
    plain_ms: float
    monitored_ms: float
    ratio: float
    ci90: tuple[float, float]
    paired: float
    cpu_ratio: float


# --------------------------------------------------------------------------- worker side


class Arm:
    """One DDP copy of the model and its optimizer; ``step`` mirrors ``TrainLoop.step``."""

    def __init__(self, module, mode: str, setting: Setting, probe_config):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from healthcheck.measure.monitor import WorkerConsistencyMonitor

        self.train = probe_config.train
        self.ddp = DistributedDataParallel(
            module,
            bucket_cap_mb=probe_config.distributed.bucket_cap_mb,
            gradient_as_bucket_view=probe_config.distributed.gradient_as_bucket_view,
        )
        self.monitor = None
        if mode == PYTHON_HOOK:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif mode != PLAIN:
            # Passed only when asked for, so the script also runs against a monitor without the option.
            options = {"reduction_every": setting.reduction_every} if setting.reduction_every else {}
            monitor_class = _HookOnlyMonitor() if mode == HOOK_ONLY else WorkerConsistencyMonitor
            if mode in EXCHANGE_OF:
                options = {**options, "exchange": EXCHANGE_OF[mode]}
            self.monitor = monitor_class(
                self.ddp, direction="sketch" if mode in ABLATIONS else mode, sketch_dim=setting.sketch_dim,
                every=setting.every, seed=self.train.seed, **options,
            )
        # Constant learning rate: a scheduler is the same Python bookkeeping in every arm.
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay)

    def step(self, micro: list[dict[str, Any]], tokens: int) -> None:
        """The probe's own step (healthcheck.run.trainer), with the monitor's gather when monitored."""
        import torch

        from healthcheck.run.trainer import apply_update, backward_over_micro_batches

        started = time.perf_counter()
        local_loss, tokens = backward_over_micro_batches(
            self.ddp, micro, torch.device("cpu"), precision=self.train.precision, loss_scale=self.train.loss_scale
        )
        if self.monitor is not None:
            compute_ms = (time.perf_counter() - started) * 1000
            self.monitor.end_step(local_loss, tokens=tokens, extras={"compute_ms": compute_ms})
        apply_update(self.ddp, self.optimizer, max_grad_norm=self.train.max_grad_norm)

    def close(self) -> None:
        """Close the monitor and free DDP's reducer while the process group is still registered.

        A reducer that outlives ``destroy_process_group`` destroys the group itself when the worker's frame is torn
        down, joining gloo's threads while holding the GIL that one of them needs to release a finished all-gather: a
        hang of this script's smoke test, 1 run in 6-19 (py-spy: ``~ProcessGroupGloo`` in ``std::thread::join`` under
        ``Reducer`` dealloc, gloo's ``runLoop`` in ``gil_scoped_acquire``). The probe's worker frees its model the same
        way (``healthcheck/run/worker.py``).
        """
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = self.ddp = self.optimizer = None
        gc.collect()  # the monitor's comm hook and the model refer to each other


def _HookOnlyMonitor() -> Any:
    """The monitor with its comm hook (norms, sketch, the ‖ḡ‖² slice) but no per-step gather."""
    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    class HookOnly(WorkerConsistencyMonitor):
        def end_step(self, loss: Any, tokens: Any = None, extras: Any = None) -> None:
            self._step += 1
            self._clear_partials()
            return None

    return HookOnly


def probe_config_for(model: str):
    """The default probe with only the model swapped: synthetic data, micro_batch_size 4, no accumulation."""
    from healthcheck.config import ProbeConfig

    return ProbeConfig(model={"name": model})


def overhead_worker(setting: Setting) -> dict[str, dict[str, list[list[float]]]] | None:
    """Run the arms in interleaved blocks; rank 0 returns ``{"wall"|"cpu": {arm: [[ms per step] per round]}}``.

    ``wall`` is rank 0's wall clock; ``cpu`` is the process CPU time (comm threads and kernel
    included) summed over all ranks.
    """
    import torch

    from healthcheck.measure import distributed as hdist
    from healthcheck.run.data import MicroBatches, prepare_samples, shard_plan
    from healthcheck.run.modeling import build_model, load_tokenizer
    from healthcheck.run.trainer import response_tokens
    from healthcheck.run.worker import seed_everything

    info = hdist.init_distributed("cpu", "gloo", PG_TIMEOUT_S)
    try:
        hdist.set_worker_threads(info.local_world_size)
        config = probe_config_for("tiny-gpt2" if setting.model == HARNESS else setting.model)
        seed_everything(config.train.seed)
        names = (PLAIN, *setting.modes)
        if setting.model == HARNESS:
            base = harness_model()
            generator = torch.Generator().manual_seed(1000 + info.rank)

            def next_step_batches() -> tuple[list[dict[str, Any]], int]:
                micro = [harness_batch(generator) for _ in range(config.train.grad_accum_steps)]
                return micro, sum(response_tokens(batch) for batch in micro)
        else:
            tokenizer = load_tokenizer(config.model)
            samples = prepare_samples(config.data, tokenizer, cache_key=config.model.name)
            base = build_model(config.model, len(tokenizer), config.data.max_length)
            plan = shard_plan(config.data, config.train, info.rank, info.world_size)
            batches = MicroBatches(samples, plan, config.train, tokenizer.pad_token_id)

            def next_step_batches() -> tuple[list[dict[str, Any]], int]:
                micro = [batches.next() for _ in range(config.train.grad_accum_steps)]
                return micro, sum(response_tokens(batch) for batch in micro)
        arms = {name: Arm(copy.deepcopy(base), name, setting, config) for name in names}

        # Untimed: DDP rebuilds its buckets after the first step and the monitor builds its sketch bins.
        for _ in range(setting.warmup):
            step_batches = next_step_batches()
            for name in names:
                arms[name].step(*step_batches)
        # A fixed cycle of real batches, replayed: step time depends on the padded length, so every
        # arm sees the same lengths equally often and the per-step spread is the machine's noise.
        cycle = [next_step_batches() for _ in range(BATCH_CYCLE)]
        # Seeded alike on every rank: all ranks must enter the arms' collectives in the same order.
        order_rng = random.Random(setting.order_seed)
        wall_ms: dict[str, list[list[float]]] = {name: [] for name in names}
        cpu_ms: dict[str, list[list[float]]] = {name: [] for name in names}
        for round_index in range(setting.rounds):
            round_batches = [cycle[(round_index * setting.block + j) % BATCH_CYCLE] for j in range(setting.block)]
            order = list(names)
            order_rng.shuffle(order)
            for name in order:
                hdist.barrier()
                wall_block, cpu_block = [], []
                for step_batches in round_batches:
                    wall_start, cpu_start = time.perf_counter(), time.process_time()
                    arms[name].step(*step_batches)
                    cpu_block.append((time.process_time() - cpu_start) * 1000)
                    wall_block.append((time.perf_counter() - wall_start) * 1000)
                wall_ms[name].append(wall_block)
                cpu_ms[name].append(cpu_block)
        for arm in arms.values():
            arm.close()
        every_rank = hdist.all_gather_objects(cpu_ms)
        if info.rank != 0:
            return None
        # CPU time does not count the time a rank sat preempted or waiting, so it is the quiet
        # measure of the work the monitor adds; on an oversubscribed host that work is the cost.
        cpu_total = {
            name: [[sum(step) for step in zip(*(ranks[name][b] for ranks in every_rank), strict=True)] for b in range(setting.rounds)]
            for name in names
        }
        return {"wall": wall_ms, "cpu": cpu_total}
    finally:
        hdist.destroy_distributed()


def harness_model() -> Any:
    """The independent harness's model: LlamaForCausalLM, 2 layers, hidden 128, vocab 512 (random init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=HARNESS_VOCAB, max_position_embeddings=HARNESS_TOKENS, tie_word_embeddings=False,
    ))


def harness_batch(generator: Any) -> dict[str, Any]:
    """Random tokens, every position a target: 4 x 128, as the harness fed them."""
    import torch

    ids = torch.randint(0, HARNESS_VOCAB, (HARNESS_BATCH, HARNESS_TOKENS), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# --------------------------------------------------------------------------- launcher side


def measure(setting: Setting, nproc: int) -> list[Row]:
    """Launch ``nproc`` workers for one setting and compare each mode with the plain arm."""
    from healthcheck.run.probe import warm_parent_caches

    warm_parent_caches(probe_config_for("tiny-gpt2" if setting.model == HARNESS else setting.model))
    from healthcheck.run import launcher

    results = launcher.launch_local(overhead_worker, nproc, args=(setting,), run_id=f"overhead-{setting.model}-{nproc}")
    wall, cpu = results[0]["wall"], results[0]["cpu"]
    return [
        summarize(setting.model, nproc, mode, wall[PLAIN], wall[mode], cpu[PLAIN], cpu[mode]) for mode in setting.modes
    ]


def _flat(blocks: list[list[float]]) -> list[float]:
    return [value for block in blocks for value in block]


def summarize(
    model: str, world: int, mode: str, plain: list[list[float]], monitored: list[list[float]],
    plain_cpu: list[list[float]] | None = None, monitored_cpu: list[list[float]] | None = None, seed: int = 0,
) -> Row:
    """Medians of the step times, their ratio and its paired-bootstrap 90% interval, the median
    per-round ratio, and the ratio of the median CPU times.

    Each list holds one block of step times (ms) per round, rounds aligned; the CPU lists default
    to the wall-clock ones.

    >>> row = summarize("m", 2, "sketch", [[10.0, 12.0], [11.0, 30.0]], [[11.0, 13.0], [12.0, 12.0]])
    >>> round(row.ratio, 3), round(row.paired, 3)
    (1.043, 0.838)
    """
    plain_median, monitored_median = statistics.median(_flat(plain)), statistics.median(_flat(monitored))
    ratio, ci90, paired = paired_ratio(plain, monitored, seed=seed)
    cpu_ratio = statistics.median(_flat(monitored_cpu or monitored)) / statistics.median(_flat(plain_cpu or plain))
    return Row(model, world, mode, plain_median, monitored_median, ratio, ci90, paired, cpu_ratio)


def paired_ratio(
    plain: list[list[float]], monitored: list[list[float]], seed: int = 0, of: Any = statistics.median
) -> tuple[float, tuple[float, float], float]:
    """``of(monitored) / of(plain)`` over every step, its 90% interval from a bootstrap over rounds, and the median
    over rounds of the per-round ratio of block means. One block of step times per arm and round, rounds aligned.

    >>> ratio, ci90, paired = paired_ratio([[10.0, 10.0], [10.0, 10.0]], [[11.0, 11.0], [11.0, 11.0]])
    >>> round(ratio, 6), [round(x, 6) for x in ci90], round(paired, 6)
    (1.1, [1.1, 1.1], 1.1)
    """
    rng = random.Random(seed)
    rounds = range(len(plain))
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        # Resample whole rounds, keeping each round's blocks paired: drift is shared within a round.
        picked = rng.choices(rounds, k=len(plain))
        ratios.append(of(_flat([monitored[r] for r in picked])) / of(_flat([plain[r] for r in picked])))
    ratios.sort()
    ci90 = (ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1])
    paired = statistics.median(statistics.fmean(m) / statistics.fmean(p) for m, p in zip(monitored, plain, strict=True))
    return of(_flat(monitored)) / of(_flat(plain)), ci90, paired


def render_table(rows: list[Row]) -> str:
    """The table the script prints: one line per (model, world size, mode)."""
    header = (
        f"{'model':<11} {'world':>5} {'mode':<6} {'plain_ms':>9} {'monitored_ms':>12} {'ratio':>6} {'ci90':>11} "
        f"{'paired':>6} {'cpu_ratio':>9}"
    )
    lines = [header]
    for row in rows:
        ci90 = f"{row.ci90[0]:.3f}-{row.ci90[1]:.3f}"
        lines.append(
            f"{row.model:<11} {row.world:>5} {row.mode:<6} {row.plain_ms:>9.1f} {row.monitored_ms:>12.1f} "
            f"{row.ratio:>6.3f} {ci90:>11} {row.paired:>6.3f} {row.cpu_ratio:>9.3f}"
        )
    return "\n".join(lines)


def target_lines(rows: list[Row]) -> list[str]:
    """One line per mode measured in a target setting (see :data:`TARGETS`): met or missed."""
    lines = []
    for row in rows:
        target = TARGETS.get((row.model, row.world), {}).get(row.mode)
        if target is not None:
            verdict = "met" if row.ratio <= target else "MISSED"
            lines.append(f"target {row.mode} <= {target:.2f} on {row.model}, {row.world} ranks: {verdict} ({row.ratio:.3f})")
    return lines


def plan_matrix(models: list[str], nprocs: list[int], scaling_nproc: int | None) -> list[tuple[str, int]]:
    """The first model at every world size, the others at the scaling world size.

    >>> plan_matrix(["tiny-gpt2", "small-gpt2"], [2, 4, 8], None)
    [('tiny-gpt2', 2), ('tiny-gpt2', 4), ('tiny-gpt2', 8), ('small-gpt2', 8)]
    """
    scaling = scaling_nproc or max(nprocs)
    return [(models[0], n) for n in nprocs] + [(model, scaling) for model in models[1:]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8], help="world sizes for the first model")
    parser.add_argument("--models", nargs="+", default=["tiny-gpt2", "small-gpt2"], help="presets; the first is the default probe's")
    parser.add_argument("--modes", nargs="+", choices=(*MODES, *ABLATIONS), default=list(MODES),
                        help=f"monitor directions to measure ({HOOK_ONLY}: sketch mode's hook without the exchange; "
                             f"{SKETCH_CARRY}: sketch mode with exchange='carry'; {SKETCH_GATHER}: with exchange='gather'; "
                             f"{PYTHON_HOOK}: no monitor, torch's Python allreduce_hook)")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per arm (rounded up to whole blocks)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm before measuring")
    parser.add_argument("--block", type=int, default=Setting.block,
                        help="consecutive steps an arm runs before the next arm's turn (see the docstring for why 8)")
    parser.add_argument("--scaling-nproc", type=int, default=None, help="world size for the other models (default: largest --nproc)")
    parser.add_argument("--scaling-steps", type=int, default=None, help="measured steps per arm for the other models (default: --steps)")
    parser.add_argument("--reduction-every", type=int, default=0, help="monitor reduction_every (0: off, the monitor's default)")
    parser.add_argument("--every", type=int, default=1, help="monitor every: measure every k-th step (the targets are for 1)")
    args = parser.parse_args(argv)
    if min(args.nproc) < 2 or (args.scaling_nproc is not None and args.scaling_nproc < 2):
        parser.error("--nproc/--scaling-nproc: world sizes must be >= 2")
    if min(args.steps, args.block, args.scaling_steps or 1) < 1 or args.warmup < 0 or args.reduction_every < 0 or args.every < 1:
        parser.error("--steps, --scaling-steps, --block and --every must be >= 1; --warmup and --reduction-every >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows: list[Row] = []
    started = time.perf_counter()
    modes = tuple(dict.fromkeys(args.modes))
    for model, nproc in plan_matrix(args.models, args.nproc, args.scaling_nproc):
        steps = args.steps if model == args.models[0] else (args.scaling_steps or args.steps)
        setting = Setting(model=model, modes=modes, steps=steps, warmup=args.warmup, block=args.block,
                          reduction_every=args.reduction_every, every=args.every)
        launched = time.perf_counter()
        rows += measure(setting, nproc)
        print(f"# {model}, {nproc} ranks, {setting.rounds * setting.block} steps per arm: {time.perf_counter() - launched:.0f} s",
              file=sys.stderr, flush=True)
    print(render_table(rows))
    for line in target_lines(rows) if args.every == 1 else [f"# every={args.every}: the targets are for every=1"]:
        print(line)
    print(f"# blocks of {args.block} steps, {args.warmup} warmup steps per arm; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
