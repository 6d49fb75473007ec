"""One step's per-rank measurements: packed into one vector, gathered once, turned into StepMetrics.

Every monitor (DDP's comm hook, FSDP2's reduce-scatter) ends a step with the same pieces on each
rank: the loss and token count, ‖g_i‖², a ⟨g_i, ḡ⟩ column (zero: read off the sketches or the Gram, see
:attr:`InFlight.from_gram`) and this rank's part of ‖ḡ‖² (the parts sum to it; or an exact Gram instead),
per-rank extras, and in sketch mode a k-float sketch. :func:`launch` packs
them into one float64 vector (the sketch as fp32 bits) and
starts ONE all-gather; :func:`complete` waits for it, does the step's one host sync and hands the
numbers to :func:`~healthcheck.measure.metrics.compute_step_metrics`.

Off the critical path. With ``overlap`` the all-gather is asynchronous: it runs on the process
group's communication thread (gloo) or stream (NCCL) while the next step computes, and is read one
step later. On a 2-core host running 8 ranks, a synchronous gather cost ~15 ms a step, nearly all of
it waiting for the slowest rank to arrive; an asynchronous one costs what it takes to issue it.
"""

from __future__ import annotations

import array
import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

from healthcheck.measure import distributed, host_vectors, staged_rows
from healthcheck.measure.metrics import StepMetrics, compute_step_metrics, fsum, gram_statistics

#: The fixed columns of the gathered vector, before the extras (sorted by name) and the sketch.
HEADER = ("loss", "tokens", "sqnorm", "dot", "mean_sqnorm", "loss_measured")
_COLUMN = {name: index for index, name in enumerate(HEADER)}
#: How long closing a monitor, or a failure path, waits for a gather still in flight before dropping it.
CLOSE_WAIT_S = 2.0
#: Parts a carried header value is split into (:func:`carried_row`).
CARRY_PARTS = 3


@dataclasses.dataclass
class InFlight:
    """A step whose gather was started; :func:`complete` finishes it."""

    step: int
    direction: str
    world: int
    work: Any  #: the async collective's handle, or None when it already finished
    rows: Any  #: [world, width (+ k)] float64, valid once ``work`` completed
    names: list[str]
    gram: Optional[Any]  #: exact mode: the float64 Gram (identical on every rank)
    buckets: int
    sketch_dim: int = 0  #: sketch mode: the sketch's length (its fp32 bits follow the header)
    #: What is read off the Gram besides the pairwise cosines: "" nothing (exact dots and norms in the
    #: header), "cosine" the cosine to the mean (norms stay exact), "mean" that and ‖ḡ‖²'s cross terms
    #: (:func:`mean_sqnorm_from_sketches`), "all" norms, dots and ‖ḡ‖² too.
    from_gram: str = ""
    source: Any = None  #: this rank's packed vector, kept alive while the collective may still read it
    #: ``rows`` came in a gradient all-reduce, in :func:`carried_row`'s layout (decoded by :func:`complete`).
    carried: bool = False
    #: The step's metrics once this rank computed them ahead of time (the claimant of shared rows: monitor_core).
    metrics: Optional[StepMetrics] = None
    #: On a CUDA device with ``overlap``: the rows' host copy, queued behind the gather (:mod:`.staged_rows`).
    staged: Optional[staged_rows.Staged] = None


def pack(
    *,
    loss: Any,
    tokens: Any,
    sqnorm: Any,
    dot: Any,
    mean_sqnorm: Any,
    extras: Mapping[str, Any],
    sketch: Any = None,
) -> tuple[Any, list[str]]:
    """This rank's float64 vector for the step, and the extras' names in their column order.

    The sketch travels as its fp32 bits, two to a float64 slot (:func:`unpack_sketches` reads them
    back): the gather only copies bytes, and the fp32 sketch costs half the bytes a float64 one would.
    """
    import torch

    device = sqnorm.device if hasattr(sqnorm, "device") else torch.device("cpu")
    names = sorted(extras)
    values = [loss, tokens, sqnorm, dot, mean_sqnorm, 0.0 if loss is None else 1.0, *(extras[n] for n in names)]
    if device.type == "cpu":
        # On the host a scalar read costs nothing: one tensor from Python floats beats a dozen small ops.
        header = [float("nan") if v is None else float(v.detach() if hasattr(v, "detach") else v) for v in values]
        return host_vectors.pack(header, sketch), names
    parts = [device_column(values, device)]
    if sketch is not None:
        bits = sketch.to(device=device, dtype=torch.float32).reshape(-1)
        if bits.numel() % 2:
            bits = torch.cat([bits, bits.new_zeros(1)])
        parts.append(bits.view(torch.float64))
    return torch.cat(parts) if len(parts) > 1 else parts[0], names


def device_column(values: list[Any], device: Any) -> Any:
    """The header on ``device`` as float64, in ``values``' order: device scalars stay where they are, and the plain
    numbers (None: NaN) go over in one copy from pinned memory, without a wait (a copy from pageable memory makes torch
    wait for the stream: on a GPU, for the backward to drain). No non-finite flag travels: :func:`complete` reads
    it off the loss and ‖g_i‖² columns (on a device the flag took eleven ops, each a launch on the step's thread).

    >>> import torch
    >>> device_column([torch.tensor(0.5, dtype=torch.bfloat16), 7, None, torch.tensor([2.0])], "cpu").tolist()
    [0.5, 7.0, nan, 2.0]
    """
    import torch

    plain = [float("nan") if v is None else float(v) for v in values if not isinstance(v, torch.Tensor)]
    copied = iter(_numbers_on(torch.device(device), plain).unbind())
    return torch.stack(
        [v.to(device=device, dtype=torch.float64).reshape(()) if isinstance(v, torch.Tensor) else next(copied) for v in values]
    )


def _numbers_on(device: Any, numbers: list[float]) -> Any:
    """``numbers`` as a float64 tensor on ``device``; on CUDA copied from pinned memory, so the host does not wait."""
    import torch

    host = torch.tensor(numbers, dtype=torch.float64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def unpack_sketches(rows: Any, width: int, dim: int) -> Any:
    """The ``[world, dim]`` float64 sketches from gathered rows packed by :func:`pack` (header ``width`` wide).

    >>> import torch
    >>> flat, _ = pack(loss=1.0, tokens=2, sqnorm=torch.tensor(3.0), dot=0.0, mean_sqnorm=0.0, extras={},
    ...                sketch=torch.tensor([0.5, -1.25, 3.0]))
    >>> unpack_sketches(flat.reshape(1, -1), len(HEADER), 3).tolist()
    [[0.5, -1.25, 3.0]]
    """
    import torch

    return rows[:, width:].contiguous().view(torch.float32)[:, :dim].to(torch.float64)


def launch(
    *,
    step: int,
    direction: str,
    group: Any,
    world: int,
    loss: Any,
    tokens: Any,
    sqnorm: Any,
    dot: Any,
    mean_sqnorm: Any,
    extras: Mapping[str, Any],
    sketch: Any = None,
    gram: Any = None,
    buckets: int = 0,
    overlap: bool = True,
    from_gram: str = "",
    carried: bool = False,
    post: Optional[Callable[[Any], Any]] = None,
) -> InFlight:
    """Pack this rank's pieces (0-d device tensors or numbers; ``loss`` None = not measured) and gather them.

    In exact mode pass ``gram`` (and zeros for ``dot``/``mean_sqnorm``: they are read off the Gram);
    in sketch mode pass ``sketch``. A collective: every rank calls it with the same extras' keys.
    ``from_gram``: see :attr:`InFlight.from_gram` (exact mode always reads everything off its Gram).
    ``carried``: start no collective; the caller sends the vector later, inside a gradient all-reduce
    (:func:`carried_row`, :func:`receive_carried`) or, when none comes, with :func:`start_gather`.
    ``post``: an exchange other than the all-gather, ``post(flat) -> (work, rows)`` as
    :func:`~healthcheck.measure.distributed.all_gather_rows_async` returns them, or None to gather after all
    (:meth:`healthcheck.measure.shared_rows.SharedRows.post`).
    """
    flat, names = pack(loss=loss, tokens=tokens, sqnorm=sqnorm, dot=dot, mean_sqnorm=mean_sqnorm, extras=extras, sketch=sketch)
    posted = post(flat) if post is not None and not carried else None
    if posted is not None:
        work, rows = posted
    elif carried:
        work, rows = None, None
    elif overlap:
        work, rows = distributed.all_gather_rows_async(flat, group)
    else:
        work, rows = None, distributed.all_gather_rows(flat, group)
    return InFlight(
        step=step,
        direction=direction,
        world=world,
        work=work,
        rows=rows,
        names=names,
        gram=gram,
        buckets=buckets,
        source=flat,
        sketch_dim=0 if sketch is None else sketch.numel(),
        from_gram="all" if gram is not None else from_gram,
        staged=staged_rows.stage(work, rows) if overlap and posted is None and not carried else None,
    )


def awaiting_carrier(inflight: InFlight) -> bool:
    """Whether the step was launched ``carried`` and nothing has sent its vector yet."""
    return inflight.work is None and inflight.rows is None


def start_gather(inflight: InFlight, group: Any) -> None:
    """Send a carried step's vector with an all-gather of its own (asynchronous; :func:`complete` waits)."""
    inflight.work, inflight.rows = distributed.all_gather_rows_async(inflight.source, group)


def carried_row(inflight: InFlight, dtype: Any) -> Any:
    """This rank's vector as values of ``dtype`` (fp32 or fp64) that a SUM all-reduce over zeros returns unchanged.

    The packed vector cannot travel as raw bits in a float all-reduce: adding zeros may quiet a NaN
    payload or flush a denormal. So each header value goes as ``frexp``'s mantissa, split into three
    parts of ``dtype`` (3 x 24 bits hold fp64's 53; a mantissa in [0.5, 1) neither overflows nor
    underflows fp32), and its exponent; the sketch, fp32 already, goes as values. Layout:
    ``[part 1, part 2, part 3, exponent (width each), sketch (dim)]``; :func:`receive_carried` keeps the
    rows and :func:`complete` decodes them (:func:`decode_header`).
    """
    import torch

    width = len(HEADER) + len(inflight.names)
    flat = inflight.source
    if flat.device.type == "cpu":
        # A dozen values: as Python floats the row costs ~50 µs on a quiet core, with the ~20 tensor ops
        # below ~110 µs (0.17 against 0.27 ms a step with 8 ranks on 2 cores: benchmarks/hook_breakdown.py
        # --mode sketch-carry); the same bits (tests/unit/measure/test_step_gather.py).
        header = torch.tensor(split_header(flat[:width].tolist(), dtype), dtype=dtype)
    else:
        header = _split_header_tensor(flat[:width], dtype)
    sketch = flat[width:].view(torch.float32)[: inflight.sketch_dim].to(dtype)
    return torch.cat([header, sketch])


def split_header(values: list[float], dtype: Any) -> list[float]:
    """:func:`carried_row`'s header layout, from Python floats: three ``dtype`` parts of each value's
    ``frexp`` mantissa, then the exponents (a non-finite value travels whole in its first part).

    >>> import torch
    >>> split_header([1 / 3, float("inf")], torch.float32)
    [0.6666666865348816, inf, -1.9868215517249155e-08, 0.0, 5.551115123125783e-16, 0.0, -1.0, 0.0]
    >>> sum(split_header([1 / 3], torch.float32)[:3]) == 2 / 3
    True
    """
    import torch

    pairs = [math.frexp(value) for value in values]
    rest = [mantissa for mantissa, _ in pairs]
    parts: list[float] = []
    for _ in range(CARRY_PARTS):
        # array("f") rounds each double to the nearest fp32, as ``tensor.to(torch.float32)`` does.
        part = rest if dtype == torch.float64 else array.array("f", rest).tolist()
        parts.extend(part)
        rest = [r - q if math.isfinite(q) else 0.0 for r, q in zip(rest, part, strict=True)]
    return parts + [float(exponent) for _, exponent in pairs]


def _split_header_tensor(header: Any, dtype: Any) -> Any:
    """:func:`split_header` with tensor ops (an accelerator's vector stays on its device: no host sync)."""
    import torch

    mantissa, exponent = torch.frexp(header)
    rest, parts = mantissa, []
    for _ in range(CARRY_PARTS):
        part = rest.to(dtype)
        parts.append(part)
        # inf - inf is NaN: a non-finite value travels whole in its first part.
        rest = torch.where(torch.isfinite(part), rest - part.to(torch.float64), 0.0)
    return torch.cat([*parts, exponent.to(dtype)])


def carried_width(inflight: InFlight) -> int:
    """Elements of one rank's :func:`carried_row`."""
    return (CARRY_PARTS + 1) * (len(HEADER) + len(inflight.names)) + inflight.sketch_dim


def receive_carried(inflight: InFlight, rows: Any) -> None:
    """Keep the step's ``[world, carried_width]`` rows from the all-reduce that carried them (a copy: the
    all-reduce's buffer is reused); :func:`complete` decodes them."""
    inflight.rows = rows.clone()
    inflight.carried = True
    inflight.source = None


def decode_header(rows: list[list[float]], width: int) -> list[list[float]]:
    """The float64 header values from carried rows (lists of floats, ``(CARRY_PARTS + 1) * width`` long).

    >>> import torch
    >>> inflight = launch(step=0, direction="sketch", group=None, world=1, loss=1 / 3, tokens=7,
    ...                   sqnorm=torch.tensor(1e300, dtype=torch.float64), dot=float("inf"), mean_sqnorm=5e-324,
    ...                   extras={}, sketch=torch.tensor([0.5, -2.0]), carried=True)
    >>> row = carried_row(inflight, torch.float32)
    >>> decode_header([row.tolist()], len(HEADER))[0][:5]
    [0.3333333333333333, 7.0, 1e+300, inf, 5e-324]
    """
    out = []
    for row in rows:
        values = []
        for j in range(width):
            first = row[j]
            if not math.isfinite(first):
                values.append(first)
                continue
            # Each partial sum is exact: the parts cover disjoint bits of a 53-bit mantissa.
            mantissa = first + (row[width + j] + row[2 * width + j])
            values.append(math.ldexp(mantissa, int(row[CARRY_PARTS * width + j])))
        out.append(values)
    return out


def gathered(*, step: int, direction: str, world: int, rows: Any, names: list[str], gram: Any = None, buckets: int = 0) -> InFlight:
    """A step whose rows were already gathered by the caller (exact mode's header rides on its last
    gradient chunk: one collective instead of two)."""
    return InFlight(
        step=step,
        direction=direction,
        world=world,
        work=None,
        rows=rows,
        names=names,
        gram=gram,
        buckets=buckets,
        from_gram="all" if gram is not None else "",
    )


def dots_from_sketch_cosines(gram: Any, sqnorms: list[float], mean_sq: float) -> list[float]:
    """⟨g_i, ḡ⟩ as the sketches' cosine to their mean times the exact norms: the cosine to the mean is then
    the sketch's estimate, and the norms (used by the dispersion and diversity metrics) stay exact.

    >>> dots_from_sketch_cosines([[1.0, 0.0], [0.0, 1.0]], [4.0, 4.0], 2.0)
    [2.0, 2.0]
    """
    sketch_sq, sketch_dots, sketch_mean_sq = gram_statistics(gram)
    out = []
    for sq, dot, exact_sq in zip(sketch_sq, sketch_dots, sqnorms, strict=True):
        scale = sq * sketch_mean_sq
        cosine = dot / math.sqrt(scale) if scale > 0 else math.nan
        out.append(cosine * math.sqrt(max(exact_sq, 0.0) * max(mean_sq, 0.0)))
    return out


def mean_sqnorm_from_sketches(gram: Any, sqnorms: list[float]) -> float:
    """‖ḡ‖² = (1/N²) Σ_ij ⟨g_i, g_j⟩ with the exact ‖g_i‖² on the diagonal and the sketches' unbiased estimates
    of the cross terms: where no rank holds a part of the reduced mean (HSDP: a shard group's mean is not the
    job's), the mean's norm is an estimate, with the sketch's error bound on the cross terms only.

    >>> mean_sqnorm_from_sketches([[4.1, 1.0], [1.0, 3.9]], [4.0, 4.0])  # (4 + 4 + 2 * 1) / 4
    2.5
    """
    rows = [list(row) for row in gram]
    n = len(rows)
    cross = fsum(rows[i][j] for i in range(n) for j in range(n) if i != j)
    # A norm: an estimate below zero (nearly opposed gradients and the sketch's error) is read as zero, not negative.
    return max(0.0, (fsum(sqnorms) + cross) / (n * n))


def finished_within(inflight: InFlight, timeout_s: float) -> bool:
    """Whether the gather has finished, waiting at most ``timeout_s`` (polling: a peer may be gone for good)."""
    if inflight.staged is not None:
        return distributed.wait_until(inflight.staged.ready, timeout_s, max_pause_s=0.01)
    if inflight.work is None:
        return True
    return distributed.wait_until(inflight.work.is_completed, timeout_s, max_pause_s=0.01)


def complete(inflight: InFlight) -> StepMetrics:
    """Wait for the gather (if it still runs), do the step's one host sync, compute its metrics."""
    import torch

    if inflight.staged is not None:  # the rows' host copy: waits for the gather, not for the current stream
        inflight.rows, inflight.staged = inflight.staged.rows(), None
        inflight.work = inflight.source = None
    if inflight.work is not None:
        inflight.work.wait()
        if inflight.gram is None:  # exact mode's shared rows: the reader computed the Gram (exact_rows.py)
            inflight.gram = getattr(inflight.work, "gram", None)
        inflight.work = inflight.source = None
    if inflight.rows is None:
        raise RuntimeError(
            f"step {inflight.step}: its numbers were never exchanged (no gradient all-reduce carried them, and no flush)"
        )
    width = len(HEADER) + len(inflight.names)
    rows = inflight.rows
    if inflight.carried:
        sketches = rows[:, (CARRY_PARTS + 1) * width :].to(torch.float64)
        values = decode_header(rows[:, : (CARRY_PARTS + 1) * width].cpu().tolist(), width)
        gram_rows = (sketches @ sketches.T).cpu().numpy()
    elif inflight.gram is None and rows.device.type == "cpu":
        values, gram_rows = host_vectors.header_and_gram(rows, width, inflight.sketch_dim)
    else:
        values = rows[:, :width].cpu().tolist()
        if inflight.gram is None:
            sketches = unpack_sketches(rows, width, inflight.sketch_dim)
            gram_rows = (sketches @ sketches.T).cpu().numpy()
        else:
            gram_rows = inflight.gram.cpu().numpy()

    def column(name: str) -> list[float]:
        return [row[_COLUMN[name]] for row in values]

    if inflight.from_gram == "all":
        sqnorms, dots, mean_sq = gram_statistics(gram_rows)
    else:
        sqnorms, dots = column("sqnorm"), column("dot")
        # Each rank measured ‖ḡ‖² over its own part of the reduced mean (a slice, or its FSDP shard).
        mean_sq = mean_sqnorm_from_sketches(gram_rows, sqnorms) if inflight.from_gram == "mean" else fsum(column("mean_sqnorm"))
        if inflight.from_gram in ("cosine", "mean"):
            dots = dots_from_sketch_cosines(gram_rows, sqnorms, mean_sq)
    tokens = column("tokens")
    return compute_step_metrics(
        step=inflight.step,
        direction=inflight.direction,
        per_rank_loss=column("loss"),
        per_rank_sqnorm=sqnorms,
        dots_with_mean=dots,
        mean_sqnorm=mean_sq,
        gram=gram_rows,
        per_rank_tokens=None if any(math.isnan(t) for t in tokens) else tokens,
        # compute_step_metrics flags a measured non-finite loss and a non-finite norm it is given; exact mode gives it
        # the Gram's norms, so the header's ‖g_i‖² (this rank's own fp32 sum) is passed as the flag.
        nonfinite_flags=[not math.isfinite(sq) for sq in column("sqnorm")],
        loss_measured=[flag != 0 for flag in column("loss_measured")],
        per_rank_extras={name: [row[len(HEADER) + j] for row in values] for j, name in enumerate(inflight.names)},
        buckets=inflight.buckets,
    )
