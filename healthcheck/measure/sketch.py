"""The folded count sketch: k floats per gradient bucket whose inner products estimate the gradients'.

Each data-parallel rank sketches its local gradient g_i to S g_i in R^p (p the largest prime <= k,
or a smaller prime that divides no tensor dimension: :func:`safe_sketch_size`); the sketches are
all-gathered and cos_ij ~ <S g_i, S g_j> / (|S g_i| |S g_j|). S is a count sketch (every element goes
to one bin with a random sign) with structure, so that it keeps **no per-parameter state** and runs as
reshape + multiply-add + a few row adds, with no scatter and no atomics:

    p  = bins (the sketch length)     a segment is L = m*p consecutive elements
    m  = fold depth                   a chunk is T = G*L consecutive elements (G <= p segments)

An element at bucket position i lies in chunk c = i // T, in segment g = (i % T) // L, at segment
position u = i % L, and goes to

    bin(i)  = (u mod p + r_{c,g}) mod p,   r_{c,g} = (a_c*g + b_c) mod p
    sign(i) = eps_{c,g} * tau[u]

with tau a random +-1 table of length L (a function of the seed only: 256 KB for k = 4096, whatever
the model), (a_c, b_c) hashed from (seed, bucket, c) and eps_{c,g} from (seed, bucket, c, g)
(:func:`segment_sign_bits`). A run of full segments costs one multiply-add per fold row and one add
per segment::

    F[g] = sum_q tau[q*p : (q+1)*p] * x_segment_g[q*p : (q+1)*p]      (the fold: [nb, m, p] -> [nb, p])
    S   += eps_{c,g} * roll(F[g], r_{c,g})

Guarantees (re-measured by ``benchmarks/sketch_error.py``):

* exactly unbiased, E<Sx, Sy> = <x, y> for every x, y: signs of distinct elements are uncorrelated
  (same segment: distinct table entries; different segments: independent eps);
* two elements collide deterministically iff they sit in the same segment and are congruent mod p
  (at most m of them); any other pair collides with probability exactly 1/p (the rotations of one
  chunk's segments are pairwise independent, other chunks' and buckets' independent). So
  Var <Sx, Sy> <= (|x|^2 |y|^2 + <x, y>^2)/p + 2(m-1) min(|x|_inf^2 |y|^2, |x|^2 |y|_inf^2) + R, where
  R, from segments reusing the table, is (2/p) sum_j X_j Y_j with X_j, Y_j the energy of x and y at
  positions = j mod p: ~|x|^2 |y|^2 / p^2 unless the energy is periodic in exactly p (only possible when
  p divides a tensor dimension, which :func:`safe_sketch_size` rules out). Then this is the count
  sketch's variance with k -> p: the cosine error has std <= sqrt(2/p);
* identical on every rank for the same (seed, bucket, layout): all randomness is integer hashing in
  overflow-free int64, so bins and signs are the same on every device type;
* linear: sketches of disjoint buckets add up; a bucket may be sketched piecewise with ``start=``
  (FSDP shards, streaming) and the pieces summed.

Cost: no state but the sign table (L floats per dtype and device, cached) and an [nb, p] fold. Why a
table one segment long: every segment reads the same L entries, so the table stays in cache while the
gradient streams past. The chunk-long table (4 MiB) of the previous fold came from memory at every
call once a training step's activations had evicted it, and its multiply-then-sum wrote and re-read a
gradient-sized buffer: in a DDP hook of the issue-13 harness model (2 ranks, two buckets of 0.26M
elements) that sketch took 0.93-1.06 ms a bucket and this one 0.63-0.78 ms
(``benchmarks/sketch_cost.py`` measures ns per element, cold and warm).

How a bucket is cut into runs and partial segments is pure arithmetic (:func:`plan`, cached per bucket);
two executors follow it. The host's is numpy (:func:`_sketch_host`): a small model's bucket is a few
segments, and torch's per-op overhead (~5 µs, more on a host shared by several ranks) was most of the cost.

On an accelerator (:func:`_host_path`) the same sketch is computed with few, large kernels, because each
launch costs host time on the autograd thread: the fold multiplies in the gradient's dtype and sums in
fp32, many rows rotate in one gather, a partial segment folds as a zero-padded full one, and each run's
rotations and signs are cached on the device (12 bytes per segment, at most 4096 runs: bounded, not per
parameter). On an H100 this took a 1.07B-element bf16 bucket from 0.05 to 0.01 ns per element.

On CUDA with Triton the DDP monitor's hook calls :meth:`FoldedSketch.with_sqnorm`, which runs
:mod:`healthcheck.measure.sketch_kernel` instead: the same sketch, ‖x‖² and DDP's division in one kernel, because
there the hook's host time per launch, not the GPU's, was the cost.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Iterable, Optional

import numpy as np
import torch

from healthcheck.measure.precision import sqnorm_fp32
from healthcheck.measure.sketch_layout import (  # noqa: F401  (re-exported: the sketch's public layout helpers)
    Layout,
    Piece,
    _chunk_params,
    _parange,
    _row_moves,
    get_layout,
    largest_prime_leq,
    plan,
    row_moves_arrays,
    safe_sketch_size,
    segment_sign_bits,
    sign_table,
    sketch_dim,
)

_LOOP_MAX_ROWS = 8  # a GPU rotates more rows than this with one gather (the host adds row by row)
#: Elements per fold call, (accelerator, host): a GPU's fewer, larger calls launch fewer kernels.
RUN_ELEMENTS = (1 << 24, 1 << 20)


# --------------------------------------------------------------------------------------
# the sketch
# --------------------------------------------------------------------------------------
def sketch_bucket(
    x: Any,
    *,
    k: int,
    seed: int,
    bucket_id: int,
    out: Optional[Any] = None,
    start: int = 0,
    m: Optional[int] = None,
    chunk: Optional[int] = None,
) -> Any:
    """Sketch a flat gradient bucket (any float dtype, any device) into R^p, p = sketch_dim(k).

    Args:
      x:         bucket (flattened with reshape(-1)); bf16/fp16 are promoted to fp32 run by run (RUN_ELEMENTS).
      k:         requested sketch size; p = largest prime <= k bins are used.
      seed:      sketch seed (same on all ranks; may change per step).
      bucket_id: identifies the bucket; different buckets get independent randomness.
      out:       if given (fp32, numel >= p), the sketch is ADDED into out[:p] and out is
                 returned; so looping over buckets with one `out` sketches the whole model.
      start:     position of x[0] inside the bucket, to sketch a bucket piecewise
                 (sketch(x[:a], start=0) + sketch(x[a:], start=a) == sketch(x) up to rounding).
      m, chunk:  layout knobs (fold depth, chunk length); must be equal on all ranks.
    Returns: fp32 tensor of shape [p] (or `out`).
    """
    lay = get_layout(int(k), m, chunk)
    x = x.reshape(-1)
    host = _host_path(x.device)
    # Segments per fold call: the fold's temporaries (a GPU's signed copy, the host's upcast run) stay
    # ~RUN_ELEMENTS whatever the bucket (an FSDP group's gradient can be gigabytes).
    pieces = plan(x.numel(), int(start), lay, int(seed), int(bucket_id), max(1, RUN_ELEMENTS[host] // lay.L))
    if host:
        acc = torch.from_numpy(_sketch_host(x, pieces, lay, seed))
    else:
        acc = _sketch_accelerator(x, pieces, lay, seed)
    if out is None:
        return acc
    out.view(-1)[: lay.p].add_(acc)
    return out


def _host_path(device: Any) -> bool:
    """Whether ``device`` takes the host's path (numpy, whose calls cost ~1 µs where a torch op costs ~5) or an
    accelerator's (few, large kernels: a GPU pays ~10 µs of host time per launch, and a comm hook runs on the
    autograd thread).

    The two paths compute the same sketch up to fp32 rounding (tests/unit/measure/test_sketch.py)."""
    return device.type == "cpu"


def _sketch_host(x: Any, pieces: tuple[Piece, ...], lay: Layout, seed: int, visit: Optional[Any] = None) -> Any:
    """The sketch of ``x`` (a CPU tensor) by numpy: ``[p]`` fp32. ``visit(piece, values)``, if given, sees each
    piece's values as a numpy array right after they were folded, while they are in cache
    (:mod:`healthcheck.measure.host_pass` squares them and divides them in place there: for an fp32/fp64 ``x``
    they are a view of it, and nothing reads them again).

    Why numpy: a DDP bucket of a small model is a few segments, and the torch row loop spent most of its time
    in per-op overhead: on one quiet core a 263K-element bucket took 0.9-1.0 ns per element by torch ops and
    takes 0.5 here, a 6.5M-element one 0.57 against 0.43 (the same bits; README, Measured figures). The fold is one
    ``einsum`` per run, which multiplies and sums in one loop: the signed segments are never written out, so
    the pass reads the gradient once. bf16/fp16 (numpy has no bf16) are upcast to fp32 piece by piece.
    """
    p, m = lay.p, lay.m
    tau = sign_table(seed, lay.L, x.device).numpy()
    table = tau.reshape(m, p)
    # Doubled: a row rotated by r is one add into acc2[r : r + p]; the two halves are summed at the end.
    acc2 = np.zeros(2 * p, dtype=np.float32)
    # fp32/fp64 are read in place; numpy has no bf16, so a half-precision piece is upcast when its turn comes.
    whole = x.detach().numpy() if x.dtype in (torch.float32, torch.float64) else None
    for piece in pieces:
        xs = whole[piece.lo : piece.hi] if whole is not None else x[piece.lo : piece.hi].float().numpy()
        if piece.rows:
            _rotate_rows_host(acc2, _fold_host(xs.reshape(piece.rows, m, p), table), piece.moves(p))
        else:
            _partial_host(acc2, xs, tau, piece.u, piece.moves(p)[0])
        if visit is not None:
            visit(piece, xs)
    return acc2[:p] + acc2[p:]


def _fold_host(xs: Any, table: Any) -> Any:
    """F[g] = sum_q table[q] * xs[g, q] ([nb, m, p] -> [nb, p]) in one loop: no signed copy of the gradient."""
    return np.einsum("gqj,qj->gj", xs, table)


def _rotate_rows_host(acc2: Any, F: Any, moves: tuple[tuple[int, float], ...]) -> None:
    """acc2[r_g : r_g + p] += eps_g * F[g]: one add per row."""
    p = F.shape[1]
    for row, (r, eps) in zip(F, moves, strict=True):
        if eps > 0:
            acc2[r : r + p] += row
        else:
            acc2[r : r + p] -= row


def _partial_host(acc2: Any, xs: Any, tau: Any, u: int, move: tuple[int, float]) -> None:
    """Elements xs occupy segment positions [u, u+len) of a segment whose row goes to offset r with sign eps.

    Position u+i lands in bin ((u+i) mod p + r) mod p: cut at multiples of p, each piece is one add
    into the doubled accumulator (no padding, no roll)."""
    r, eps = move
    p = acc2.size // 2
    prod = xs * tau[u : u + xs.size]
    if eps < 0:
        np.negative(prod, out=prod)
    i = 0
    while i < prod.size:
        lead = (u + i) % p
        piece = prod[i : i + p - lead]
        acc2[lead + r : lead + r + piece.size] += piece
        i += piece.size


def _sketch_accelerator(x: Any, pieces: tuple[Piece, ...], lay: Layout, seed: int) -> Any:
    """The sketch of ``x`` on an accelerator, in few, large kernels: ``[p]`` fp32 on ``x``'s device."""
    p, m = lay.p, lay.m
    # The fold multiplies in the gradient's own dtype: the table is +-1, so the products are exact in any
    # float dtype, and the fold's temporary is half the size of an fp32 one for bf16 (the sum is fp32).
    tau = sign_table(seed, lay.L, x.device, x.dtype)
    acc2 = torch.zeros(2 * p, dtype=torch.float32, device=x.device)
    for piece in pieces:
        xs = x[piece.lo : piece.hi]
        if not piece.rows:
            _partial_padded(acc2, xs, tau, piece.u, piece.moves(p)[0])
            continue
        F = _fold_fused(xs.view(piece.rows, m, p), tau.view(m, p))
        if piece.rows <= _LOOP_MAX_ROWS:
            _rotate_rows(acc2, F, piece.moves(p))
        else:
            _rotate_gather(acc2, F, piece)
    return acc2[:p].add_(acc2[p:])


def _fold_fused(xs: Any, tau: Any) -> Any:
    """The fold on an accelerator: one broadcast multiply and one fp32 reduction (two kernels, where a row
    loop would launch m)."""
    return (xs * tau).sum(1, dtype=torch.float32)


def _rotate_rows(acc2: Any, F: Any, moves: tuple[tuple[int, float], ...]) -> None:
    """acc2 += eps_g * F[g] at offset r_g of the doubled accumulator: one add per row (an accelerator's path
    for a few rows)."""
    p = F.shape[1]
    for q, (r, eps) in enumerate(moves):
        acc2[r : r + p].add_(F[q], alpha=eps)


def _rotate_gather(acc2: Any, F: Any, piece: Piece) -> None:
    """The same rotation of many rows on an accelerator, in a constant number of kernels whatever the rows:
    row g's element i lands in bin (i + r_g) mod p, so bin j gathers F[g, (j - r_g) mod p]."""
    nb, p = F.shape
    r, eps = _device_moves(piece.K, piece.a, piece.b, piece.g, nb, p, str(F.device))
    idx = torch.remainder(_parange(p, str(F.device)) - r[:, None], p)
    acc2[:p].add_((torch.gather(F, 1, idx) * eps[:, None]).sum(0))


@functools.lru_cache(maxsize=4096)
def _device_moves(K: int, a: int, b: int, g0: int, nb: int, p: int, device: str) -> tuple[Any, Any]:
    """:func:`row_moves_arrays` as device tensors (rotations int64, signs fp32), cached: a DDP bucket asks for the
    same rows every step, so they are copied to the device once (12 bytes per segment of m*p elements, at most 4096
    runs' worth), not hashed again in ~20 integer kernels per call. FSDP2's sketch is salted per step, so there every
    call misses: a dozen numpy calls and two copies."""
    rotations, signs = row_moves_arrays(K, a, b, g0, nb, p)
    return torch.from_numpy(rotations).to(device), torch.from_numpy(signs).to(device)


def _partial_padded(acc2: Any, xs: Any, tau: Any, u: int, move: tuple[int, float]) -> None:
    """A partial segment on an accelerator: the elements placed at [u, u+len) of a zeroed segment, folded as a
    full one (five kernels, where the host's pieces would take one add per p elements)."""
    r, eps = move
    p = acc2.numel() // 2
    segment = xs.new_zeros(tau.numel())
    segment[u : u + xs.numel()] = xs
    folded = _fold_fused(segment.view(1, -1, p), tau.view(-1, p))
    acc2[r : r + p].add_(folded[0], alpha=eps)


#: ``HEALTHCHECK_SKETCH_KERNEL=torch`` turns the compiled sketches off: a GPU keeps the torch executor, a host the
#: numpy pass (read per bucket: how a benchmark prices them in one process; :func:`compiled_allowed`).
KERNEL_SWITCH = "HEALTHCHECK_SKETCH_KERNEL"
_KERNEL_OFF: list[BaseException] = []  # set when the kernel failed once in this process: it is not tried again


@functools.lru_cache(maxsize=1)
def _kernel_module() -> Any:
    try:
        from healthcheck.measure import sketch_kernel
    except ImportError:  # no Triton: the torch executor
        return None
    return sketch_kernel


def compiled_allowed() -> bool:
    """Whether :data:`KERNEL_SWITCH` lets a compiled sketch run (the Triton kernel here, the host's C pass in
    :mod:`healthcheck.measure.host_pass`)."""
    return os.environ.get(KERNEL_SWITCH) != "torch"


def kernel_failed(error: BaseException) -> None:
    """Switch the kernel off for the rest of this process, with one warning: a GPU or toolchain Triton cannot build
    for fails the same way on every bucket, and the torch sketch gives the same numbers (:func:`torch_with_sqnorm`)."""
    _KERNEL_OFF.append(error)
    warnings.warn(f"healthcheck: the fused sketch kernel failed ({error!r}); using the torch sketch", stacklevel=3)


def torch_with_sqnorm(buffer: Any, *, k: int, seed: int, bucket_id: int, divide_by: int = 1) -> tuple[Any, Any]:
    """The kernel's results without it: the sketch and ‖buffer‖² (fp32, 0-d) of ``buffer`` as it was, then
    ``buffer /= divide_by`` in place.

    >>> x = torch.ones(6)
    >>> sketch, sqnorm = torch_with_sqnorm(x, k=7, seed=0, bucket_id=1, divide_by=2)
    >>> bool(torch.equal(sketch, sketch_bucket(torch.ones(6), k=7, seed=0, bucket_id=1))), float(sqnorm), x[0].item()
    (True, 6.0, 0.5)
    """
    measured = sketch_bucket(buffer, k=k, seed=seed, bucket_id=bucket_id), sqnorm_fp32(buffer)
    if divide_by != 1:
        buffer.div_(divide_by)
    return measured


def _kernel_for(x: Any) -> Any:
    """:mod:`.sketch_kernel` if it takes ``x`` (a contiguous CUDA tensor, Triton installed, not switched off), else None.
    The device is looked at first, so a host run never imports Triton."""
    if x.device.type != "cuda" or _KERNEL_OFF or not compiled_allowed():
        return None
    module = _kernel_module()
    return module if module is not None and module.usable(x) else None


class FoldedSketch:
    """The monitor's per-bucket sketch: ``sketch(index, buffer)`` -> fp32 [dim], identical on every rank.

    Args:
        k: Requested sketch size.
        seed: Sketch seed (the same on every rank).
        dims: The model's tensor dimensions; the sketch uses the largest prime <= k that divides
            none of them (:func:`safe_sketch_size`), so no weight layout aligns with its bins.
    """

    def __init__(self, k: int, seed: int, dims: Iterable[int] = ()):
        self.k = k
        self.seed = seed
        self.dim = safe_sketch_size(k, dims)

    def __call__(self, index: int, buffer: Any) -> Any:
        return sketch_bucket(buffer, k=self.dim, seed=self.seed, bucket_id=index)

    def with_sqnorm(self, index: int, buffer: Any, divide_by: int = 1) -> tuple[Any, Any]:
        """``(self(index, buffer), ‖buffer‖²)`` in fp32, of ``buffer`` as it was; then, with ``divide_by`` > 1,
        ``buffer /= divide_by`` in place (DDP's averaging, the same bits). On CUDA with Triton that is one read and
        write of the bucket by one kernel (:mod:`healthcheck.measure.sketch_kernel`); elsewhere the sketch, then
        ``sqnorm_fp32``, then ``div_``.

        >>> x = torch.arange(10.0)
        >>> want = FoldedSketch(31, seed=0)(2, x)
        >>> sketch, sqnorm = FoldedSketch(31, seed=0).with_sqnorm(2, x, divide_by=2)
        >>> bool(torch.equal(sketch, want)), float(sqnorm), x[-1].item()
        (True, 285.0, 4.5)
        """
        kernel = _kernel_for(buffer)
        if kernel is not None:
            try:
                return kernel.sketch_and_sqnorm(buffer, k=self.dim, seed=self.seed, bucket_id=index, divide_by=divide_by)
            except Exception as error:  # noqa: BLE001  (a GPU or toolchain Triton cannot build for: same numbers the slow way)
                kernel_failed(error)
        return torch_with_sqnorm(buffer, k=self.dim, seed=self.seed, bucket_id=index, divide_by=divide_by)

    def clear(self) -> None:
        """Nothing per bucket to free: the sign table is constant-size and shared."""
