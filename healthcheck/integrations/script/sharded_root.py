"""Which module an FSDP2 script trains: the root among its ``fully_shard`` calls, found as they are made.

Scripts shard bottom-up (blocks, then the root), as FSDP2 requires, so the last module sharded is the root,
unless it sits inside the current root (a block sharded after its parent). Until training starts each new
candidate takes over the loss capture and the forward pre-hooks from the previous one. At the root's first
forward the ranks first compare how they shard (:mod:`.shard_agreement`, ahead of FSDP2's own pre-forward hook,
whose all-gather a disagreement breaks); at its first training forward every sharded module must lie inside it.
Until the first update every root forward, there too, also compares where each rank is (:mod:`.lockstep`).
"""

from __future__ import annotations

from typing import Any, Callable

from healthcheck.errors import InvalidInput
from healthcheck.integrations.script.lockstep import Lockstep
from healthcheck.integrations.script.shard_agreement import check_agreement
from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.measure.eager import eager


class ShardedRoot:
    """Tracks a script's ``fully_shard`` calls on this rank and calls the session at the root's first forward.

    Args:
        watch: Starts the loss capture on a module; returns the handles that stop it.
        on_training: ``(root, forward args, forward kwargs)`` at the root's first training forward (FSDP2's lazy init has run).
        on_disagreement: ``(root, outcome)`` when the ranks shard differently, before any all-gather; it must end
            the run (no rank can train past the next all-gather).
        lockstep: Where the ranks are before the first update, told of every root forward.
    """

    def __init__(
        self,
        watch: Callable[[Any], list[Any]],
        on_training: Callable[[Any, Any, dict], None],
        on_disagreement: Callable[[Any, AuditOutcome], None],
        lockstep: Lockstep,
    ):
        self._watch, self._on_training, self._on_disagreement = watch, on_training, on_disagreement
        self.lockstep = lockstep
        self.root: Any = None  #: the outermost module sharded so far (the root, once training starts)
        self.sharded: list[Any] = []  #: every module passed to fully_shard
        self.pre_shard: list[tuple[str, int]] = []  #: (name, bit hash) of the weights before fully_shard sliced them
        self.started = False
        self._agreed = False
        self._handles: list[Any] = []

    def before(self, module: Any) -> None:
        """Hash the weights ``fully_shard`` is about to slice (the children's are sliced already)."""
        from healthcheck.measure.sharded_state import unsharded_weight_hashes

        self.pre_shard.extend(unsharded_weight_hashes(module))

    def add(self, module: Any) -> None:
        """``fully_shard(module)`` ran: the module becomes the root unless it sits inside the current one."""
        self.sharded.append(module)
        self.lockstep.start()
        if self.root is not None and any(m is module for m in self.root.modules()):
            return  # a block sharded after its parent: the root stays
        for handle in self._handles:
            handle.remove()
        self.root = module
        self._handles = [
            *self._watch(module),
            module.register_forward_pre_hook(eager(self._first_training_forward), with_kwargs=True),
            # Before FSDP2's own pre-forward hook (prepended at fully_shard).
            module.register_forward_pre_hook(eager(self._before_all_gather), prepend=True),
        ]

    def _before_all_gather(self, module: Any, args: Any) -> None:
        import torch

        from healthcheck.measure.fsdp_internals import gradient_sync

        if self.lockstep.updated:
            return
        if not self._agreed:
            self._agreed = True
            self.lockstep.first_forward()  # the others may be at a collective of the script's
            outcome = check_agreement(module)  # collective: every rank takes the same branch
            if not outcome.passed:
                self.started = True
                self._on_disagreement(module, outcome)
                return
        self.lockstep.forward(gradient_sync(module) if torch.is_grad_enabled() else None)

    def _first_training_forward(self, module: Any, args: Any, kwargs: dict) -> None:
        import torch

        if self.started or not torch.is_grad_enabled():
            return
        inside = {id(m) for m in module.modules()}
        if outside := [m for m in self.sharded if id(m) not in inside]:
            raise InvalidInput(
                f"the script shards modules outside the model it trains ({type(outside[0]).__name__} is not inside "
                f"{type(module).__name__}); a probe measures one trained model"
            )
        self.started = True
        self._on_training(module, args, kwargs)
