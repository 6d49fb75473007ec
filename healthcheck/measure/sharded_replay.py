"""The replay audit under FSDP2: every rank replays the same micro-batch through the sharded model.

Under DDP each rank holds the whole model and replays alone (:mod:`healthcheck.measure.replay`). Under FSDP2 no rank
holds it, so the replay is a collective: every rank runs the chosen rank's micro-batch through the root, FSDP2
all-gathers each parameter group as in training, and the backward hands each group's reduce-scatter this rank's
*unsharded* local gradient, which the monitor passes here (:meth:`FSDPConsistencyMonitor.replaying`) before the
reduce-scatter runs. Every rank computed that gradient from the same all-gathered parameters and the same inputs,
so a rank whose device computes wrongly (or whose forward differs: a hook, a setting) gives another one.

What is kept per group, streamed, never the gradient itself (it is the size of the unsharded model): its bit hash,
its squared norm, and in tolerance mode its share of a folded sketch. The gradients the training step left in the
parameters' ``.grad`` (sharded) are set aside and put back, so the update is the one the script computed; the
gradient-sync switch is on for the replay and restored after.

An exact difference (max |Δ|, relative L2) needs another rank's gradient: :meth:`ShardedGradientReplay.compare_to`
replays once more and, per group, broadcasts the reference rank's local gradient inside the reduce-scatter (one
group's worth of extra memory). So under FSDP2 the difference is that of a second replay, and the "second replay"
that tells a persistent fault from a transient one is a third.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional

import torch

from healthcheck.measure import fsdp_internals
from healthcheck.measure.bit_hash import tensor_bit_hash
from healthcheck.measure.fsdp_internals import keep_for_default_stream as keep
from healthcheck.measure.replay import DifferenceSums, GradientReplay, LocalReplay, fingerprint_row, replay_rng, replay_seed


@dataclasses.dataclass
class _Rerun:
    """What stands for a replay's gradient under FSDP2: how to compute it again, and its sketch and squared norm."""

    step: int
    batch: Mapping[str, Any]
    sketch: Optional[Any]
    sqnorm: Any


class ShardedGradientReplay(GradientReplay):
    """:class:`GradientReplay`'s interface for an FSDP2 root (the monitor's replay slot carries the gradients).

    ``names`` are the parameter groups (their modules' names), in the order FSDP2's groups are listed; a
    difference's ``first_tensor`` names the first group that differs.
    """

    collective = True  #: every rank replays together (FSDP2's all-gathers), the comparisons included

    def __init__(self, root: Any, monitor: Any, loss_of: Callable[[Callable[..., Any], Mapping[str, Any]], Any], *, device: Any,
                 seed: int, sketch_dim: int = 0):
        super().__init__(root, loss_of, device=device, seed=seed, sketch_dim=sketch_dim)
        self.monitor = monitor
        module_names = {id(module): name for name, module in root.named_modules()}
        groups = list(fsdp_internals.param_groups(root))
        self.names = [module_names.get(id(module)) or "the root module" for module, _, _ in groups]

    def _run(self, step: int, batch: Mapping[str, Any], on_local: Callable[[int, Any], None]) -> Any:
        """The replay's forward and backward with ``on_local`` on each group's local gradient; its loss."""
        root = self.module
        params = list(root.parameters())
        kept = [p.grad for p in params]
        sync = fsdp_internals.sync_flags(root)
        for p in params:
            p.grad = None  # FSDP2 accumulates into a .grad it finds: the training step's stays apart
        root.set_requires_gradient_sync(True)
        try:
            with replay_rng(replay_seed(step, self.seed), self.device), torch.enable_grad(), self.monitor.replaying(on_local):
                loss = self.loss_of(root, batch)
                loss.backward()
        finally:
            for p, grad in zip(params, kept, strict=True):
                p.grad = grad
            fsdp_internals.set_sync_flags(root, sync)
        return loss.detach()

    def local(self, step: int, batch: Mapping[str, Any]) -> LocalReplay:
        """This rank's replay of ``batch`` (a collective under FSDP2), fingerprinted group by group."""
        start = time.perf_counter()
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        hashes = [zero] * len(self.names)  # a group no gradient reached is reduce-scattered by no rank
        sqnorm = torch.zeros((), dtype=torch.float64, device=self.device)
        sketch = torch.zeros(self.sketcher.dim, dtype=torch.float32, device=self.device) if self.sketcher else None

        def on_local(index: int, local: Any) -> None:
            # On a GPU this runs on FSDP2's reduce-scatter stream; what it makes is read after the backward.
            nonlocal sqnorm
            hashes[index] = keep(tensor_bit_hash(local))
            sqnorm = keep(sqnorm + local.detach().to(torch.float64).square().sum())
            if sketch is not None and self.sketcher is not None:
                sketch.add_(self.sketcher(index, local.detach().reshape(-1).float()))

        loss = self._run(step, batch, on_local)
        # The parameters are all-gathered from one set of shards, so every rank replays from the same ones: no
        # parameter hash to compare (a shard that drifted is sharded_state's finding).
        fingerprint = fingerprint_row(torch.stack(hashes), zero, loss, sqnorm, sketch)
        return LocalReplay(grads=_Rerun(step, batch, sketch, sqnorm), fingerprint=fingerprint, seconds=time.perf_counter() - start)

    def spread(self, again: LocalReplay, first: LocalReplay) -> float:
        """‖g_again − g_first‖ / ‖g_first‖ from the two replays' sketches (relative error ~sqrt(2/p))."""
        a, b = again.grads, first.grads
        assert a.sketch is not None and b.sketch is not None, "the spread is measured in tolerance mode, with a sketch"
        norm = float(b.sqnorm) ** 0.5
        gap = float((a.sketch.double() - b.sketch.double()).norm())
        return gap / norm if norm > 0 else (0.0 if gap == 0 else float("inf"))

    def compare_to(self, grads: Any, reference_rank: int) -> list[tuple[float, float, int]]:
        """Collective: replay again, and each rank's exact difference from ``reference_rank``'s gradient of it.

        Per group one broadcast of the reference's local gradient, inside the reduce-scatter (extra memory: one
        group). Returns, per rank, ``(max |Δ|, ‖Δ‖ / ‖g_ref‖, index of the first group with Δ ≠ 0 or -1)``.
        """
        rerun: _Rerun = grads
        # The backward reduce-scatters the groups last to first; the sums keep the lowest index, the first in the model.
        sums = DifferenceSums(reference_rank, self.rank, self.device, keep=keep)
        self._run(rerun.step, rerun.batch, sums.add)
        return sums.gathered()
