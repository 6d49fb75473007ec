"""Per-step worker-consistency measurement inside DDP's gradient all-reduce.

:class:`WorkerConsistencyMonitor` registers a DDP communication hook. For every gradient
bucket, before the all-reduce, the hook still sees this rank's own (undivided, accumulated over
``no_sync`` micro-steps) gradient, so it records on the device, without a host sync:

* the fp32 squared norm ‖g_i‖² of the bucket;
* in ``direction="sketch"`` a folded count sketch of the bucket (k floats), read with ‖g_i‖² and the division
  in one pass (:mod:`.host_pass`, :mod:`.sketch_kernel`); in ``"exact"`` a copy of it;
* then it divides the bucket by the world size in place and all-reduces it, as DDP's own hook does, and
  after the all-reduce, in a ``.then()`` callback, takes this rank's 1/N slice of ‖ḡ‖² off the reduced mean.

On CUDA, sketch mode has no comm hook where it can (``local_from``): it reads ``.grad`` once a step, before DDP's
finalize (:mod:`.local_grads`). The cosine to the mean is read off the sketches in sketch mode (as under FSDP2) and
off the Gram in exact mode; the norms, ‖ḡ‖² and the losses are exact in both.

``end_step`` then packs everything into one vector per rank and does ONE ``all_gather_rows`` per sampled
step (exact mode adds the chunked gather of the local gradients for the N×N Gram in float64). With every rank
on one host's CPU, the default ``exchange="auto"`` writes the rows to shared memory instead
(:mod:`.shared_rows`: no collective), in exact mode with the whole local gradient (:mod:`.exact_rows`: the file
holds 2 × N × P fp32 values, P <= ``exact_chunk_numel`` parameters). With ``exchange="carry"`` (sketch mode,
``overlap``) each rank's vector rides in its own slot of a block appended to the next step's last gradient bucket,
whose SUM all-reduce hands every rank all the rows (:meth:`WorkerConsistencyMonitor._carry`; the last step's goes
in ``flush``). The rows become Python floats once, for :func:`healthcheck.measure.metrics.compute_step_metrics`.

The sketch is :class:`healthcheck.measure.sketch.FoldedSketch` (std of |Δcos| <= sqrt(2/p), p its prime width, e.g.
4093 for sketch_dim 4096); the exact Gram and the reduction check are one chunked pass,
:func:`healthcheck.measure.exact_pass.stream_local_gradients`. With ``reduction_every=k`` (a multiple of ``every``)
every k-th step also keeps each bucket's local gradient and its all-reduced result for that pass, and adds two
per-rank extras to the step: ``reduction_rel_error`` and ``reduction_bound_ratio``.

Memory: sketch mode keeps no per-parameter state and no copy of the gradient (a 256 KB sign table whatever the
model; with ``exchange="carry"``, the last bucket and the carried block in one more buffer). Exact mode holds a copy
of the local gradient (a host's kept between steps) plus N × ``exact_chunk_numel`` elements per gather, or the file.

Given an FSDP2 root (``fully_shard``) the class returns a :class:`~.fsdp_monitor.FSDPConsistencyMonitor`: the same
arguments (``local_from`` "auto" only), ``end_step`` contract and :class:`~healthcheck.measure.metrics.StepMetrics`.

Usage (every rank runs the same code): ``monitor = WorkerConsistencyMonitor(ddp_model)``, then after each backward
``metrics = monitor.end_step(loss, tokens=n_response_tokens)`` (a collective, before ``optimizer.step()``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from healthcheck.measure import distributed, exact_rows, host_pass, local_grads, runqueue, step_gather
from healthcheck.measure.bucket_plans import BucketPlans
from healthcheck.measure.eager import eager
from healthcheck.measure.exact_pass import stream_local_gradients
from healthcheck.measure.monitor_core import DIRECTIONS, ConsistencyMonitor, sum_partials
from healthcheck.measure.precision import sqnorm_fp32
from healthcheck.measure.reduced_norm import DeferredSquares, after_ddp_finalize, rank_slice
from healthcheck.measure.step_gather import InFlight
from healthcheck.measure.wait_clock import counted_as_waiting

__all__ = ["DIRECTIONS", "EXCHANGES", "WorkerConsistencyMonitor"]

#: How a step's numbers reach the other ranks (``WorkerConsistencyMonitor(exchange=...)``).
EXCHANGES = ("auto", "gather", "carry")


class WorkerConsistencyMonitor(ConsistencyMonitor):
    """Measures how consistent the data-parallel workers' gradients and losses are, per step.

    Args:
        model: A ``torch.nn.parallel.DistributedDataParallel`` model (its comm hook is taken), or an
            FSDP2 root module (see the module docstring).
        direction: "sketch" (folded count-sketch pairwise cosines, ~k floats per rank per step) or
            "exact" (float64 Gram from the full local gradients, gathered in chunks).
        sketch_dim: k, the requested sketch width (a prime <= k is used); |Δcos| std <= sqrt(2/k).
        every: Measure every k-th step. ``end_step`` must still be called on every step; on the
            others the hook does only the plain averaging all-reduce and ``end_step`` returns None.
        seed: Sketch seed; must be the same on every rank.
        exact_chunk_numel: Elements per all-gather when ``direction="exact"`` (and for reduction checks).
        reduction_every: Check the reduction numerics every k-th step (0: never); a multiple of ``every``.
        process_group: Group to reduce and gather over; defaults to the model's.
        overlap: Gather each step's numbers asynchronously and read them one step later (see
            :meth:`end_step` and :mod:`healthcheck.measure.step_gather`); False: at once.
        exchange: How a step's numbers reach the other ranks: "auto" (shared memory where every rank's tensors
            are on this host's CPU, :mod:`.shared_rows`, in exact mode with the local gradients, :mod:`.exact_rows`;
            else as "gather"), "gather" (an all-gather of their own; exact mode's chunked gather) or "carry"
            (sketch mode with ``overlap``: inside the next step's last gradient all-reduce; a rank that fails
            before it takes the step's numbers with it; see :meth:`_carry`).
        local_from: DDP's sketch mode reads the local gradient from "buckets" (the comm hook) or "grads" (``.grad``
            once a step, no comm hook: :mod:`.local_grads`); "auto": "grads" where every rank can (CUDA), else "buckets".
        **fsdp_options: FSDP2 only (:class:`~healthcheck.measure.fsdp_monitor.FSDPConsistencyMonitor`).

    Raises:
        TypeError: ``model`` is neither DistributedDataParallel nor an FSDP2 module.
        ValueError: An argument is out of range (the message names it).
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        from healthcheck.measure.fsdp_internals import is_fsdp_module

        if cls is WorkerConsistencyMonitor and is_fsdp_module(model):
            from healthcheck.measure.fsdp_monitor import FSDPConsistencyMonitor

            return FSDPConsistencyMonitor(model, *args, **kwargs)
        return super().__new__(cls)

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
        local_from: str = "auto",
    ):
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            kind = type(model)
            raise TypeError(
                "WorkerConsistencyMonitor needs a torch.nn.parallel.DistributedDataParallel model or an FSDP2 "
                f"(fully_shard) module, got {kind.__module__}.{kind.__qualname__}"
            )
        super().__init__(
            direction=direction,
            sketch_dim=sketch_dim,
            every=every,
            seed=seed,
            exact_chunk_numel=exact_chunk_numel,
            reduction_every=reduction_every,
            overlap=overlap,
            group=process_group if process_group is not None else model.process_group,
            dims=[d for p in model.parameters() for d in p.shape],
        )
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
        if exchange == "carry" and not (direction == "sketch" and overlap):
            raise ValueError("exchange='carry' needs direction='sketch' and overlap=True (the rows ride a step later)")
        self.exchange, self._share_rows = exchange, exchange == "auto"
        self._shared_tail = exact_rows.reserved(direction, model.parameters(), exact_chunk_numel)
        self._local_copy: dict[int, Any] = {}
        self._kept_copies: dict[int, Any] = {}  # CPU: each bucket's copy buffer, reused (exact_rows.host_copy)
        self._reduced: dict[int, Any] = {}  # this rank's all-reduced buckets, on reduction-check steps
        self._host_targets: dict[int, Any] = {}  # CPU: each bucket's kept all-reduce buffer (_reduce_target)
        self._squares = DeferredSquares(rank=self._rank, world=self._world, into=self._mean_sqnorm)  # GPU: ‖ḡ‖²
        self._plans = BucketPlans(self._sketcher.dim if self._sketcher else sketch_dim, seed)  # the one-pass sketch
        self._carried: InFlight | None = None  # the step whose rows ride on the all-reduce now in flight
        self._release: tuple[float, tuple[int, float] | None] | None = None  # set when DDP's reduction ended (host)
        self.gradient_source = local_grads.gradient_source(model, local_from, direction=direction, exchange=exchange, group=self._group)
        grads = self.gradient_source == "grads"  # or "comm_hook"; the same on every rank (local_grads.py)
        self._local_pass = local_grads.LocalGradientPass(self, model, k=self._plans.k, seed=seed) if grads else None
        if not grads:
            model.register_comm_hook(state=self, hook=eager(_consistency_hook))  # a compiled backward calls it too
        self._model: Any = model  # None once closed
        # DDP's forward broadcasts the buffers from rank 0, a wait inside the step (wait_clock.py); private: may be absent.
        if callable(getattr(model, "_sync_buffers", None)):
            model._sync_buffers = counted_as_waiting(model._sync_buffers, self.waiting)  # type: ignore[method-assign]

    # ----------------------------------------------------------------------- hook side

    def _reduce_bucket(self, bucket: Any) -> Any:
        self._arrived = time.perf_counter()  # the last bucket of a step marks the end of its backward compute
        self._waited_at_arrival = self._wait_clock.total
        buffer = bucket.buffer()
        if buffer.device.type == "cpu" and bucket.is_last():  # only the last bucket's arrival is read
            self._queue_release()
            self._read_host_clock()
        # The previous sampled step's numbers ride on this step's last all-reduce (see _carry).
        carry = self._carry(buffer) if self.exchange == "carry" and bucket.is_last() else None
        sampling = self._sampling()
        if not sampling and carry is None:
            return distributed.mean_all_reduce_async(buffer, self._world, self._group)
        index = bucket.index()
        divided = self._measure_local(index, buffer) if sampling else False
        if carry is not None:
            reduced = self._carry_target(index, buffer, carry, divided)
        else:
            if not divided:
                buffer.div_(self._world)  # in place, as DDP's own hook: no second copy of the gradient
            reduced = buffer
        future = distributed.all_reduce_async(reduced, self._group)
        if not sampling:
            return future.then(functools.partial(self._unload, buffer.numel()))
        if self.direction == "exact":
            return future.then(functools.partial(self._keep_reduced, index, numel=buffer.numel()))
        if reduced is buffer and not self._checking_reduction() and self._squares.keep(index, buffer):
            return future.then(distributed.first_value)  # on a GPU ‖ḡ‖²'s share comes after DDP's finalize
        return future.then(functools.partial(self._after_reduce, index, buffer.numel()))

    def _measure_local(self, index: int, buffer: Any) -> bool:
        """What the step needs of this rank's local gradient before the all-reduce replaces it: ‖g_i‖², the sketch
        (sketch mode), a copy (exact mode; sketch mode on reduction-check steps). Returns whether the bucket was divided
        by the world size on the way (sketch mode: :mod:`.host_pass`, :mod:`.sketch_kernel`)."""
        if self.direction == "exact" or self._checking_reduction():
            # The bucket becomes the averaged gradient, so the exact pass reads a copy of the local one.
            self._local_copy[index] = exact_rows.host_copy(self._kept_copies, index, buffer, keep=self.direction == "exact")
        if self._sketcher is None:
            self._sqnorm[index] = sqnorm_fp32(buffer)
            return False
        planned = self._plans.take(index, buffer)  # the host's C pass or the GPU's kernel (bucket_plans.py)
        if planned is not None:
            self._sketch[index], self._sqnorm[index] = planned.divide_square_sketch(buffer, self._world)
        elif host_pass.fuses(buffer):
            self._sketch[index], self._sqnorm[index] = host_pass.divide_square_sketch(
                buffer, buffer, world=self._world, k=self._sketcher.dim, seed=self._sketcher.seed, bucket_id=index
            )
        else:  # on a GPU one kernel reads and divides the bucket (sketch_kernel): each launch costs the autograd thread
            self._sketch[index], self._sqnorm[index] = self._sketcher.with_sqnorm(index, buffer, divide_by=self._world)
        return True

    def _queue_release(self) -> None:
        """Have the end of this step's reduction marked as the release (the start of the next step's busy_ms).

        Why not ``end_step``: a training script may do more between its backward and ``optimizer.step()`` (clip,
        log, save). A rank that is slow there would then start its next step late with its own clock reset,
        and the rank that waited for it in the next forward would be named the straggler instead.

        DDP's finalize waits for every bucket's all-reduce (on a host, a moment every rank shares): the release is
        marked after it (:func:`~healthcheck.measure.reduced_norm.after_ddp_finalize`). Host only: a GPU's waits on streams.
        """
        try:
            after_ddp_finalize(self._mark_release)
        except RuntimeError:  # not inside a backward (the hook called directly): end_step takes the release
            pass

    def _mark_release(self) -> None:
        self._wait_clock.reset()
        self._release = (time.perf_counter(), runqueue.read())

    def _take_release(self) -> tuple[float, tuple[int, float] | None]:
        release, self._release = self._release, None
        return release if release is not None else super()._take_release()

    def _carry(self, buffer: Any) -> Any:
        """This rank's row of the previous sampled step, to ride on the all-reduce of ``buffer``; None if none waits.

        Why: a step's numbers need an exchange between ranks, and a collective of their own costs every rank
        a round of messages and wake-ups even when asynchronous (on 8 gloo ranks sharing 2 cores, ~3 ms of CPU
        a rank and step, a few percent of a small model's step). DDP's last bucket of the next step is all-reduced
        anyway: each rank writes its row into its own slot of a ``[world, width]`` block appended to the bucket,
        the other slots are zero, and the SUM hands every rank all the rows. That step is a step later, as the
        asynchronous gather was. A bucket that is not fp32/fp64 cannot hold the rows exactly: the row then goes
        in an all-gather of its own, started here, at the same point on every rank.

        Not the default: it saved at most ~2% of a harness step against the gather, and a rank that fails before the
        next step's last all-reduce takes the step's numbers with it (README, Measured figures and Reliability).
        """
        import torch

        inflight = self._inflight
        if inflight is None or not step_gather.awaiting_carrier(inflight):
            return None
        if buffer.dtype not in (torch.float32, torch.float64):
            step_gather.start_gather(inflight, self._group)
            return None
        self._carried = inflight
        return step_gather.carried_row(inflight, buffer.dtype).to(buffer.device)

    def _carry_target(self, index: int, buffer: Any, carry: Any, divided: bool) -> Any:
        """The bucket divided by the world size (``divided``: it already is), followed by the ``[world, width]``
        block holding this rank's row in its slot (see _carry), in a new tensor that the all-reduce sums in place
        and whose first ``buffer.numel()`` elements DDP copies into ``.grad``.

        On the host it is one kept buffer (the last bucket's): a fresh multi-MiB tensor a step cost the allocator more
        than the division (322 against 132 µs a step, a 0.5M-parameter model). DDP copies it out before the next hook.
        """
        import torch

        n = buffer.numel()
        size = n + self._world * carry.numel()
        kept = self._host_targets.get(index) if buffer.device.type == "cpu" else None
        if kept is not None and kept.numel() >= size and kept.dtype == buffer.dtype:
            target = kept[:size]
        else:
            target = torch.empty(size, dtype=buffer.dtype, device=buffer.device)
            if buffer.device.type == "cpu":
                self._host_targets[index] = target
        if divided:
            target[:n].copy_(buffer)
        else:
            torch.div(buffer, self._world, out=target[:n])
        target[n:].zero_()
        width = carry.numel()
        target[n + self._rank * width : n + (self._rank + 1) * width] = carry
        return target

    def _unload(self, numel: int, future: Any) -> Any:
        """The all-reduced bucket, after taking out the rows it carried (if any)."""
        reduced = future.value()[0]
        if reduced.numel() == numel:
            return reduced
        carried, self._carried = self._carried, None
        assert carried is not None
        step_gather.receive_carried(carried, reduced[numel:].view(self._world, -1))
        return reduced[:numel]

    def _after_reduce(self, index: int, numel: int, future: Any) -> Any:
        reduced = self._keep_reduced(index, future, numel)
        # ‖ḡ‖² is the same on every rank: each computes its 1/N slice, and the gather sums them.
        lo, hi = rank_slice(reduced.numel(), self._rank, self._world)
        own = self._plans.square_sum(index, reduced, lo, hi)  # on the host one C call, in float64
        if own is None:
            own = sqnorm_fp32(reduced[lo:hi])
            # A host scalar read is free, and floats sum without tensor ops (sum_partials).
            own = float(own) if reduced.device.type == "cpu" else own
        self._mean_sqnorm[index] = own
        return reduced  # DDP copies the returned tensor into the gradients

    def _keep_reduced(self, index: int, future: Any, numel: int) -> Any:
        reduced = self._unload(numel, future)
        if self._checking_reduction():
            # A copy: the bucket was reduced in place, and with gradient_as_bucket_view it is the gradients'
            # storage, which a script may clip before end_step (script mode ends the step at optimizer.step()).
            self._reduced[index] = reduced.clone()
        return reduced

    # ----------------------------------------------------------------------- step side

    def _gather(self, step: int, indices: list[int], **pieces: Any) -> InFlight:
        """With ``exchange="carry"``, the step's vector waits for the next step's last all-reduce
        (:meth:`_carry`) instead of a collective of its own; otherwise as every monitor gathers."""
        if self.exchange != "carry":
            return super()._gather(step, indices, **pieces)
        return step_gather.launch(
            step=step, direction=self.direction, group=self._group, world=self._world, buckets=len(indices), carried=True, **pieces
        )

    def flush(self, timeout_s: float | None = None) -> Any:
        """As :meth:`ConsistencyMonitor.flush`; a step still waiting for an all-reduce to carry it is gathered
        now (a collective: every rank calls ``flush``). With ``timeout_s`` (a failure path) it is dropped
        instead: a peer may sit in another collective, which a new gather must not meet."""
        inflight = self._inflight
        if inflight is not None and step_gather.awaiting_carrier(inflight):
            if timeout_s is not None:
                self._inflight = None
                return None
            step_gather.start_gather(inflight, self._group)
        return super().flush(timeout_s)

    def _reduction_extras(self, indices: list[int]) -> dict[str, float]:
        return self._stream(indices, gram=False, reduction=True)[1]

    def _exact_pieces(self, step: int, loss: Any, tokens: Any, extras: dict[str, Any], indices: list[int], checking: bool) -> InFlight:
        """Exact mode gathers every rank's local gradient in chunks: synchronous by design, so memory stays
        bounded (N x exact_chunk_numel), and the step's header rides on the last chunk. Where every rank is on this
        host's CPU (``exchange="auto"``) the gradients go through shared memory instead (:mod:`.exact_rows`)."""
        import torch

        sqnorm = sum_partials(self._sqnorm, indices)
        local = [self._local_copy[index] for index in indices]
        if self._share_rows and not checking and exact_rows.shareable(local, self.exact_chunk_numel):
            inflight = exact_rows.post_step(step=step, world=self._world, post=self._post_shared, loss=loss, tokens=tokens,
                                            sqnorm=sqnorm, extras=extras, local=local, buckets=len(indices))
            if inflight is not None:  # else every rank could not map the file: the chunked pass, as every rank does
                return inflight
        zero = torch.zeros((), dtype=torch.float64, device=sqnorm.device)
        if checking:  # the reduction extras exist only after the pass, so the header takes its own gather
            gram, reduction = self._stream(indices, gram=True, reduction=True)
            extras.update(reduction)
            return self._gather(
                step, indices, loss=loss, tokens=tokens, sqnorm=sqnorm, dot=zero, mean_sqnorm=zero, extras=extras, gram=gram
            )
        header, names = step_gather.pack(loss=loss, tokens=tokens, sqnorm=sqnorm, dot=zero, mean_sqnorm=zero, extras=extras)
        gram, fused = self._stream(indices, gram=True, reduction=False, header=header)
        return step_gather.gathered(
            step=step, direction=self.direction, world=self._world, rows=fused["header_rows"], names=names, gram=gram, buckets=len(indices)
        )

    def _stream(self, indices: list[int], *, gram: bool, reduction: bool, header: Any = None) -> tuple[Any, dict]:
        """The chunked exact pass over this step's kept local gradients (and reduced results)."""
        pieces = []
        for index in indices:
            reduced = self._reduced.get(index) if reduction else None
            if reduction and reduced is None:
                raise RuntimeError(f"WorkerConsistencyMonitor: bucket {index} kept no reduced result this step")
            pieces.append((self._local_copy[index], reduced))
        return stream_local_gradients(
            pieces, group=self._group, world=self._world, chunk_numel=self.exact_chunk_numel, gram=gram, reduction=reduction, header=header
        )

    def _clear_partials(self) -> None:
        super()._clear_partials()
        for partials in (self._squares, self._local_copy, self._reduced):
            partials.clear()
        self._plans.new_step()  # after the pack, in stream order: the GPU kernels' table is zeroed for the next step

    def close(self) -> None:
        """Stop measuring; gradients are then averaged exactly as by DDP's default all-reduce.

        A step still in flight is dropped: call :meth:`flush` first to keep its metrics. Its collective
        is waited for (at most ``CLOSE_WAIT_S``: on a failure path a peer may never contribute).

        DDP has no public way to unregister a communication hook, so the hook stays registered and, once closed, does
        only the divide-then-sum all-reduce of DDP's ``allreduce_hook``. Closed, it lets the model be freed.
        """
        super().close()
        if self._local_pass is not None:
            self._local_pass.close()
        self._plans.clear()
        self._kept_copies.clear()
        if self._model is not None and self._model.__dict__.get("_sync_buffers") is not None:
            del self._model._sync_buffers  # DDP's own method again
        self._model = None  # DDP's reducer (C++: the garbage collector cannot see it) keeps this monitor as hook state


# --------------------------------------------------------------------------- hook helpers


def _consistency_hook(state, bucket):  # noqa: ANN001, ANN202
    """The function DDP calls per bucket; ``state`` is the monitor.

    Left unannotated on purpose: DDP inspects the signature and rejects any annotation other than the real
    ``dist.GradBucket`` / ``Future[Tensor]`` objects, which the postponed (string) annotations of this module are not.
    """
    return state._reduce_bucket(bucket)

