"""How a script clips its model's gradients, as facts for the environment audit.

Why: under FSDP2 each rank clips only its own shard, by a coefficient it computes from the global norm and
its *own* ``max_norm``. A rank with another ``max_norm`` (a per-node config, a Trainer's ``max_grad_norm``)
scales its slice of every update differently, and nothing replicated differs: in a 10-step probe of a
torchtitan-style script with ``max_norm`` 0.1 on one of 4 ranks, every statistic and audit passed. Under DDP
the parameters drift apart, but only after the clip first bites. The setting itself is exact evidence.

The patched functions (``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``,
which ``accelerate`` and ``transformers.Trainer`` call too) report each call with the model's parameters in
it, until the first optimizer step reads :meth:`ClipRecorder.facts`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

#: Function name -> the keyword of its clipping threshold (also its first argument after the parameters).
CLIP_FUNCTIONS = {"clip_grad_norm_": "max_norm", "clip_grads_with_norm_": "max_norm", "clip_grad_value_": "clip_value"}


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
    """

    def __init__(self, owned: Callable[[], set[int]]):
        self.owned = owned
        self._calls: Optional[set[str]] = set()

    def observe(self, name: str, parameters: list[Any], args: tuple, kwargs: dict) -> bool:
        """Record a clip before the first step; whether it clipped the model's gradients (then it was recorded)."""
        if self._calls is None or not self.owned().intersection(id(p) for p in parameters):
            return False
        keyword = CLIP_FUNCTIONS[name]
        threshold = kwargs.get(keyword, args[0] if args else None)
        setting = f"{name} {keyword}={_number(threshold)}"
        if name == "clip_grad_norm_":
            setting += f" norm_type={_number(kwargs.get('norm_type', args[1] if len(args) > 1 else 2.0))}"
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


def patch(patches: Any, on_clip: Callable[[str, list[Any], tuple, dict], None]) -> None:
    """Wrap the clipping functions in both of their homes (``torch.nn.utils`` re-exports ``clip_grad``'s)."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

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

    for name in CLIP_FUNCTIONS:
        for home in (utils, clip_grad):
            patches.wrap(home, name, wrap(name))
