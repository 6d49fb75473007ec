"""The folded count sketch's layout: integer hashing, the fold's sizes, the sign table, and the plan that
cuts a bucket into runs of full segments and partial ones (pure arithmetic: no tensor is read here).

The sketch itself, its guarantees and its two executors (numpy on the host, few large kernels on an
accelerator) are in :mod:`healthcheck.measure.sketch`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional

import numpy as np
import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

FOLD_SPAN = 1 << 16  # the default fold depth keeps a segment (and so the sign table) near this many elements
MAX_M = 16  # and never folds deeper than this

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


def row_moves_arrays(K: int, a: int, b: int, g0: int, nb: int, p: int) -> tuple[Any, Any]:
    """(r_g, eps_g) of segments g0 .. g0+nb-1 as numpy int64 and float32 arrays: where each folded row goes and
    with which sign. The hash runs on int64 arrays, a dozen numpy calls whatever ``nb``. Why: row by row in Python
    it cost ~2.3 µs a row, and FSDP2's sketch is salted per step, so nothing is reused. For a 0.95B-parameter
    gradient that was ~33 ms a step on this host, and for 70B ~2.4 s.

    >>> r, eps = row_moves_arrays(0x1234_5678_9ABC_DEF0, 3, 5, 4, 4, 7)  # segments 4-7: signs as segment_sign_bits'
    >>> r.tolist(), eps.tolist()
    ([3, 6, 2, 5], [-1.0, -1.0, 1.0, 1.0])
    """
    g = np.arange(g0, g0 + nb, dtype=np.int64)
    return (a * g + b) % p, (1 - 2 * segment_sign_bits(K, g)).astype(np.float32)


#: Fewer rows than this are hashed as Python ints: numpy's dozen calls cost ~90 µs on this host, ~35 rows' worth.
_ARRAY_ROWS = 32


@functools.lru_cache(maxsize=4096)
def _row_moves(K: int, a: int, b: int, g0: int, nb: int, p: int) -> tuple[tuple[int, float], ...]:
    """:func:`row_moves_arrays` as (r, eps) pairs, for the host's row loop (cached: a DDP bucket asks for the same
    rows every step).

    >>> _row_moves(0x1234_5678_9ABC_DEF0, 3, 5, 4, 4, 7) == _row_moves(0x1234_5678_9ABC_DEF0, 3, 5, 4, 40, 7)[:4]
    True
    """
    if nb < _ARRAY_ROWS:
        return row_moves_loop(K, a, b, g0, nb, p)
    r, eps = row_moves_arrays(K, a, b, g0, nb, p)
    return tuple(zip(r.tolist(), eps.tolist(), strict=True))


def row_moves_loop(K: int, a: int, b: int, g0: int, nb: int, p: int) -> tuple[tuple[int, float], ...]:
    """:func:`row_moves_arrays` row by row on Python ints: cheaper for a few rows, ~2.3 µs a row beyond that."""
    return tuple(((a * g + b) % p, -1.0 if segment_sign_bits(K, g) else 1.0) for g in range(g0, g0 + nb))


def segment_sign_bits(K: Any, g: Any) -> Any:
    """Bit 0 of a 32-bit hash of (K, g): segment g's sign is eps = 1 - 2*bit. Every path hashes numpy int64
    arrays here (:func:`row_moves_arrays`; an accelerator copies the result, :func:`_device_moves`); Python ints and
    int64 tensors give the same bits, as the hash's integer ops are the same ones :func:`sign_table` runs on tensors.

    >>> [segment_sign_bits(0x1234_5678_9ABC_DEF0, g) for g in range(8)]
    [1, 1, 1, 1, 1, 1, 0, 0]
    >>> segment_sign_bits(0x1234_5678_9ABC_DEF0, torch.arange(8)).tolist()
    [1, 1, 1, 1, 1, 1, 0, 0]
    """
    return _fmix32(_fmix32(g ^ (K & _M32)) ^ ((K >> 32) & _M32)) & 1


# --------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------
class Piece(NamedTuple):
    """A stretch of the bucket that one fold call takes: ``rows`` full segments (a run), or, with ``rows == 0``,
    part of one segment whose first element sits at segment position ``u``. Segment ``g`` of chunk ``c`` is
    the first one; ``(K, a, b)`` are the chunk's :func:`_chunk_params`."""

    lo: int  # bucket positions [lo, hi) relative to the sketched tensor
    hi: int
    u: int
    rows: int
    g: int
    K: int
    a: int
    b: int

    def moves(self, p: int) -> tuple[tuple[int, float], ...]:
        """(r, eps) of each folded row: where it goes and with which sign (one row for a partial segment)."""
        return _row_moves(self.K, self.a, self.b, self.g, max(self.rows, 1), p)


@functools.lru_cache(maxsize=4096)
def plan(n: int, start: int, lay: Layout, seed: int, bucket_id: int, per_run: int) -> tuple[Piece, ...]:
    """How a tensor of ``n`` elements at bucket position ``start`` is folded: its pieces in order (pure
    arithmetic, cached: a DDP bucket or an FSDP group asks for the same plan every step).

    >>> lay = get_layout(32, 2, 31 * 2 * 4)  # p = 31, L = 62, T = 248
    >>> [(q.lo, q.hi, q.u, q.rows, q.g) for q in plan(300, 40, lay, 0, 0, per_run=2)]
    [(0, 22, 40, 0, 0), (22, 146, 0, 2, 1), (146, 208, 0, 1, 3), (208, 270, 0, 1, 0), (270, 300, 0, 0, 1)]
    """
    p, L, T = lay.p, lay.L, lay.T
    pieces = []
    i = 0
    while i < n:
        c, t = divmod(start + i, T)
        take = min(n - i, T - t)
        K, a, b = _chunk_params(seed, bucket_id, c, p)
        g, u = divmod(t, L)
        j = 0
        if u:  # head: partial segment
            h = min(take, L - u)
            pieces.append(Piece(i, i + h, u, 0, g, K, a, b))
            j, g = h, g + 1
        nb = (take - j) // L
        while nb:  # body: full segments, in runs that bound the temporaries
            run = min(nb, per_run)
            pieces.append(Piece(i + j, i + j + run * L, 0, run, g, K, a, b))
            j += run * L
            g += run
            nb -= run
        if j < take:  # tail: partial segment
            pieces.append(Piece(i + j, i + take, 0, 0, g, K, a, b))
        i += take
    return tuple(pieces)


def row_table(n: int, lay: Layout, seed: int, bucket_id: int) -> tuple[Any, Any]:
    """The plan of an ``n``-element bucket as one row per segment, full or partial, for the compiled folds (the
    Triton kernel, the host's C fold): int64 ``[rows, 4]`` of (base, lo, hi, r) and float32 ``[rows]`` signs.
    Segment position ``t`` of a row is bucket element ``base + t``; the row holds positions ``[lo, hi)``, and
    its folded bins go to ``(j + r) mod p`` with sign ``eps``.

    >>> meta, eps = row_table(100, get_layout(8, 2), 0, 0)  # p = 7, L = 14: 7 full segments, then 2 elements
    >>> meta[:, 0].tolist(), meta[-1, 1:3].tolist(), len(eps)
    ([0, 14, 28, 42, 56, 70, 84, 98], [0, 2], 8)
    """
    tables, signs = [], []
    for piece in plan(n, 0, lay, seed, bucket_id, max(1, n // lay.L)):
        r, eps = row_moves_arrays(piece.K, piece.a, piece.b, piece.g, max(piece.rows, 1), lay.p)
        table = np.empty((len(r), 4), dtype=np.int64)
        if piece.rows:
            table[:, 0] = piece.lo + lay.L * np.arange(piece.rows, dtype=np.int64)
            table[:, 1], table[:, 2] = 0, lay.L
        else:
            table[:, 0], table[:, 1], table[:, 2] = piece.lo - piece.u, piece.u, piece.u + piece.hi - piece.lo
        table[:, 3] = r
        tables.append(table)
        signs.append(eps)
    meta = np.concatenate(tables) if tables else np.empty((0, 4), dtype=np.int64)
    return meta, np.concatenate(signs) if signs else np.empty(0, dtype=np.float32)
