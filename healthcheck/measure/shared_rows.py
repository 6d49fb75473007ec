"""A step's rows exchanged through shared memory when every rank runs on this host: no collective a step.

Why: on a host whose ranks share cores, one gloo all-gather of a step's rows cost each rank ~3.3 ms of CPU, whatever
its size (seven dependent ring hops at 8 ranks, each a TCP round through gloo's threads; README, Measured figures):
~6% of the harness's step. Ranks on one host can instead write their rows into memory that all of them map.

Layout. One file in ``/dev/shm``, which every rank of the group maps and rank 0 then unlinks, so nothing is left
behind even when a rank is killed. A header (a random token, the world size, the capacity, the slots, the result
capacity), then :data:`SLOTS` slots of ``world`` rows of ``capacity + 2`` float64: ``[begin stamp, end stamp,
values...]``. This rank's n-th post (n >= 1) goes to slot ``n % SLOTS``. Then :data:`SLOTS` result slots, each
``[claim (int64), begin stamp, end stamp, length, payload bytes...]``: a post's metrics, computed by one rank.

One rank computes, the others read. Every rank needs a step's metrics (a live check stops every rank alike), and
each used to compute them from the rows: ~0.8 ms of CPU a rank and step on 8 ranks sharing 2 cores, the same
work eight times. Now a rank that finds every row of its post in right after writing its own (the last to post
always does: its end stamp is fenced before it looks) claims the post (:meth:`SharedRows.claim`, a
compare-and-swap: exactly one rank wins), computes the metrics and publishes their bytes; the others read them
(:meth:`SharedRows.published`) when they complete that step. Where none is there (the claimant failed, or the
bytes did not fit) a rank computes them from the rows itself, as before.

Protocol, a seqlock per row. The writer stores begin = n, fences, stores the values, fences, and stores end = n.
A reader waits until every rank's end stamp reads n, fences, copies the rows, fences, and checks that every begin
stamp still reads n: a row overwritten meanwhile would show there, and is an error. The fences come from a small C
extension (``_fence.c``): numpy's stores are plain stores, which a CPU with a weaker memory model than x86's may
make visible out of order. Without it this exchange is not offered (:func:`available`).

Why two slots are enough, and why the wait costs nothing in a training loop. A rank reads post n at its next
``end_step`` (post n + 1) or at ``flush``. In between it ran a backward whose gradient all-reduce needed every
rank's part, which each rank sends only after its ``end_step`` of post n, so every row of post n is written by
then, and so are its published metrics (the claimant publishes inside that ``end_step``). Likewise a rank
writes post n + 2 (rows, or metrics as claimant) only after a backward whose all-reduce needed every rank's part
of that step, sent after that rank's ``end_step`` of post n + 1 returned: after its read of post n.

    >>> available() in (True, False)
    True
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Any, Optional, Sequence

from healthcheck.measure import distributed, host_vectors

try:  # built by ``pip install`` where a C compiler is found (setup.py: optional)
    from healthcheck.measure._fence import fence, raise_to
except ImportError:  # pragma: no cover - no fence: the all-gather is used
    fence = raise_to = None  # type: ignore[assignment]

#: Slots a rank's rows cycle through (see the module docstring for why two are enough).
SLOTS = 2
#: Values a row holds beyond the first post's width: a reduction-check step adds a few extras.
SPARE = 64
#: Where the file is made: a tmpfs, so the rows never touch a disk.
DIRECTORY = "/dev/shm"
_HEADER = 5  # float64: token, world, capacity, slots, result bytes
_RESULT_HEAD = 4  # 8-byte words before a result's payload: claim (int64), begin stamp, end stamp, length


def row_width(header: int, dim: int) -> int:
    """float64 values of a row of ``header`` values followed by a ``dim``-long fp32 vector (two to a value).

    >>> row_width(7, 0), row_width(7, 5)
    (7, 10)
    """
    return header + -(-dim // 2)


def result_bytes(world: int) -> int:
    """Room for one step's published metrics: the N×N cosines and ~100 per-rank columns, marshalled (9 bytes a
    float), with room to spare. 75 KiB at 8 ranks, 1.9 MiB at 256.

    >>> result_bytes(8), result_bytes(256)
    (75264, 1900544)
    """
    return 65536 + 24 * world * world + 1024 * world


def file_size(world: int, capacity: int, results: int) -> int:
    """Bytes of the file for ``world`` rows of ``capacity`` values and ``results`` bytes of metrics a slot."""
    return 8 * (_HEADER + SLOTS * world * (capacity + 2) + SLOTS * (_RESULT_HEAD + -(-results // 8)))


def available() -> bool:
    """Whether this process can offer the exchange: Linux's ``/dev/shm`` and the fence extension."""
    return fence is not None and raise_to is not None and os.path.isdir(DIRECTORY)


class SharedRows:
    """The mapped file of one group's rows (built by :func:`attach`, a collective)."""

    def __init__(self, buffer: mmap.mmap, rank: int, world: int, capacity: int, timeout_s: float, results: int):
        import numpy as np

        self._buffer = buffer
        self.rank, self.world, self.capacity, self.timeout_s = rank, world, capacity, timeout_s
        self._table = np.ndarray((SLOTS, world, capacity + 2), dtype=np.float64, buffer=buffer, offset=_HEADER * 8)
        self._results_at = 8 * (_HEADER + SLOTS * world * (capacity + 2))
        self._result_words = _RESULT_HEAD + -(-results // 8)
        self.result_bytes = results
        self._results = np.ndarray((SLOTS, self._result_words), dtype=np.float64, buffer=buffer, offset=self._results_at)
        self._posts = 0

    def post(self, flat: Any, tail: Optional[Sequence[Any]] = None) -> Optional[tuple["Posted", Any]]:
        """Write this rank's row (a 1-D float64 host tensor); ``(work, rows)`` as an asynchronous all-gather returns
        them (``rows`` is valid once ``work`` completed), or None when the row is wider than the capacity (the caller
        gathers it instead: every rank posts the same width, so every rank decides alike).

        ``tail``: 1-D host tensors whose values follow ``flat`` in the row as one fp32 vector (exact mode's local
        gradient, bucket by bucket: :mod:`.exact_rows`), written straight from them. The reader then copies only
        ``flat``'s columns into ``rows`` and computes the float64 Gram of the ranks' vectors where they lie
        (``work.gram``): a copy of every rank's gradient cost the reader more than the Gram."""
        import numpy as np
        import torch

        dim = sum(piece.numel() for piece in tail) if tail else 0
        header = flat.numel()
        width = row_width(header, dim)
        if width > self.capacity:
            return None
        self._posts += 1
        n = float(self._posts)
        row = self._table[self._posts % SLOTS, self.rank]
        row[0] = n
        fence()
        row[2 : 2 + header] = flat.numpy()
        if tail:
            vector = torch.from_numpy(row[2 + header : 2 + width].view(np.float32))
            at = 0
            for piece in tail:
                vector[at : at + piece.numel()].copy_(piece.reshape(-1))  # converts a bf16/fp16 piece on the way
                at += piece.numel()
            vector[dim:] = 0.0  # the padding of an odd length
        fence()
        row[1] = n
        fence()  # before this rank looks at the others' stamps: the last to post then sees every row (claim)
        out = torch.empty((self.world, header), dtype=torch.float64)
        return Posted(self, self._posts, width, out, dim), out

    def read(self, post: int, width: int, out: Any, dim: int = 0) -> tuple[bool, Any]:
        """Copy post ``post``'s rows into ``out`` (its first ``out.shape[1]`` columns) if every rank has written them.
        Returns whether it did and, with ``dim``, the float64 Gram of the ``dim``-long fp32 vectors that follow those
        columns (see :meth:`post`; else None)."""
        import torch

        rows = self._table[post % SLOTS]
        if not (rows[:, 1] == post).all():
            if (rows[:, 1] > post).any():
                raise _overwritten(post, "before")
            return False, None
        fence()
        copied = out.shape[1]
        out.numpy()[:] = rows[:, 2 : 2 + copied]
        gram = torch.from_numpy(host_vectors.fp32_gram(rows[:, 2 + copied : 2 + width], dim)) if dim else None
        fence()
        if not (rows[:, 0] == post).all():
            raise _overwritten(post, "while")
        return True, gram

    def claim(self, post: int) -> bool:
        """Whether this rank computes post ``post``'s metrics: of the ranks that ask, exactly one is told so."""
        return bool(raise_to(self._buffer, self._results_at + 8 * self._result_words * (post % SLOTS), post))

    def publish(self, post: int, payload: bytes) -> bool:
        """Write post ``post``'s metrics (the claimant only); False when they do not fit (the others compute)."""
        import numpy as np

        if len(payload) > self.result_bytes:
            return False
        slot = self._results[post % SLOTS]
        slot[1] = post
        fence()
        slot[_RESULT_HEAD:].view(np.uint8)[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        slot[3] = len(payload)
        fence()
        slot[2] = post
        return True

    def published(self, post: int) -> Optional[bytes]:
        """Post ``post``'s published metrics, or None where none were (then compute them from the rows)."""
        slot = self._results[post % SLOTS]
        if slot[2] != post:
            if slot[2] > post:
                raise _overwritten(post, "before", "metrics")
            return None
        fence()
        payload = slot[_RESULT_HEAD:].view("u1")[: int(slot[3])].tobytes()
        fence()
        if slot[1] != post:
            raise _overwritten(post, "while", "metrics")
        return payload

    def close(self) -> None:
        """Unmap (a view still held elsewhere keeps the mapping until it is freed). Closing twice does nothing."""
        if self.__dict__.pop("_table", None) is None:
            return
        self.__dict__.pop("_results", None)
        try:
            self._buffer.close()
        except BufferError:
            pass


def _overwritten(post: int, when: str, what: str = "rows") -> RuntimeError:
    return RuntimeError(f"shared rows: post {post}'s {what} were overwritten {when} they were read (a rank ran two steps "
                        "ahead of another without a gradient all-reduce in between)")


class Posted:
    """A post's completion, with the interface of a collective's work object (``wait``, ``is_completed``)."""

    def __init__(self, rows: SharedRows, post: int, width: int, out: Any, dim: int = 0):
        self._rows, self.post, self._width, self._out, self._dim = rows, post, width, out, dim
        self._done = False
        #: With ``dim`` (exact mode), the float64 Gram of the ranks' vectors once completed (:meth:`SharedRows.post`).
        self.gram: Any = None

    def is_completed(self) -> bool:
        if not self._done:
            self._done, self.gram = self._rows.read(self.post, self._width, self._out, self._dim)
        return self._done

    def wait(self) -> None:
        """Poll until every rank's row is in (at once in a training loop; see the module docstring)."""
        if not distributed.wait_until(self.is_completed, self._rows.timeout_s, max_pause_s=1e-3):
            raise RuntimeError(f"shared rows: post {self.post} still lacks a rank's row after {self._rows.timeout_s:.0f} s")


def attach(group: Any, width: int, timeout_s: float) -> Optional[SharedRows]:
    """The group's shared rows, or None where they cannot be had (then every rank gathers). A collective: every rank
    of ``group`` calls it with the same ``width`` (its first row's). Rank 0 makes the file and tells the others its
    name; a rank on another host finds no such file with that token, and then no rank uses it."""
    rank, world = distributed.rank(group), distributed.world_size(group)
    capacity, results = width + SPARE, result_bytes(world)
    size = file_size(world, capacity, results)
    token = float(secrets.randbits(52))
    path = ""
    if rank == 0 and available():
        path = _create(size, [token, world, capacity, SLOTS, results])
    path, token = distributed.broadcast_object((path, token), src=distributed.group_ranks(group)[0], group=group)
    mapped = _map(path, size, [token, world, capacity, SLOTS, results]) if path and available() else None
    everyone = all(distributed.all_gather_objects(mapped is not None, group=group))
    if rank == 0 and path:
        _unlink(path)
    if not everyone:
        if mapped is not None:
            mapped.close()
        return None
    assert mapped is not None
    return SharedRows(mapped, rank, world, capacity, timeout_s, results)


def _header_bytes(header: list[float]) -> bytes:
    """The file's first bytes: ``header`` as float64 (written by rank 0, compared by the others)."""
    import struct

    return struct.pack(f"{len(header)}d", *header)


def _create(size: int, header: list[float]) -> str:
    """A new zeroed file of ``size`` bytes with ``header`` at its start; its path, or "" where it cannot be made."""
    path = os.path.join(DIRECTORY, f"healthcheck-rows-{secrets.token_hex(8)}")
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return ""
    try:
        # Reserved now, not on first touch: a tmpfs that fills up later would kill a rank with SIGBUS mid-step.
        os.posix_fallocate(descriptor, 0, size)
        os.pwrite(descriptor, _header_bytes(header), 0)
    except OSError:
        os.close(descriptor)
        _unlink(path)
        return ""
    os.close(descriptor)
    return path


def _map(path: str, size: int, header: list[float]) -> Optional[mmap.mmap]:
    """The file mapped shared, if it is the one rank 0 made (same size and header), else None."""
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError:  # another host's rank 0 made it
        return None
    try:
        if os.fstat(descriptor).st_size != size or os.pread(descriptor, 8 * len(header), 0) != _header_bytes(header):
            return None
        return mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
