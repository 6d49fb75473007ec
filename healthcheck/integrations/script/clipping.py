"""How a script clips its model's gradients, as facts for the environment audit.

Why: under FSDP2 each rank clips only its own shard, by a coefficient it computes from the global norm and
its *own* ``max_norm``. A rank with another ``max_norm`` (a per-node config, a Trainer's ``max_grad_norm``)
scales its slice of every update differently, and nothing replicated differs: in a 10-step probe of a
torchtitan-style script with ``max_norm`` 0.1 on one of 4 ranks, every statistic and audit passed. Under DDP
the parameters drift apart, but only after the clip first bites. The setting itself is exact evidence.

The patched functions (``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``,
which ``accelerate`` and ``transformers.Trainer`` call too) report each call with the model's parameters in
it, until the first optimizer step reads :meth:`ClipRecorder.facts`.

A clip by the norm can be written in two calls: ``get_total_norm`` of the gradients, then ``clip_grads_with_norm_``
(torchtitan's, and accelerate's for every model from 1.16: the norm of sharded gradients is reduced between them).
The pair is the same setting as one ``clip_grad_norm_`` and reads alike; and under FSDP2 the ranks compare where
they are at the first call, since the reduction follows it (with the lockstep at ``clip_grads_with_norm_`` alone, a
Trainer rank with its own gradient accumulation hung in that reduction under accelerate 1.16 instead of being named).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from healthcheck.measure.eager import eager

#: Function name -> the keyword of its clipping threshold (also its first argument after the parameters).
CLIP_FUNCTIONS = {"clip_grad_norm_": "max_norm", "clip_grads_with_norm_": "max_norm", "clip_grad_value_": "clip_value"}
#: The first call of a clip written in two (it takes the gradients, not the parameters); torch 2.6 and later.
NORM_FUNCTION = "get_total_norm"


class ClipRecorder:
    """The first step's clipping calls on one model (its parameters are given by ``owned``).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> clips = ClipRecorder(lambda: {id(w)})
    >>> other = torch.nn.Parameter(torch.ones(1))  # another module's: not recorded
    >>> clips.observe("clip_grad_norm_", [w], (1.0,), {"norm_type": 2.0}), clips.observe("clip_grad_value_", [other], (1.0,), {})
    (True, False)
    >>> clips.facts()
    {'clip': 'clip_grad_norm_ max_norm=1 norm_type=2'}
    >>> clips.facts()  # read once: later calls are the same setting or a schedule, not compared
    {}

    The two-call clip reads as the one call (``grads`` gives the ids of the model's gradients):

    >>> w.grad = torch.ones(3)
    >>> clips = ClipRecorder(lambda: {id(w)}, lambda: {id(w.grad)})
    >>> total = torch.nn.utils.get_total_norm([w.grad])
    >>> clips.observe("get_total_norm", [w.grad], (), {}), clips.observe("clip_grads_with_norm_", [w], (1.0, total), {})
    (True, True)
    >>> clips.facts()
    {'clip': 'clip_grad_norm_ max_norm=1 norm_type=2'}
    """

    def __init__(self, owned: Callable[[], set[int]], grads: Callable[[], set[int]] = set):
        self.owned = owned
        self.grads = grads
        self._calls: Optional[set[str]] = set()
        self._norm_type: Optional[str] = None  # the norm of the model's gradients a clip_grads_with_norm_ may follow

    def observe(self, name: str, tensors: list[Any], args: tuple, kwargs: dict) -> bool:
        """Record a clip before the first step; whether it was of the model's gradients (then it was recorded).
        ``tensors``: the parameters, or the gradients for :data:`NORM_FUNCTION`."""
        if self._calls is None:  # after the first step: nothing more to record (no set of the model's gradients built)
            return False
        owned = self.grads() if name == NORM_FUNCTION else self.owned()
        if not owned.intersection(id(t) for t in tensors):
            return False
        if name == NORM_FUNCTION:
            self._norm_type = _number(kwargs.get("norm_type", args[0] if args else 2.0))
            return True
        keyword = CLIP_FUNCTIONS[name]
        threshold = kwargs.get(keyword, args[0] if args else None)
        if name == "clip_grads_with_norm_" and self._norm_type is not None:
            name, norm_type, self._norm_type = "clip_grad_norm_", self._norm_type, None
        else:
            norm_type = _number(kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0))
        setting = f"{name} {keyword}={_number(threshold)}"
        if name == "clip_grad_norm_":
            setting += f" norm_type={norm_type}"
        self._calls.add(setting)
        return True

    def facts(self) -> dict[str, str]:
        """``{"clip": ...}``: the distinct settings, or ``none`` (no clipping before the first step); ``{}`` after."""
        if self._calls is None:
            return {}
        calls, self._calls = self._calls, None
        return {"clip": " | ".join(sorted(calls)) or "none"}


def _number(value: Any) -> str:
    """A threshold as text: a tensor's value, ``inf`` for no limit.

    >>> _number(1.0), _number(float("inf")), _number("inf")
    ('1', 'inf', 'inf')
    """
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return str(value)


def grad_ids(model: Any) -> set[int]:
    """The ids of ``model``'s gradients (none before the model exists).

    >>> grad_ids(None)
    set()
    """
    return set() if model is None else {id(p.grad) for p in model.parameters() if p.grad is not None}


def patch(patches: Any, on_clip: Callable[[str, list[Any], tuple, dict], None]) -> None:
    """Wrap the clipping functions in both of their homes (``torch.nn.utils`` re-exports ``clip_grad``'s), and
    ``torch.nn.utils.get_total_norm`` (torch's own ``clip_grad_norm_`` calls its private twin, not this one)."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    # Eager: a script that compiles its clipping with its optimizer step (PyTorch's compiled-optimizer recipe) has
    # dynamo trace this wrapper, and traced, on_clip saw fake tensors, matched none of the model's gradients and
    # recorded no clip (`clip` read `none` on every rank). The clip itself stays in the script's graph.
    on_clip = eager(on_clip)

    def wrap(name: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
                import torch

                # A generator (model.parameters()) is read once here, so the original gets the list.
                params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                on_clip(name, params, args, kwargs)
                return original(params, *args, **kwargs)

            return clip

        return make

    for name in (*CLIP_FUNCTIONS, NORM_FUNCTION):
        for home in (utils, clip_grad):
            if hasattr(home, name):  # get_total_norm: torch.nn.utils' alone, and from torch 2.6
                patches.wrap(home, name, wrap(name))
