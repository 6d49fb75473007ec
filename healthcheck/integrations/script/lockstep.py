"""Until the first update, where each rank is, compared wherever the ranks must meet next.

Before its first optimizer step a rank with its own gradient accumulation (a per-node ``gradient_accumulation_steps``)
runs a forward while the others reduce, clip or step. Their next collectives do not pair: DDP's gradient all-reduce
meets a script's ``all_gather``, FSDP2's all-gather meets a clip's all-reduce, and the ranks crash in gloo (``Received
data size doesn't match``) or hang until ``distributed.timeout_s``: exit 3, and no rank named. A plain accelerate loop
that gathers each micro-batch's loss for logging, with 4 micro-batches on one rank and 2 on the others, ended so under
DDP (after the timeout) and under FSDP2. So until then each rank says where it is (:func:`lockstep_fact`) and the ranks
compare it (one small gather):

* at the model's first forward, before any collective of its own (:meth:`Lockstep.first_forward`);
* at every forward of the trained model: under FSDP2 every root forward (each all-gathers), under DDP every forward
  with autograd on (each prepares a gradient all-reduce, or none under ``no_sync``), compared inside DDP's forward,
  after its buffer broadcast (:meth:`Lockstep.attach_ddp` says why);
* at each clip of an FSDP2 model's gradients (the norm of sharded gradients is an all-reduce);
* at each collective the script calls itself on the default group (:func:`compared_first`), once the data-parallel
  model exists (:meth:`Lockstep.start`);
* at the first update.

Where they differ every rank stops there (exit 1), the environment audit naming the rank that differs. After the
first update nothing is compared: the per-step exchange and the audits take over.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

from healthcheck.integrations.script.shard_agreement import ranks_agree
from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.measure.eager import eager

#: The environment fact that says where a rank is before its first update (:func:`lockstep_fact`).
LOCKSTEP = "train.before_first_update"
_PLACES = {"step": "optimizer step", "clip": "gradient clipping"}
#: Where a rank is at the model's first forward (:meth:`Lockstep.first_forward`), whatever ran before it.
FIRST_FORWARD = "the model's first forward"


def lockstep_fact(forwards: int, at: str = "forward", sync: Optional[str] = None) -> str:
    """Where a rank is: at forward ``forwards`` (its backward's gradient sync "on" or "off", None without
    autograd), or after that many forwards at the optimizer step, a clip, or one of the script's collectives.

    >>> lockstep_fact(2, sync="on"), lockstep_fact(3)
    ('forward 2 (gradient sync on)', 'forward 3 (no grad)')
    >>> lockstep_fact(2, "step"), lockstep_fact(1, "clip")
    ('optimizer step after 2 forwards', 'gradient clipping after 1 forward')
    >>> lockstep_fact(2, "all_gather_into_tensor")
    "the script's torch.distributed.all_gather_into_tensor after 2 forwards"
    """
    if at == "forward":
        return f"forward {forwards} ({'no grad' if sync is None else f'gradient sync {sync}'})"
    place = _PLACES.get(at) or f"the script's torch.distributed.{at}"
    return f"{place} after {forwards} forward{'' if forwards == 1 else 's'}"


def check_lockstep(fact: str) -> AuditOutcome:
    """Collective: gather every rank's :func:`lockstep_fact` and compare them (the same outcome on every rank)."""
    return ranks_agree({LOCKSTEP: fact})


class Lockstep:
    """This rank's place before its first update, compared at each of the places in the module docstring.

    Args:
        on_disagreement: Called with the failed comparison; it must end the run (the ranks' next collectives do not
            pair).
    """

    def __init__(self, on_disagreement: Callable[[AuditOutcome], None]):
        self._on_disagreement = on_disagreement
        self.forwards = 0  #: forwards of the trained model so far
        self.fact: Optional[str] = None  #: where this rank last said it was
        self.started = False  #: the data-parallel model exists: the script's collectives are compared from here
        self.updated = False
        self._first = False  # the model's first forward was compared
        self._inside: Any = None  # the DDP model whose forward runs, until its wrapped module's forward starts
        #: The wrapped module's forward now running came through DDP with gradient sync on: its backward all-reduces.
        #: A call of ``model.module(...)`` does not (DDP never prepared its reducer for it), whatever no_sync says.
        self.reducing = False

    def forward(self, sync: Optional[str]) -> None:
        """A forward of the trained model: ``sync`` "on" or "off" (its backward reduces or not), None without autograd."""
        if self.updated:
            return
        self.forwards += 1
        self._compare(lockstep_fact(self.forwards, sync=sync))

    def start(self) -> None:
        """The data-parallel model exists (DDP wrapped it, or ``fully_shard`` ran): from here until the first update
        the script's collectives are compared. A Trainer gathers each step's token count before its forwards, so a
        rank set not to (``average_tokens_across_devices=False`` on one node) went to its first forward while the
        others gathered, and gloo aborted on the sizes before any forward was compared."""
        self.started = True

    def first_forward(self) -> None:
        """The model's first forward, with or without autograd, ahead of any collective of its own: the others may be
        at one of the script's collectives."""
        if not self._first and not self.updated:
            self._first = True
            self._compare(FIRST_FORWARD)

    def attach_ddp(self, ddp: Any) -> list[Any]:
        """Compare each forward of the DDP model ``ddp`` with autograd on; returns the hooks' handles.

        With autograd on a forward prepares DDP's gradient all-reduce, or (``no_sync``) none. One without is no
        training forward, and no rank need run it: a script that logs a validation loss on rank 0 before it trains
        does. Yet DDP's first forward broadcasts the module's buffers (a Llama's rotary frequencies), autograd on or
        not, and torch pairs rank 0's evaluation broadcast with the others' first training forward's. Compared before
        DDP's forward, the others' comparison met that broadcast, and a script that runs under torchrun hung.
        Compared in the wrapped module's pre-hook, after the broadcast, every rank has issued the same collectives.
        A call of the wrapped module itself (``model.module(...)``) runs outside DDP and is left alone.
        """
        self.start()
        # torch's composable replicate() runs DDP's pre-forward in a hook of the model itself (:mod:`.replicated`).
        after_pre_forward = getattr(ddp, "register_module_pre_hook", None)
        return [ddp.register_forward_pre_hook(eager(self._entered)),
                ddp.register_forward_hook(eager(self._left), always_call=True),
                after_pre_forward(eager(self._ddp_forward)) if after_pre_forward is not None
                else ddp.module.register_forward_pre_hook(eager(self._ddp_forward), prepend=True)]

    def _entered(self, ddp: Any, args: Any) -> None:
        self._inside = ddp

    def _left(self, ddp: Any, args: Any, output: Any) -> None:
        self._inside = None

    def _ddp_forward(self, module: Any, args: Any) -> None:
        import torch

        ddp, self._inside = self._inside, None
        self.reducing = ddp is not None and bool(getattr(ddp, "require_backward_grad_sync", False))
        if ddp is not None and torch.is_grad_enabled():
            self.forward("on" if ddp.require_backward_grad_sync else "off")

    def at(self, place: str) -> None:
        """A clip ("clip") or one of the script's collectives (its name), once the data-parallel model exists."""
        if self.started and not self.updated:
            self._compare(lockstep_fact(self.forwards, place))

    def first_update(self) -> None:
        """The first optimizer step: compared a last time."""
        if not self.updated:
            self.updated = True
            self._compare(lockstep_fact(self.forwards, "step"))

    def _compare(self, fact: str) -> None:
        self.fact = fact
        outcome = check_lockstep(fact)  # collective, at the same place on every rank until one differs
        if not outcome.passed:
            self._on_disagreement(outcome)


def compared_first(method: Callable[..., Any], name: str, lockstep: Callable[[], Lockstep]) -> Callable[..., Any]:
    """``method``, the ``torch.distributed`` collective ``name``: called by the script on the default group before
    the first update, the ranks first compare where they are.

    Only the script's calls: healthcheck's own and torch's (FSDP2's, SyncBatchNorm's) sit at the same place on every
    rank by construction. A call on another group is left alone: the ranks outside it rightly skip it.

    >>> __name__ = "train"  # this example's calls come from a script's module
    >>> steps = Lockstep(print)
    >>> steps.started, steps._compare = True, print
    >>> compared_first(lambda tensor, group=None: tensor, "all_reduce", lambda: steps)(1)
    the script's torch.distributed.all_reduce after 0 forwards
    1
    >>> compared_first(lambda tensor, group=None: tensor, "all_reduce", lambda: steps)(1, group=object())
    1
    """
    try:
        position: Optional[int] = list(inspect.signature(method).parameters).index("group")
    except ValueError:  # no group argument (a barrier of another torch): the default group
        position = None

    @functools.wraps(method)
    def compared(*args: Any, **kwargs: Any) -> Any:
        steps = lockstep()
        if steps.started and not steps.updated and _by_script(sys._getframe(1)) and _default_group(args, kwargs, position):
            steps.at(name)
        return method(*args, **kwargs)

    return compared


def _by_script(frame: Any) -> bool:
    module = str(frame.f_globals.get("__name__", ""))
    return not any(module == root or module.startswith(f"{root}.") for root in ("healthcheck", "torch"))


def _default_group(args: tuple, kwargs: dict, position: Optional[int]) -> bool:
    group = kwargs["group"] if "group" in kwargs else (args[position] if position is not None and len(args) > position else None)
    if group is None:
        return True
    import torch.distributed as dist

    return group is dist.group.WORLD
