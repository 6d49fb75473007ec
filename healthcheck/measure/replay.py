"""Cross-rank gradient replay, worker side: every rank computes the gradient of THE SAME micro-batch from the
same parameters, and fingerprints it on its device.

The round that uses these pieces (which rank disagrees, the second replay) is
:mod:`healthcheck.run.replay_rounds`; the judgement is :mod:`healthcheck.judge.replay_audit`. One replay::

    source = replay_source_rank(step, world, seed)       # no communication: a hash of (seed, step)
    batch  = broadcast_batch(my_batch, source, device)    # rank `source`'s micro-batch, on every rank
    local  = replay.local(step, batch)                    # forward + backward + fingerprint (no collective)
    table  = replay.gather(local)                         # one all-gather, one host sync

Why the parameters swapped for *detached* leaves (as ``torch.func.functional_call`` does), not ``ddp.module(...)`` or
``ddp.no_sync()``: DDP's reducer registers a post-hook on every parameter's AccumulateGrad node, and it
runs for ANY backward that reaches the real parameters, through the wrapper or not, inside ``no_sync`` or
not. Mostly inert outside a synchronising step, but not entirely: it counts backward calls, and with
``static_graph=True`` (or ``find_unused_parameters``) it records which gradients arrived before checking
whether it should, so a replay before the first step breaks the next iterations (measured while this was
prototyped). Detached leaves share the parameters' storage (no copy) and the backward fills the leaves'
``.grad``, so no DDP hook, no comm hook and no parameter's ``.grad`` is touched: there is nothing to restore
but RNG (:func:`replay_gradient` says why the leaves stay in place through the backward).

What is fingerprinted, on the device, with one gather per replay: one :func:`tensor_bit_hash` per
gradient tensor (bit equality, and the first differing tensor); one hash of the parameters (the replay's
input: a mismatch there is ``param_equality``'s finding, not a faulty device); the loss's and ‖g‖²'s
float64 bits; in tolerance mode, a folded sketch of the gradient, whose differences estimate ‖g_r − g_q‖
without moving a gradient. Only when ranks disagree does :meth:`GradientReplay.compare_to` broadcast a
majority rank's gradient, one tensor at a time, for the exact max |Δ| and relative L2 difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from healthcheck.measure import distributed as hdist
from healthcheck.measure.bit_hash import tensor_bit_hash
from healthcheck.measure.sketch import FoldedSketch

_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def replay_source_rank(step: int, world_size: int, seed: int = 0) -> int:
    """The rank whose micro-batch every rank replays at ``step``: a hash, the same on every rank.

    A hash rather than ``step % world``: with ``replay_every`` a multiple of the world size the modulo
    would pick the same rank every time.

    >>> [replay_source_rank(s, 8) for s in (0, 15, 30, 45)]
    [7, 5, 6, 6]
    """
    return _splitmix64((seed << 32) ^ step) % world_size


def replay_seed(step: int, seed: int = 0) -> int:
    """The RNG seed every rank replays with at ``step`` (identical dropout masks on every rank).

    >>> replay_seed(15, 42) == replay_seed(15, 42) != replay_seed(30, 42)
    True
    """
    return _splitmix64(_splitmix64(seed) ^ (step + 1)) & 0x7FFF_FFFF_FFFF_FFFF


def broadcast_batch(batch: Optional[Mapping[str, Any]], src: int, device: Any) -> dict[str, Any]:
    """Rank ``src``'s micro-batch (its tensors and plain values), on every rank, the tensors on ``device``.

    The layout (names, shapes, dtypes, plain values) travels as one object, then each tensor by a
    broadcast (no pickling of data; NCCL needs the tensors on the GPU). Other ranks pass None.
    """
    layout = None
    if batch is not None:
        layout = {k: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v) for k, v in batch.items()}
    layout = hdist.broadcast_object(layout, src=src)
    out: dict[str, Any] = {}
    for name, spec in layout.items():
        if spec[0] == "value":
            out[name] = spec[1]
            continue
        if batch is not None:
            tensor = batch[name].to(device).contiguous()
        else:
            tensor = torch.empty(spec[1], dtype=spec[2], device=device)
        hdist.broadcast(tensor, src=src)
        out[name] = tensor
    return out


@contextlib.contextmanager
def replay_rng(seed: int, device: Any) -> Iterator[None]:
    """Every generator a forward may draw from, seeded identically on every rank, and restored after.

    torch's CPU generator and this rank's CUDA generator (``fork_rng`` restores them; no other device's
    generator is touched), python's ``random`` and numpy's global state (a model rarely draws from them).
    """
    import numpy as np

    cuda = getattr(device, "type", "cpu") == "cuda"
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)  # the current device's generator: this rank's
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def replay_gradient(
    module: Any, loss_of: Callable[[Callable[..., Any]], Any], names: Sequence[str], *, seed: int, device: Any
) -> tuple[Any, list[Any]]:
    """The replay's loss and the gradient of every named parameter, without touching the parameters' ``.grad`` or DDP.

    ``loss_of(call)`` runs the forward as ``call(*args, **kwargs)`` and returns a 0-d loss; ``call`` is
    ``module`` with its parameters swapped for detached leaves that share their storage (what
    ``torch.func.functional_call`` does, held through the backward too). Module hooks still run (a faulty
    device's forward hooks included).

    Why the swap lasts through the backward, which then fills the leaves' ``.grad``: a model with reentrant
    activation checkpointing (``use_reentrant=True``, still the choice of many fine-tuning scripts) runs its
    checkpointed blocks' forward again inside the backward, and refuses ``autograd.grad`` (what this used
    until a Trainer script with ``gradient_checkpointing_kwargs={"use_reentrant": True}`` ended its probe in
    exit 3). That second forward must see the leaves as well, or its gradients would land on the real
    parameters' ``.grad`` and DDP's hooks. Every trainable parameter is a leaf here, so the backward reaches
    nothing else.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    params = dict(module.named_parameters())
    leaves = {name: params[name].detach().requires_grad_(True) for name in names}
    with replay_rng(seed, device), torch.enable_grad():
        with _reparametrize_module(module, leaves, tie_weights=True, strict=False):
            loss = loss_of(module)
            loss.backward()
    inputs = [leaves[name] for name in names]
    return loss.detach(), [p.grad if p.grad is not None else torch.zeros_like(p) for p in inputs]


def pack_fingerprint(grads: Sequence[Any], params: Sequence[Any], loss: Any, sketcher: Optional[FoldedSketch]) -> Any:
    """One int64 device vector: per-tensor gradient hashes, a parameter hash, loss and ‖g‖² bits, the sketch.

    Floats travel as their bits (float64 viewed as int64, fp32 sketch pairs viewed as int64), so the
    gather moves exact values and nothing syncs with the host before it.
    """
    grad_hashes = torch.stack([tensor_bit_hash(g) for g in grads])
    param_hash = tensor_bit_hash(torch.stack([tensor_bit_hash(p) for p in params]))
    sqnorm = torch.stack([g.detach().to(torch.float64).square().sum() for g in grads]).sum()
    sketch = None
    if sketcher is not None:
        sketch = torch.zeros(sketcher.dim, dtype=torch.float32, device=loss.device)
        for index, g in enumerate(grads):
            sketch += sketcher(index, g.detach().reshape(-1).float())
    return fingerprint_row(grad_hashes, param_hash, loss, sqnorm, sketch)


def fingerprint_row(grad_hashes: Any, param_hash: Any, loss: Any, sqnorm: Any, sketch: Optional[Any]) -> Any:
    """The layout :meth:`ReplayTable.unpack` reads: the gradient hashes, the parameter hash, the loss and ‖g‖² as
    float64 bits, then the fp32 sketch (padded to an even length) as int64 pairs."""
    scalars = torch.stack([loss.detach().to(torch.float64), sqnorm]).view(torch.int64)
    parts = [grad_hashes, param_hash.reshape(1), scalars]
    if sketch is not None:
        parts.append((sketch if sketch.numel() % 2 == 0 else torch.cat([sketch, sketch.new_zeros(1)])).view(torch.int64))
    return torch.cat(parts)


@dataclasses.dataclass(frozen=True)
class ReplayTable:
    """Every rank's replay fingerprint, on the host (identical on every rank after the gather)."""

    grad_hashes: list[tuple[int, ...]]
    param_hashes: list[int]
    losses: list[float]
    sqnorms: list[float]
    sketches: Optional[Any]  #: float64 [world, p] on the host, or None

    @staticmethod
    def unpack(rows: Any, tensors: int, sketch_dim: int) -> ReplayTable:
        rows = rows.cpu()
        scalars = rows[:, tensors + 1 : tensors + 3].contiguous().view(torch.float64)
        sketches = None
        if sketch_dim:
            sketches = rows[:, tensors + 3 :].contiguous().view(torch.float32)[:, :sketch_dim].to(torch.float64)
        return ReplayTable(
            grad_hashes=[tuple(r) for r in rows[:, :tensors].tolist()],
            param_hashes=rows[:, tensors].tolist(),
            losses=scalars[:, 0].tolist(),
            sqnorms=scalars[:, 1].tolist(),
            sketches=sketches,
        )

    def relative_distances(self) -> list[list[float]]:
        """Tolerance mode: ``d[i][j]`` ≈ ‖g_i − g_j‖ / ‖g_j‖ from the sketches (relative error ≲ sqrt(2/p))."""
        assert self.sketches is not None
        gaps = torch.cdist(self.sketches, self.sketches)
        norms = torch.tensor(self.sqnorms, dtype=torch.float64).sqrt().clamp(min=1e-300)
        return (gaps / norms.reshape(1, -1)).tolist()


@dataclasses.dataclass
class LocalReplay:
    """This rank's replay gradient (kept until the round is judged) and its device-side fingerprint."""

    grads: Any  #: the gradient tensors; under FSDP2 what computes them again (:mod:`.sharded_replay`)
    fingerprint: Any
    seconds: float


def relative_l2(grads: Sequence[Any], reference: Sequence[Any]) -> float:
    """‖a − b‖ / ‖b‖ over a whole gradient, in float64, on this rank (no collective).

    >>> relative_l2([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.0])])
    0.0
    """
    gap = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(grads, reference, strict=True))
    norm = sum(float(b.double().square().sum()) for b in reference)
    return (gap / norm) ** 0.5 if norm > 0 else (0.0 if gap == 0 else float("inf"))


class DifferenceSums:
    """Each rank's exact difference from a reference rank's gradient, added up tensor by tensor on the device: max
    |Δ|, ‖Δ‖², ‖g_ref‖² and the lowest index with Δ ≠ 0. ``keep`` marks what it makes (FSDP2's reduce-scatter stream
    makes it, the default stream reads it: :func:`~healthcheck.measure.fsdp_internals.keep_for_default_stream`)."""

    def __init__(self, reference_rank: int, rank: int, device: Any, keep: Callable[[Any], Any] = lambda tensor: tensor):
        self.reference_rank, self.rank, self._keep = reference_rank, rank, keep
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.max_abs, self.gap_sq, self.ref_sq, self.first = zero, zero, zero, torch.full_like(zero, -1.0)

    def add(self, index: int, grad: Any) -> None:
        """Collective: tensor ``index`` of this rank's gradient against the reference's (one broadcast)."""
        reference = grad.detach().clone() if self.rank == self.reference_rank else torch.empty_like(grad)
        hdist.broadcast(reference, src=self.reference_rank)
        delta = grad.detach().to(torch.float64) - reference.to(torch.float64)
        tensor_max = delta.abs().max() if delta.numel() else torch.zeros_like(self.max_abs)
        keep, first = self._keep, self.first
        self.max_abs = keep(torch.maximum(self.max_abs, tensor_max))
        self.gap_sq = keep(self.gap_sq + delta.square().sum())
        self.ref_sq = keep(self.ref_sq + reference.to(torch.float64).square().sum())
        self.first = keep(torch.where((tensor_max > 0) & ((first < 0) | (first > index)), torch.full_like(first, index), first))

    def gathered(self) -> list[tuple[float, float, int]]:
        """Collective: per rank, ``(max |Δ|, ‖Δ‖ / ‖g_ref‖, the lowest index with Δ ≠ 0 or -1)``."""
        rows = hdist.all_gather_rows(torch.stack([self.max_abs, self.gap_sq, self.ref_sq, self.first])).cpu().tolist()
        return [(m, (g / r) ** 0.5 if r > 0 else (0.0 if g == 0 else float("inf")), int(f)) for m, g, r, f in rows]


class GradientReplay:
    """Replays on this rank; see the module docstring.

    Args:
        module: The trained module (``ddp.module``), never the DDP wrapper.
        loss_of: ``loss_of(call, batch) -> 0-d loss``, the training step's loss with ``call`` as the model.
        device: This rank's device.
        seed: The probe's global seed (source rank and dropout seed derive from it and the step).
        sketch_dim: Folded-sketch size for the tolerance mode's distances (0: no sketch, bitwise mode).
    """

    collective = False  #: a replay needs no other rank (the comparisons do); FSDP2's does (:mod:`.sharded_replay`)

    def __init__(
        self, module: Any, loss_of: Callable[[Callable[..., Any], Mapping[str, Any]], Any], *, device: Any, seed: int, sketch_dim: int = 0
    ):
        self.module = module
        self.loss_of = loss_of
        self.device = device
        self.seed = seed
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        dims = [d for _, p in module.named_parameters() for d in p.shape]
        self.sketcher = FoldedSketch(sketch_dim, seed, dims=dims) if sketch_dim else None
        self.world = hdist.world_size()
        self.rank = hdist.rank()

    def source_batch(self, step: int, batch: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Collective: the replayed rank at ``step`` and its micro-batch on every rank (``batch`` is this rank's)."""
        source = replay_source_rank(step, self.world, self.seed)
        return source, broadcast_batch(batch if self.rank == source else None, source, self.device)

    def local(self, step: int, batch: Mapping[str, Any]) -> LocalReplay:
        """This rank's replay of ``batch`` (no collective)."""
        start = time.perf_counter()
        loss, grads = replay_gradient(
            self.module, lambda call: self.loss_of(call, batch), self.names, seed=replay_seed(step, self.seed), device=self.device
        )
        parameters = dict(self.module.named_parameters())
        fingerprint = pack_fingerprint(grads, [parameters[n] for n in self.names], loss, self.sketcher)
        return LocalReplay(grads=grads, fingerprint=fingerprint, seconds=time.perf_counter() - start)

    def spread(self, again: LocalReplay, first: LocalReplay) -> float:
        """How far a second replay on this rank came from the first: ‖g_again − g_first‖ / ‖g_first‖."""
        return relative_l2(again.grads, first.grads)

    def gather(self, local: LocalReplay) -> ReplayTable:
        """Collective: every rank's fingerprint (one all-gather, one host sync)."""
        rows = hdist.all_gather_rows(local.fingerprint)
        return ReplayTable.unpack(rows, len(self.names), self.sketcher.dim if self.sketcher else 0)

    def gather_floats(self, value: float) -> list[float]:
        """Collective: one float from every rank, in rank order."""
        return hdist.all_gather_rows(torch.tensor([value], dtype=torch.float64, device=self.device)).reshape(-1).cpu().tolist()

    def compare_to(self, grads: Sequence[Any], reference_rank: int) -> list[tuple[float, float, int]]:
        """Collective: each rank's exact difference from ``reference_rank``'s ``grads``.

        One broadcast per tensor (extra memory: one tensor). Returns, per rank, ``(max |Δ|, ‖Δ‖ / ‖g_ref‖,
        index of the first tensor with Δ ≠ 0 or -1)``.
        """
        sums = DifferenceSums(reference_rank, self.rank, self.device)
        for index, grad in enumerate(grads):
            sums.add(index, grad)
        return sums.gathered()
