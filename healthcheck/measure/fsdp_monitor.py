"""The consistency monitor for FSDP2 (``fully_shard``): the DDP monitor's metrics from the reduce-scatter.

FSDP2 hands each parameter group's reduce-scatter comm this rank's unsharded local gradient of the group,
flat and zero-padded, viewed ``(W, S)`` (row r: what rank r will own). The monitor wraps every group's
comm (:mod:`healthcheck.measure.fsdp_internals`) and, on sampled steps, before passing the call through:

* ``direction="exact"``: an ``all_to_all`` in column chunks hands rank r every rank's slice of shard r,
  so it adds that shard's part of the W×W float64 Gram; one W×W all-reduce in ``end_step`` completes it.
  Norms, ⟨g_i, ḡ⟩ and ‖ḡ‖² are read off the Gram, so everything is exact. Extra traffic: one all-to-all,
  the reduce-scatter's volume. Memory: chunk temporaries, streamed per group (never a second copy of the
  unsharded gradient), except with ``reduce_scatter_every_microbatch`` (below).
* ``direction="sketch"``: the folded sketch of the local gradient (re-salted every step, so its errors
  do not repeat from step to step), its exact ‖g_i‖², and this rank's exact part of ‖ḡ‖² from its
  reduce-scattered shard. Pairwise cosines and the cosine to the mean are the sketch's estimates (std
  ≤ sqrt(2/p)): an exact ⟨g_i, ḡ⟩ needs a gradient-sized exchange, which is what exact mode is for.
  No extra gradient-sized traffic, no per-parameter memory.

Gradient accumulation. With ``set_requires_gradient_sync(False)`` on all but the last micro-batch (what
``healthcheck probe --set distributed.strategy=fsdp`` does) each group is reduce-scattered once per step,
with the accumulated local gradient. By default FSDP2 reduce-scatters every micro-batch instead; then
sketch mode adds the micro-batches' sketches (the sketch is linear) and reads norms, ⟨g_i, ḡ⟩ and ‖ḡ‖²
off the sketches, and exact mode needs ``reduce_scatter_every_microbatch=True``: it then keeps the
received slices of every micro-batch (one unsharded gradient's worth per rank: the cross terms between
micro-batches need them) and computes the Gram in ``end_step`` (a probe's ``metrics.exact_keep_microbatches``).
Without it, a second call raises.

The reduction check (``reduction_every``) compares each rank's reduce-scattered shard with the float64
mean of the slices the all-to-all brought (exact mode has them; sketch mode exchanges on check steps).

HSDP (a replicate x shard mesh). A reduce-scatter spans one shard group, and its output is that group's mean; the
replicas all-reduce it afterwards. Sketch mode gathers the step from every rank of the job, keeps the exact local
norms, and reads ‖ḡ‖²'s cross terms off the sketches (``from_gram="mean"``); exact mode is refused (the
cross-replica dot products would need a gradient-sized exchange). The reduction check covers each shard group's
reduce-scatter.

Step time. Every all-gather and reduce-scatter is timed, and the waits travel with the step's numbers:
``busy_ms`` is the ranks' median own work plus the time the others waited for this rank alone
(:mod:`healthcheck.measure.lateness`), the ``late_ms`` extra. On a CPU host, as under DDP, own work leaves
out the time the rank sat waiting for a core (``runq_ms``, :mod:`healthcheck.measure.runqueue`): on 8 ranks
sharing 2 cores that is about two thirds of a step. With it in the median, a 50 ms straggler read 1.045x (above
1.035x in 17 of 28 steps: missed) when one more busy process shared the host; without it, 1.24x (28 of 28 steps),
with or without that process. The other blocking collectives in a step (a script's ``torch.distributed`` calls,
which script mode routes through :meth:`FSDPConsistencyMonitor.waiting`, and ``end_step``'s exchange) add up to
one more wait column: a rank slow before a script's logging ``all_reduce`` is waited for there, not in FSDP2's
collectives, and without that column it passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Iterator, Optional

from healthcheck.errors import InvalidInput
from healthcheck.measure import distributed, free_memory, fsdp_internals, lateness
from healthcheck.measure.exact_pass import reduction_error
from healthcheck.measure.metrics import StepMetrics
from healthcheck.measure.monitor_core import ConsistencyMonitor, sum_partials
from healthcheck.measure.precision import sqnorm_fp32, unit_roundoff
from healthcheck.measure.step_gather import InFlight

#: Per-rank extras carrying each blocking collective's wait (ms), in call order; turned into blame on arrival.
WAIT_PREFIX = "wait_ms."


class FSDPConsistencyMonitor(ConsistencyMonitor):
    """Per-step worker consistency of an FSDP2 model; arguments as for ``WorkerConsistencyMonitor``.

    Args:
        model: The FSDP2 root module (``fully_shard`` applied to it and, usually, to its blocks).
        reduce_scatter_every_microbatch: Exact mode only: FSDP2 reduce-scatters every micro-batch of
            gradient accumulation (no ``set_requires_gradient_sync(False)``); see the module docstring.
        local_from: "auto" only: FSDP2's local gradient is read where it is reduce-scattered, and the probe's
            ``metrics.local_from`` (a DDP choice) reaches here unchanged.

    Raises:
        TypeError: ``model`` has no FSDP2 parameter group.
        ValueError: One rank (FSDP2 then never reduce-scatters), HSDP in exact mode or over part of the job, or groups
            over different ranks.
    """

    gradient_source = "reduce_scatter"

    def __init__(
        self,
        model: Any,
        *,
        direction: str = "sketch",
        sketch_dim: int = 4096,
        every: int = 1,
        seed: int = 0,
        exact_chunk_numel: int = 2**22,
        reduction_every: int = 0,
        process_group: Any = None,
        overlap: bool = True,
        exchange: str = "auto",
        reduce_scatter_every_microbatch: bool = False,
        local_from: str = "auto",
    ):
        if local_from != "auto":
            raise ValueError(f"local_from: FSDP2 reads each rank's gradient as it reduce-scatters it ('auto'), got {local_from!r}")
        if exchange not in ("auto", "gather"):
            # FSDP2 reduce-scatters: no rank receives the whole reduced buffer, so nothing could carry the rows.
            raise ValueError(f"exchange: FSDP2 gathers each step's numbers (exchange='auto' or 'gather'), got {exchange!r}")
        groups = list(fsdp_internals.param_groups(model))
        if not groups:
            raise TypeError("WorkerConsistencyMonitor: the FSDP2 module has no parameter group to monitor")
        reduce_groups = [fsdp_internals.reduce_scatter_group(param_group) for _, _, param_group in groups]
        ranks = {tuple(distributed.group_ranks(g)) for g in reduce_groups}
        if len(ranks) > 1:
            raise ValueError("WorkerConsistencyMonitor: FSDP2 parameter groups reduce-scatter over different ranks")
        self.replicas = _replicas(groups, direction, len(next(iter(ranks))))
        # HSDP: the step's numbers are gathered from every replica's ranks (the whole job), not the shard group's.
        group = process_group if process_group is not None else (None if self.replicas > 1 else reduce_groups[0])
        if distributed.world_size(group) < 2:
            raise ValueError("WorkerConsistencyMonitor: FSDP2 on one rank never reduce-scatters; there is nothing to compare")
        self._shard_world = distributed.world_size(reduce_groups[0])  #: the ranks one reduce-scatter spans
        super().__init__(
            direction=direction,
            sketch_dim=sketch_dim,
            every=every,
            seed=seed,
            exact_chunk_numel=exact_chunk_numel,
            reduction_every=reduction_every,
            overlap=overlap,
            group=group,
            dims=[d for p in model.parameters() for d in p.shape],
        )
        self.every_microbatch = bool(reduce_scatter_every_microbatch)
        if self.every_microbatch and direction == "exact":
            self._check_room(model, group)
        self._replay_local: Optional[Callable[[int, Any], None]] = None  #: set while a replay runs (:meth:`replaying`)
        self._groups = len(groups)
        self._calls: dict[int, int] = {}
        self._gram: dict[int, Any] = {}  # exact: this shard's W x W Gram part, per group
        self._slices: dict[int, Any] = {}  # exact + every micro-batch: every rank's slices of this shard
        self._reduction: dict[int, Any] = {}  # check steps: ‖reduced − mean‖², ‖mean‖², ‖mean |g|‖² per group
        self._roundoff = 0.0
        # The wait clock (measure/wait_clock.py) leaves every wait out of own work, as under DDP; blame needs each
        # wait's wall time too. ms this step spent inside each of FSDP2's blocking collectives, in order:
        self._waits: list[float] = []
        self._replica_waits: list[float] = []  #: HSDP: ms in each replica all-reduce this step, in order
        # ms in other blocking collectives this step (the script's torch.distributed calls, end_step's exchange):
        # one column, since a script need not run the same number of them each step.
        self._other_wait_ms = 0.0
        # A CPU host's run-queue clock (measure/runqueue.py); on a GPU the monitor reads none, as under DDP.
        first = next(iter(model.parameters()), None)
        self._on_host = first is not None and first.device.type == "cpu"
        comm_class, gather_class = fsdp_internals.comm_class(), fsdp_internals.timed_all_gather_class()
        self._comms = []
        self._gathers = []
        # HSDP's replica all-reduce blocks until the slowest replica arrives, like the collectives timed here.
        self._untime_all_reduce = fsdp_internals.time_replica_all_reduce(self._waiting_replicas) if self.replicas > 1 else None
        # Whom each collective's ranks waited for: its own group's ranks (rows of the gathered step are global ranks
        # under HSDP, and the shard group's under plain FSDP2, whose one group is then every row).
        shard_groups, replica_groups = fsdp_internals.mesh_groups(groups[0][2])
        self._blame_groups = {"": shard_groups if self.replicas > 1 else [list(range(self._world))], "r": replica_groups}
        for index, (module, state, param_group) in enumerate(groups):
            comm = comm_class(index, param_group, self._on_reduce_scatter)
            comm.inner = fsdp_internals.install(module, state, param_group, comm)
            self._comms.append(comm)
            gather = gather_class(param_group._all_gather_comm, self._waiting)
            fsdp_internals.install_all_gather(param_group, gather)
            self._gathers.append((param_group, gather))

    def _check_room(self, model: Any, group: Any) -> None:
        """Collective: refuse keeping every micro-batch's slices where a rank has no room for them (:mod:`.free_memory`)."""
        needed = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # a DTensor's numel: the unsharded one
        device = next(iter(model.parameters())).device
        short = free_memory.least_room(needed, distributed.all_gather_objects(free_memory.free_bytes(device), group))
        if short is not None:
            raise InvalidInput(
                f"metrics.exact_keep_microbatches (reduce_scatter_every_microbatch=True) keeps one unsharded fp32 gradient "
                f"per rank, {free_memory.gib(needed)} for this model, and rank {short[0]} has {free_memory.gib(short[1])} "
                "free: use metrics.direction=sketch, or call set_requires_gradient_sync(False) on all but the last micro-batch"
            )

    def waiting(self) -> ContextManager[None]:
        """As for the DDP monitor, but the time also counts toward blame (:meth:`_complete`): a rank that is slow
        before a script's logging ``all_reduce`` makes the others wait there, and under FSDP2 the step time is the
        median own work plus blame, so a wait that only left own work would hide it."""
        return self._wait_clock.span(on_wall=self._add_other_wait)

    def _waiting(self) -> ContextManager[None]:
        """Count the enclosed FSDP2 collective as waiting (see :meth:`_on_reduce_scatter`), on whichever thread
        runs it: its wall time gets a column of its own, in call order, and decides who arrived last (all ranks
        leave together); own work leaves it out less its run-queue time, which the step's own already holds."""
        return self._wait_clock.span(on_wall=self._add_wait, any_thread=True)

    def _waiting_replicas(self) -> ContextManager[None]:
        """As :meth:`_waiting`, for HSDP's all-reduce over a replica group (its own columns: other ranks meet there)."""
        return self._wait_clock.span(on_wall=lambda seconds: self._replica_waits.append(seconds * 1000), any_thread=True)

    def _add_wait(self, seconds: float) -> None:
        self._waits.append(seconds * 1000)

    def _add_other_wait(self, seconds: float) -> None:
        self._other_wait_ms += seconds * 1000

    def _launch(self, step: int, loss: Any, tokens: Any, extras: dict[str, Any]) -> InFlight:
        # Every rank ran the same collectives in the same order, so the names match across ranks.
        extras.update({f"{WAIT_PREFIX}{k:05d}": ms for k, ms in enumerate(self._waits)})
        extras.update({f"{WAIT_PREFIX}r{k:05d}": ms for k, ms in enumerate(self._replica_waits)})
        extras[f"{WAIT_PREFIX}other"] = self._other_wait_ms  # sorts after the numbered columns
        return super()._launch(step, loss, tokens, extras)

    def _complete(self, inflight: InFlight) -> StepMetrics:
        """The step's metrics, with each rank's blame for the others' waits (``late_ms``, see
        :mod:`healthcheck.measure.lateness`) and ``busy_ms`` as the median own work plus that blame."""
        metrics = super()._complete(inflight)
        extras = dict(metrics.per_rank_extras)
        names = sorted(name for name in extras if name.startswith(WAIT_PREFIX))
        if not names:
            return metrics
        # Each column is judged among the ranks its collective spans: FSDP2's own (a shard group), HSDP's all-reduce
        # (a replica group, "r" columns), and the script's and end_step's collectives ("other": every rank).
        spans = {**self._blame_groups, "other": [list(range(self._world))]}
        by_kind: dict[str, list[Any]] = {}
        for name in names:
            suffix = name[len(WAIT_PREFIX) :]
            by_kind.setdefault("other" if suffix == "other" else suffix.rstrip("0123456789"), []).append(extras.pop(name))
        rows = {kind: [list(row) for row in zip(*columns, strict=True)] for kind, columns in by_kind.items()}
        blame = [0.0] * self._world
        for kind, waits in rows.items():
            if kind == "r":  # HSDP: lateness at the replicas' all-reduce that waiting for the shard group explains is not
                part = lateness.replica_blame_ms(waits, spans["r"], rows.get("", [[]] * self._world))
            else:
                part = lateness.grouped_blame_ms(waits, spans[kind])
            blame = [a + b for a, b in zip(blame, part, strict=True)]
        extras["late_ms"] = blame
        busy = extras.get("busy_ms")
        if busy is not None and all(value == value for value in busy):  # NaN: a rank without a previous step
            extras["busy_ms"] = lateness.lockstep_busy_ms(busy, blame)
        return dataclasses.replace(metrics, per_rank_extras=extras)

    # ----------------------------------------------------------------------- the comm

    @contextlib.contextmanager
    def replaying(self, on_local: Callable[[int, Any], None]) -> Iterator[None]:
        """A replay's backward (:mod:`healthcheck.measure.sharded_replay`): each group's local gradient goes to
        ``on_local(group index, local)`` and on to FSDP2's reduce-scatter, measured by nothing; the waits timed
        meanwhile are dropped, so the next step's blame and busy time hold only training's collectives."""
        saved = len(self._waits), len(self._replica_waits), self._other_wait_ms
        self._replay_local = on_local
        try:
            yield
        finally:
            self._replay_local = None
            del self._waits[saved[0] :], self._replica_waits[saved[1] :]
            self._other_wait_ms = saved[2]

    def _on_reduce_scatter(self, comm: Any, output: Any, local: Any, group: Any, op: Any) -> Any:
        if self._replay_local is not None:
            self._replay_local(comm.index, local)
            return comm.inner(output_tensor=output, input_tensor=local, group=group, op=op)
        if not self._sampling():
            return comm.inner(output_tensor=output, input_tensor=local, group=group, op=op)
        import torch

        self._arrived = time.perf_counter()
        # What busy_ms leaves out (ConsistencyMonitor._waited_at_arrival). FSDP2's all-gathers and reduce-scatters
        # block every rank until the slowest arrives (gloo; on CUDA they are stream launches and cost ~0 here), so
        # a straggler's delay is spent waiting by the *others*, inside the step. Without these waits busy_ms would
        # be the same on every rank. What is left is only the ranks' typical own work: :meth:`_complete` adds who
        # was waited for.
        self._waited_at_arrival = self._wait_clock.total
        if self._on_host:
            self._read_host_clock()
        index, world = comm.index, self._shard_world
        calls = self._calls[index] = self._calls.get(index, 0) + 1
        if calls > 1 and self.direction == "exact" and not self.every_microbatch:
            # Invalid input, not a crash: the training loop and the mode do not fit, and either can change.
            raise InvalidInput(
                "exact mode (metrics.direction=exact) and an FSDP2 model that reduce-scatters every micro-batch of "
                "gradient accumulation: call set_requires_gradient_sync(False) on all but the last micro-batch, use "
                "metrics.direction=sketch, or keep every micro-batch's slices (one unsharded fp32 gradient per rank): "
                "--set metrics.exact_keep_microbatches=true (monitor API: reduce_scatter_every_microbatch=True)"
            )
        pre, sum_scale = fsdp_internals.true_gradient_scale(comm.param_group, group, local, op)
        checking = self._checking_reduction()
        if self.direction == "exact" or checking:
            with self._waiting():
                mean64 = self._exchange(index, local.view(world, -1), pre, group, checking)
        with self._waiting():
            comm.inner(output_tensor=output, input_tensor=local, group=group, op=op)  # the real reduce-scatter
        keep = fsdp_internals.keep_for_default_stream
        self._sqnorm[index] = keep(sqnorm_fp32(local) * (pre * pre))
        # Under HSDP this shard's mean is its shard group's, not the job's: ‖ḡ‖² comes from the sketches instead.
        mean_shard = output.to(torch.float32) * (sum_scale / world) if self.replicas == 1 else None  # ḡ on this shard
        self._mean_sqnorm[index] = keep(sqnorm_fp32(mean_shard)) if mean_shard is not None else 0.0
        if self.direction == "sketch":
            assert self._sketcher is not None
            # Re-salted per step: the estimates' errors are independent from step to step.
            sketch = self._sketcher(index + self._groups * self._step, local) * pre
            self._sketch[index] = keep(sketch if calls == 1 else self._sketch[index] + sketch)
        if checking:
            diff = output.to(torch.float64) * (sum_scale / world) - mean64[0]
            sums = torch.stack([diff @ diff, mean64[0] @ mean64[0], mean64[1] @ mean64[1]])
            previous = self._reduction.get(index)
            self._reduction[index] = keep(sums if previous is None else previous + sums)
            self._roundoff = max(self._roundoff, unit_roundoff(local.dtype))
        return None

    def _exchange(self, index: int, rows: Any, pre: float, group: Any, checking: bool) -> Any:
        """All-to-all in column chunks: this rank receives every rank's slice of its own shard. Adds this
        shard's part of the Gram (or keeps the slices), and returns ``[mean, mean |g|]`` of the shard in
        float64 when ``checking`` (else None)."""
        import torch

        world, width = rows.shape
        exact = self.direction == "exact"
        keep = fsdp_internals.keep_for_default_stream
        if exact and self.every_microbatch and index not in self._slices:
            self._slices[index] = keep(torch.zeros(world, width, dtype=torch.float32, device=rows.device))
        if exact and not self.every_microbatch and index not in self._gram:
            self._gram[index] = keep(torch.zeros(world, world, dtype=torch.float64, device=rows.device))
        means = torch.zeros(2, width, dtype=torch.float64, device=rows.device) if checking else None
        step = max(1, self.exact_chunk_numel // world)
        for first in range(0, width, step):
            last = min(width, first + step)
            send = rows[:, first:last].contiguous()  # row r goes to rank r
            received = torch.empty_like(send)
            distributed.all_to_all_single(received, send, group)  # received[j] = g_j on my shard / pre
            block = received.to(torch.float64) * pre
            if exact and self.every_microbatch:
                self._slices[index][:, first:last] += block.to(torch.float32)
            elif exact:
                self._gram[index].addmm_(block, block.T)
            if means is not None:
                means[0, first:last] = block.sum(0) / world
                means[1, first:last] = block.abs().sum(0) / world
        return means

    # ----------------------------------------------------------------------- the step

    def _multi_call(self) -> bool:
        return any(calls > 1 for calls in self._calls.values())

    def _sketch_gram_use(self) -> str:
        # One reduce-scatter per group: exact norms, the cosine to the mean from the sketch. Several (per
        # micro-batch): only the sketches describe the accumulated gradient, so everything comes from them.
        # HSDP: each rank's shard mean is its shard group's, so ‖ḡ‖² is read off the sketches too (exact norms kept).
        return "all" if self._multi_call() else ("mean" if self.replicas > 1 else "cosine")

    def _exact_pieces(self, step: int, loss: Any, tokens: Any, extras: dict[str, Any], indices: list[int], checking: bool) -> InFlight:
        import torch

        sqnorm = sum_partials(self._sqnorm, indices)
        gram = torch.zeros(self._world, self._world, dtype=torch.float64, device=sqnorm.device)
        for index in indices:
            if self.every_microbatch:
                slices = self._slices[index]
                step_width = max(1, self.exact_chunk_numel // self._world)
                for first in range(0, slices.shape[1], step_width):
                    block = slices[:, first : first + step_width].to(torch.float64)
                    gram.addmm_(block, block.T)
            else:
                gram += self._gram[index]
        distributed.all_reduce_async(gram, self._group).wait()  # every shard's part: the whole Gram everywhere
        if checking:
            extras.update(self._reduction_extras(indices))
        zero = torch.zeros((), dtype=torch.float64, device=sqnorm.device)
        return self._gather(step, indices, loss=loss, tokens=tokens, sqnorm=sqnorm, dot=zero, mean_sqnorm=zero, extras=extras, gram=gram)

    def _reduction_extras(self, indices: list[int]) -> dict[str, float]:
        import torch

        sums = torch.stack([self._reduction[index] for index in indices]).sum(0)
        return reduction_error(sums.cpu().tolist(), self._shard_world, self._roundoff)

    def _clear_partials(self) -> None:
        super()._clear_partials()
        for partials in (self._calls, self._gram, self._slices, self._reduction):
            partials.clear()
        self._waited_at_arrival = self._other_wait_ms = 0.0
        self._waits, self._replica_waits = [], []

    def close(self) -> None:
        """Stop measuring and give every parameter group its own reduce-scatter back."""
        super().close()
        for comm in self._comms:
            fsdp_internals.restore(comm.param_group, comm.inner)
        for param_group, gather in self._gathers:
            fsdp_internals.restore_all_gather(param_group, gather.inner)
        self._comms, self._gathers = [], []
        if self._untime_all_reduce is not None:
            self._untime_all_reduce()
            self._untime_all_reduce = None


def _replicas(groups: list[Any], direction: str, shard_ranks: int) -> int:
    """HSDP's replica count (1 for a one-dimensional mesh); raises ValueError where it cannot be monitored."""
    replicate = {tuple(distributed.group_ranks(g)) if g is not None else () for g in
                 (fsdp_internals.replicate_group(param_group) for _, _, param_group in groups)}
    if replicate == {()}:
        return 1
    if len(replicate) > 1:
        raise ValueError("WorkerConsistencyMonitor: FSDP2 parameter groups all-reduce over different replicas (HSDP)")
    replicas = len(next(iter(replicate)))
    if direction == "exact":
        raise ValueError(
            "WorkerConsistencyMonitor: HSDP (a replicate x shard mesh) and exact mode: a rank's reduce-scatter sees only "
            "its shard group's gradients, so the cross-replica dot products would need a gradient-sized exchange; use "
            "metrics.direction=sketch"
        )
    if replicas * shard_ranks != distributed.world_size():
        raise ValueError(f"WorkerConsistencyMonitor: HSDP over {replicas} x {shard_ranks} ranks of a job of "
                         f"{distributed.world_size()}: a probe measures the whole job's data parallelism")
    return replicas
