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

On an accelerator (:func:`_host_path`) the same sketch is computed with few, large kernels, because each
launch costs host time on the autograd thread: the fold multiplies in the gradient's dtype and sums in
fp32, many rows rotate in one gather, a partial segment folds as a zero-padded full one, and each run's
rotations and signs are cached on the device (12 bytes per segment, at most 4096 runs: bounded, not per
parameter). On an H100 this took a 1.07B-element bf16 bucket from 0.05 to 0.01 ns per element.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

FOLD_SPAN = 1 << 16  # the default fold depth keeps a segment (and so the sign table) near this many elements
MAX_M = 16  # and never folds deeper than this
_LOOP_MAX_ROWS = 8  # a GPU rotates more rows than this with one gather (a CPU always adds row by row)
#: Elements per fold call, (accelerator, host): a GPU's fewer, larger calls launch fewer kernels.
RUN_ELEMENTS = (1 << 24, 1 << 20)


# --------------------------------------------------------------------------------------
# integer hashing (pure python for scalars, overflow-free torch int64 for tensors)
# --------------------------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _key(*parts: int) -> int:
    h = 0x6A09E667F3BCC909
    for q in parts:
        h = _splitmix64(h ^ (int(q) & _M64))
    return h


def _mulmod32(h: Any, c: int) -> Any:
    """(h * c) mod 2^32 for int64 h in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Any) -> Any:
    """murmur3 finalizer (a bijection of [0, 2^32)), on int64 tensors."""
    h = h ^ (h >> 16)
    h = _mulmod32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mulmod32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


# --------------------------------------------------------------------------------------
# layout and constant tables
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def largest_prime_leq(k: int) -> int:
    """The largest prime <= k (the sketch's bins).

    >>> largest_prime_leq(4096), largest_prime_leq(1024), largest_prime_leq(16384)
    (4093, 1021, 16381)
    """
    if k < 2:
        raise ValueError("k must be >= 2")
    for q in range(k, 1, -1):
        if q < 4 or all(q % d for d in range(2, math.isqrt(q) + 1)):
            return q
    raise AssertionError


@dataclass(frozen=True)
class Layout:
    """Sizes of the fold, a function of (k, m, chunk) only: never of the model."""

    k: int  # requested sketch size
    p: int  # bins actually used (largest prime <= k); sketch length
    m: int  # fold depth: a segment is L = m*p elements
    G: int  # segments per chunk (<= p)
    L: int  # segment length == sign-table length
    T: int  # chunk length


@functools.lru_cache(maxsize=None)
def get_layout(k: int, m: Optional[int] = None, chunk: Optional[int] = None) -> Layout:
    """The fold for a requested size k: p bins, fold depth m (default: the deepest, up to MAX_M, whose
    segment fits FOLD_SPAN), and G = p segments per chunk unless ``chunk`` asks for fewer.

    >>> get_layout(4096)
    Layout(k=4096, p=4093, m=16, G=4093, L=65488, T=268042384)
    """
    p = largest_prime_leq(int(k))
    if m is None:  # deepest fold (cheapest rotation) whose segment stays near FOLD_SPAN
        m = max(1, min(MAX_M, FOLD_SPAN // p))
    m = int(m)
    L = m * p
    # G <= p keeps the affine segment rotations of a chunk pairwise independent
    G = p if chunk is None else max(1, min(p, int(chunk) // L))
    return Layout(k=int(k), p=p, m=m, G=G, L=L, T=G * L)


def safe_sketch_size(k: int, dims: Iterable[int]) -> int:
    """Largest prime p <= k that divides none of `dims` (e.g. all tensor dimensions of the
    model).  The fold's only weak spot is energy that is periodic with period p, which for
    real models can only come from a dimension that is a multiple of p; pass the result as
    `k` to sketch_bucket (it is its own largest prime) on every rank.

    >>> safe_sketch_size(4096, [4093 * 2, 64]), safe_sketch_size(4096, [4096, 11008])
    (4091, 4093)
    """
    dims = [int(d) for d in dims if int(d) > 1]
    q = int(k)
    while True:
        p = largest_prime_leq(q)
        if all(d % p for d in dims):
            return p
        q = p - 1


def sketch_dim(k: int) -> int:
    """Length of the sketch produced for a requested size k (largest prime <= k)."""
    return largest_prime_leq(int(k))


_TABLES: dict[tuple[int, int, str, Any], Any] = {}
_TABLE_CACHE_SIZE = 8


def sign_table(seed: int, L: int, device: Any, dtype: Any = torch.float32) -> Any:
    """Random +-1 table of length L (one segment), a function of (seed, L) only; cached.

    Small on purpose: every segment of every bucket reads the same L entries, so the table stays in
    cache while the gradient streams past (a table as long as the chunk came from memory at every call,
    which in a training step, whose activations evict it, doubled the sketch's cost)."""
    dev = torch.device(device)
    key = (int(seed), int(L), str(dev), dtype)
    tab = _TABLES.get(key)
    if tab is None:
        K = _key(seed, L, 0x7A7)
        nw = (L + 31) // 32  # one 32-bit hash word gives 32 signs
        w = torch.arange(nw, dtype=torch.int64, device=dev)
        w = _fmix32(_fmix32(w ^ (K & _M32)) ^ (K >> 32))
        bits = (w[:, None] >> torch.arange(32, dtype=torch.int64, device=dev)) & 1
        tab = (1 - 2 * bits.reshape(-1)[:L]).to(dtype)
        if len(_TABLES) >= _TABLE_CACHE_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = tab
    return tab


@functools.lru_cache(maxsize=64)
def _parange(p: int, device: str) -> Any:
    return torch.arange(p, dtype=torch.int64, device=torch.device(device))


@functools.lru_cache(maxsize=4096)
def _chunk_params(seed: int, bucket_id: int, c: int, p: int) -> tuple[int, int, int]:
    """(K_c, a_c, b_c): the chunk's sign key and its rotation rule r_g = (a_c*g + b_c) mod p."""
    h1 = _key(seed, bucket_id, c, 1)
    h2 = _splitmix64(h1)
    return h1, h2 % p, (h2 >> 32) % p


@functools.lru_cache(maxsize=4096)
def _row_moves(K: int, a: int, b: int, g0: int, nb: int, p: int) -> tuple[tuple[int, float], ...]:
    """(r_g, eps_g) of segments g0 .. g0+nb-1: where each folded row goes and with which sign (cached:
    a DDP bucket asks for the same rows every step)."""
    return tuple(((a * g + b) % p, -1.0 if segment_sign_bits(K, g) else 1.0) for g in range(g0, g0 + nb))


def segment_sign_bits(K: Any, g: Any) -> Any:
    """Bit 0 of a 32-bit hash of (K, g): segment g's sign is eps = 1 - 2*bit. Every path hashes Python ints
    here (:func:`_row_moves`; an accelerator copies the result, :func:`_device_moves`); int64 tensors give
    the same bits, as the hash's integer ops are the same ones :func:`sign_table` runs on tensors.

    >>> [segment_sign_bits(0x1234_5678_9ABC_DEF0, g) for g in range(8)]
    [1, 1, 1, 1, 1, 1, 0, 0]
    >>> segment_sign_bits(0x1234_5678_9ABC_DEF0, torch.arange(8)).tolist()
    [1, 1, 1, 1, 1, 1, 0, 0]
    """
    return _fmix32(_fmix32(g ^ (K & _M32)) ^ ((K >> 32) & _M32)) & 1


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
    p, mm, L, T = lay.p, lay.m, lay.L, lay.T
    x = x.reshape(-1)
    dev = x.device
    host = _host_path(dev)
    # A GPU folds in the gradient's own dtype: the table is +-1, so the products are exact in any float
    # dtype, and the fold's temporary is half the size of an fp32 one for bf16 (the sum accumulates in fp32).
    tau = sign_table(seed, L, dev, torch.float32 if host else x.dtype)
    # Doubled: a row rotated by r is one add into acc2[r : r + p]; the two halves are summed at the end.
    acc2 = torch.zeros(2 * p, dtype=torch.float32, device=dev)
    # Segments per fold call: the fold's temporaries (a GPU's signed copy, the host's [run, p]
    # accumulator) stay ~RUN_ELEMENTS whatever the bucket (an FSDP group's gradient can be gigabytes).
    per_run = max(1, RUN_ELEMENTS[host] // L)
    partial = _partial if host else _partial_padded
    n = x.numel()
    i = 0
    while i < n:
        pos = start + i
        c, t = divmod(pos, T)
        take = min(n - i, T - t)
        K, a, b = _chunk_params(seed, bucket_id, c, p)
        g, u = divmod(t, L)
        j = 0
        if u:  # head: partial segment
            h = min(take, L - u)
            partial(acc2, x[i : i + h], tau, u, _row_moves(K, a, b, g, 1, p)[0])
            j, g = h, g + 1
        nb = (take - j) // L
        while nb:  # body: full segments, in runs that bound the temporaries
            run = min(nb, per_run)
            xs, tab = x[i + j : i + j + run * L].view(run, mm, p), tau.view(mm, p)
            if host or run <= _LOOP_MAX_ROWS:
                _rotate_rows(acc2, _fold_rows(xs, tab) if host else _fold_fused(xs, tab), g, K, a, b)
            else:
                _rotate_gather(acc2, _fold_fused(xs, tab), g, K, a, b)
            j += run * L
            g += run
            nb -= run
        if j < take:  # tail: partial segment
            partial(acc2, x[i + j : i + take], tau, 0, _row_moves(K, a, b, g, 1, p)[0])
        i += take
    acc = acc2[:p].add_(acc2[p:])
    if out is None:
        return acc
    out.view(-1)[:p].add_(acc)
    return out


def _host_path(device: Any) -> bool:
    """Whether ``device`` takes the host's path (row loops that stay in cache) or an accelerator's (few,
    large kernels: a GPU pays ~10 µs of host time per launch, and a comm hook runs on the autograd thread).

    The two paths compute the same sketch up to fp32 rounding (tests/unit/measure/test_sketch.py)."""
    return device.type == "cpu"


def _fold_rows(xs: Any, tau: Any) -> Any:
    """F[g] = sum_q tau[q] * xs[g, q] in fp32: the signed fold of nb full segments ([nb, m, p] -> [nb, p]).

    The host's: one multiply-add per fold row into an [nb, p] accumulator. The signed segments are never
    written out, so the pass reads the gradient once, where a multiply-then-sum writes and re-reads a
    gradient-sized buffer. bf16/fp16 rows are promoted by the ops themselves (the table is fp32)."""
    acc = torch.mul(xs[:, 0], tau[0])
    for q in range(1, xs.shape[1]):
        acc.addcmul_(xs[:, q], tau[q])
    return acc


def _fold_fused(xs: Any, tau: Any) -> Any:
    """The same fold on an accelerator: one broadcast multiply and one fp32 reduction (two kernels, where
    the row loop would launch m)."""
    return (xs * tau).sum(1, dtype=torch.float32)


def _rotate_rows(acc2: Any, F: Any, g0: int, K: int, a: int, b: int) -> None:
    """acc2 += eps_g * F[g] at offset r_{g0+g} of the doubled accumulator: one add per row (the host's
    path, and an accelerator's for a few rows)."""
    nb, p = F.shape
    for q, (r, eps) in enumerate(_row_moves(K, a, b, g0, nb, p)):
        acc2[r : r + p].add_(F[q], alpha=eps)


def _rotate_gather(acc2: Any, F: Any, g0: int, K: int, a: int, b: int) -> None:
    """The same rotation of many rows on an accelerator, in a constant number of kernels whatever the rows:
    row g's element i lands in bin (i + r_g) mod p, so bin j gathers F[g, (j - r_g) mod p]."""
    nb, p = F.shape
    r, eps = _device_moves(K, a, b, g0, nb, p, str(F.device))
    idx = torch.remainder(_parange(p, str(F.device)) - r[:, None], p)
    acc2[:p].add_((torch.gather(F, 1, idx) * eps[:, None]).sum(0))


@functools.lru_cache(maxsize=4096)
def _device_moves(K: int, a: int, b: int, g0: int, nb: int, p: int, device: str) -> tuple[Any, Any]:
    """:func:`_row_moves` as device tensors (rotations int64, signs fp32), cached: a DDP bucket or an FSDP
    group asks for the same rows every step, so they are copied to the device once (12 bytes per segment
    of m*p elements, at most 4096 runs' worth), not hashed again in ~20 integer kernels per call."""
    moves = _row_moves(K, a, b, g0, nb, p)
    rotations = torch.tensor([r for r, _ in moves], dtype=torch.int64, device=device)
    signs = torch.tensor([eps for _, eps in moves], dtype=torch.float32, device=device)
    return rotations, signs


def _partial(acc2: Any, xs: Any, tau: Any, u: int, move: tuple[int, float]) -> None:
    """Elements xs occupy segment positions [u, u+len) of a segment whose row goes to offset r with sign eps.

    Position u+i lands in bin ((u+i) mod p + r) mod p: cut at multiples of p, each piece is one add
    into the doubled accumulator (no padding, no roll)."""
    r, eps = move
    p = acc2.numel() // 2
    prod = (xs * tau[u : u + xs.numel()]).float()
    i = 0
    while i < prod.numel():
        lead = (u + i) % p
        piece = prod[i : i + p - lead]
        acc2[lead + r : lead + r + piece.numel()].add_(piece, alpha=eps)
        i += piece.numel()


def _partial_padded(acc2: Any, xs: Any, tau: Any, u: int, move: tuple[int, float]) -> None:
    """:func:`_partial` on an accelerator: the elements placed at [u, u+len) of a zeroed segment, folded as a
    full one (five kernels, where the pieces would take one add per p elements)."""
    r, eps = move
    p = acc2.numel() // 2
    segment = xs.new_zeros(tau.numel())
    segment[u : u + xs.numel()] = xs
    folded = _fold_fused(segment.view(1, -1, p), tau.view(-1, p))
    acc2[r : r + p].add_(folded[0], alpha=eps)


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

    def clear(self) -> None:
        """Nothing per bucket to free: the sign table is constant-size and shared."""
