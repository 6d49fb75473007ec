"""The folded count sketch: k floats per gradient bucket whose inner products estimate the gradients'.

Each data-parallel rank sketches its local gradient g_i to S g_i in R^p (p the largest prime <= k,
or a smaller prime that divides no tensor dimension: :func:`safe_sketch_size`); the sketches are
all-gathered and cos_ij ~ <S g_i, S g_j> / (|S g_i| |S g_j|). S is a count sketch (every element goes
to one bin with a random sign) with structure, so that it keeps **no per-parameter state** and runs as
reshape + elementwise + reduction, with no scatter and no atomics:

    p  = bins (the sketch length)     a segment is L = m*p consecutive elements
    m  = fold depth                   a chunk is T = G*L consecutive elements (~2**20)

An element at bucket position i lies in chunk c = i // T, at chunk position t = i % T, in segment
g = t // L, and goes to

    bin(i)  = (t mod p + r_{c,g}) mod p,   r_{c,g} = (a_c*g + b_c) mod p
    sign(i) = eps_c * tau[(o_c + t) mod T]

with tau a random +-1 table of length T (a function of the seed only: 8 MB whatever the model), and
(o_c, eps_c, a_c, b_c) hashed from (seed, bucket, c). One chunk costs one multiply and one
reduction, plus a rotate-and-add on T/m elements::

    F  = (x_chunk * tau[o_c : o_c + T]).view(G, m, p).sum(1)
    S += eps_c * sum_g roll(F[g], r_{c,g})

Guarantees (derivation in the project's research notes, re-measured by ``benchmarks/sketch_error.py``):

* exactly unbiased, E<Sx, Sy> = <x, y> for every x, y: signs of distinct elements are uncorrelated
  (same chunk: distinct table entries; different chunks or buckets: independent eps);
* two elements collide deterministically iff they sit in the same segment and are congruent mod p
  (at most m of them); any other pair collides with probability exactly 1/p. So
  Var <Sx, Sy> <= (|x|^2 |y|^2 + <x, y>^2)/p + 2(m-1) min(|x|_inf^2 |y|^2, |x|^2 |y|_inf^2) + (a
  table-reuse term ~2/G of the first). For gradients without energy periodic in exactly p (only
  possible when p divides a tensor dimension, which :func:`safe_sketch_size` rules out) this is the
  count sketch's variance with k -> p: the cosine error has std <= sqrt(2/p);
* identical on every rank for the same (seed, bucket, layout): all randomness is integer hashing in
  overflow-free int64, so bins and signs are the same on every device type;
* linear: sketches of disjoint buckets add up; a bucket may be sketched piecewise with ``start=``
  (FSDP shards, streaming) and the pieces summed.

Cost: no state but the sign table (2T floats per dtype and device, cached), temporaries of one
chunk; on one CPU thread ~0.9-1.3 ns per element against 1.4-2.0 for the count sketch it replaces
(which cached a 4-byte bin index per parameter) and 4.6-5.2 when that one drew its bins afresh.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

DEFAULT_CHUNK = 1 << 20  # target chunk / sign-table length T
MIN_SEGMENTS = 16  # default m keeps >= this many segments per chunk
MAX_M = 16  # and never folds deeper than this
_LOOP_MIN_P = 8192  # CPU: rotate long rows with slice-adds instead of a gather


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
    G: int  # segments per chunk
    L: int  # segment length
    T: int  # chunk length == sign-table length


@functools.lru_cache(maxsize=None)
def get_layout(k: int, m: Optional[int] = None, chunk: Optional[int] = None) -> Layout:
    chunk = DEFAULT_CHUNK if chunk is None else int(chunk)
    p = largest_prime_leq(int(k))
    if m is None:  # deepest fold (cheapest rotation) that keeps >= MIN_SEGMENTS segments/chunk
        m = max(1, min(MAX_M, chunk // (MIN_SEGMENTS * p)))
    m = int(m)
    L = m * p
    # G <= p keeps the affine segment rotations pairwise independent
    G = max(1, min(p, chunk // L))
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


def sign_table(seed: int, T: int, device: Any, dtype: Any = torch.float32) -> Any:
    """Random +-1 table of length T, stored doubled (length 2T) so that any cyclic
    window tau[(o + t) mod T], t < T, is the contiguous slice tau2[o : o + T].
    A function of (seed, T) only; cached (constant size, independent of the model)."""
    dev = torch.device(device)
    key = (int(seed), int(T), str(dev), dtype)
    tab = _TABLES.get(key)
    if tab is None:
        K = _key(seed, T, 0x7A7)
        nw = (T + 31) // 32  # one 32-bit hash word gives 32 signs
        w = torch.arange(nw, dtype=torch.int64, device=dev)
        w = _fmix32(_fmix32(w ^ (K & _M32)) ^ (K >> 32))
        bits = (w[:, None] >> torch.arange(32, dtype=torch.int64, device=dev)) & 1
        tau = (1 - 2 * bits.reshape(-1)[:T]).to(dtype)
        tab = torch.cat([tau, tau])
        if len(_TABLES) >= _TABLE_CACHE_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = tab
    return tab


@functools.lru_cache(maxsize=64)
def _aranges(p: int, G: int, device: str) -> tuple[Any, Any]:
    dev = torch.device(device)
    return (torch.arange(p, dtype=torch.int64, device=dev), torch.arange(G, dtype=torch.int64, device=dev))


def _chunk_params(seed: int, bucket_id: int, c: int, lay: Layout) -> tuple[int, float, int, int]:
    h1 = _key(seed, bucket_id, c, 1)
    h2 = _splitmix64(h1)
    o = h1 % lay.T  # table offset
    eps = 1.0 if (h1 >> 63) & 1 else -1.0  # chunk sign
    a = h2 % lay.p  # rotation rule r_g = (a*g + b) mod p
    b = (h2 >> 32) % lay.p
    return o, eps, a, b


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
      x:         bucket (flattened with reshape(-1)); bf16/fp16 are upcast chunk by chunk.
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
    tau2 = sign_table(seed, T, dev)
    parange, garange = _aranges(p, lay.G, str(dev))
    acc = torch.zeros(p, dtype=torch.float32, device=dev)
    n = x.numel()
    i = 0
    while i < n:
        pos = start + i
        c, t = divmod(pos, T)
        take = min(n - i, T - t)
        o, eps, a, b = _chunk_params(seed, bucket_id, c, lay)
        g, u = divmod(t, L)
        j = 0
        if u:  # head: partial segment
            h = min(take, L - u)
            _partial(acc, x[i : i + h], tau2, o + t, u, g, a, b, eps, p)
            j, g = h, g + 1
        nb = (take - j) // L
        if nb:  # body: nb full segments
            xs = x[i + j : i + j + nb * L]
            s0 = o + g * L
            signs = tau2[s0 : s0 + nb * L]
            signed = torch.mul(xs, signs, out=_host_scratch(nb * L)) if dev.type == "cpu" else xs * signs
            F = signed.view(nb, mm, p).sum(1, dtype=torch.float32)
            _rotate_add(acc, F, g, a, b, eps, parange, garange)
            j += nb * L
            g += nb
        if j < take:  # tail: partial segment
            _partial(acc, x[i + j : i + take], tau2, o + g * L, 0, g, a, b, eps, p)
        i += take
    if out is None:
        return acc
    out.view(-1)[:p].add_(acc)
    return out


_SCRATCH = threading.local()


def _host_scratch(numel: int) -> Any:
    """A reused fp32 host buffer of ``numel`` elements for the signed chunk (at most one chunk, T elements).

    A fresh multi-MiB tensor per bucket and step costs the host allocator more than the multiply itself
    (measured: 322 µs against 132 µs for two DDP buckets of 0.5M and 0.26M elements); the CUDA caching
    allocator makes a fresh one free, and a shared buffer there would need stream bookkeeping. Per thread,
    since backward and comm hooks may run on threads of their own.
    """
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


def _rotate_add(acc: Any, F: Any, g0: int, a: int, b: int, eps: float, parange: Any, garange: Any) -> None:
    """acc += eps * sum_g roll(F[g], r_{g0+g}),  r_g = (a*g + b) mod p.
    CPU with long rows: a loop of slice-adds (no index tensors).  Otherwise one gather on
    the doubled rows [F, F] with a broadcast int64 index (no integer division)."""
    nb, p = F.shape
    if nb == 1 or (F.device.type == "cpu" and p >= _LOOP_MIN_P):
        for q in range(nb):
            r = (a * (g0 + q) + b) % p
            if r:
                acc[r:].add_(F[q, : p - r], alpha=eps)
                acc[:r].add_(F[q, p - r :], alpha=eps)
            else:
                acc.add_(F[q], alpha=eps)
        return
    r = (garange[g0 : g0 + nb] * a + b) % p  # per-segment rotations, [nb]
    idx = (p - r)[:, None] + parange  # [nb, p] int64, values in [1, 2p)
    acc.add_(torch.gather(torch.cat([F, F], 1), 1, idx).sum(0), alpha=eps)


def _partial(acc: Any, xs: Any, tau2: Any, s0: int, u: int, g: int, a: int, b: int, eps: float, p: int) -> None:
    """Elements xs occupy segment positions [u, u+len) of segment g (signs from tau2[s0:])."""
    h = xs.numel()
    prod = (xs * tau2[s0 : s0 + h]).float()
    lead = u % p
    tot = lead + h
    trail = (-tot) % p
    if lead or trail:
        prod = torch.nn.functional.pad(prod, (lead, trail))
    f = prod.view(-1, p).sum(0)
    r = (a * g + b) % p
    acc.add_(torch.roll(f, r), alpha=eps)


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
