"""``optimizer.step(closure)``: where a step's forward and backward run inside the step, the session's pre-step
work waits for the closure.

The session's global optimizer pre-step hook ends the probe step: the backward has synchronised the gradients,
the monitor gathers them, and the update has not run yet. A script that passes a closure runs its forward and
backward *inside* ``step()``: PyTorch Lightning's automatic optimization passes its whole training step
(``zero_grad``, ``training_step``, ``backward``) as the closure of every ``optimizer.step``, and torch's optimizers
call it first thing, before any update. Run at the hook, the pre-step work came before the step's forward: a
Lightning ``Trainer(strategy="ddp")`` was refused (exit 2, "stepped its optimizer before a forward through its
DistributedDataParallel model").

:class:`ClosureSteps` wraps the pre- and post-step hooks: without a closure the pre-step work runs at once; with
one, the hook hands ``step()`` a closure that calls the script's and then, after its first return, the pre-step
work. Only the first evaluation is the probe step's: an optimizer that evaluates its closure again (LBFGS's line
search) runs more backwards, which no step here accounts for. One that never calls it gets the pre-step work just
before its post-step hook, so every post-step has its pre-step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from healthcheck.measure.eager import eager

Hook = Callable[[Any, Any, Any], None]


class ClosureSteps:
    """``pre_hook`` and ``post_hook`` for torch's global optimizer step hooks, around ``pre`` and ``post``.

    >>> calls = []
    >>> steps = ClosureSteps(lambda opt, a, k: calls.append("pre"), lambda opt, a, k: calls.append("post"))
    >>> def closure():
    ...     calls.append("forward and backward")
    ...     return 1.0
    >>> args, kwargs = steps.pre_hook("opt", ("opt",), {"closure": closure})
    >>> kwargs["closure"](), calls
    (1.0, ['forward and backward', 'pre'])
    >>> steps.post_hook("opt", args, kwargs); calls[-1]
    'post'
    >>> steps.pre_hook("opt", ("opt",), {}) is None, calls[-1]  # no closure: at once
    (True, 'pre')
    """

    def __init__(self, pre: Hook, post: Hook):
        self._pre, self._post = pre, post
        self._pending: dict[int, int] = {}  #: per optimizer, deferred pre-steps whose closure has not returned yet

    def register(self) -> list[Any]:
        """Install both as torch's global optimizer step hooks; their handles.

        Run eagerly (:func:`~healthcheck.measure.eager.eager`): a script that compiles its optimizer step, as
        PyTorch's compiled-optimizer recipe does (``torch.compile`` of a function calling ``opt.step()``), has dynamo
        trace ``step()`` and the global hooks in it, and traced, the session's step work (loss sums read as floats,
        hashes, its collectives on the process group) broke the graph and then crashed every rank at step 0.
        """
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        return [register_optimizer_step_pre_hook(eager(self.pre_hook)), register_optimizer_step_post_hook(eager(self.post_hook))]

    def pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> Optional[tuple[tuple, dict]]:
        # torch hands the hooks step()'s arguments with the optimizer first: (optimizer, closure) when positional.
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if not callable(closure):
            self._pre(optimizer, args, kwargs)
            return None
        key = id(optimizer)
        self._pending[key] = self._pending.get(key, 0) + 1
        first = [True]

        def closure_then_step() -> Any:
            loss = closure()
            if first[0]:
                first[0] = False
                self._run_pending(optimizer, args, kwargs)
            return loss

        if "closure" in kwargs:
            return tuple(args), {**kwargs, "closure": closure_then_step}
        return (args[0], closure_then_step, *args[2:]), dict(kwargs)

    def post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        while self._pending.get(id(optimizer)):  # a closure step() never called
            self._run_pending(optimizer, args, kwargs)
        self._post(optimizer, args, kwargs)

    def _run_pending(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        if self._pending.get(key):
            self._pending[key] -= 1
            self._pre(optimizer, args, kwargs)
