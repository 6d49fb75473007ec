"""What a script's own DDP comm hook is, as far as a worker can read it: its name, its state, its exact phase.

The reduction check (:mod:`healthcheck.judge.comm_hooks`) needs more than the hook's name. A wrapper
(``fp16_compress_wrapper(powerSGD_hook)``, accelerate's ``comm_wrapper=FP16``) is logged under the wrapper's name
whatever it wraps, so the state it was registered with says what is inside: a ``PowerSGDState`` is PowerSGD.
And PowerSGD (``start_powerSGD_iter``, 1,000 by default) and post-local SGD (``start_localSGD_iter``) all-reduce
exactly until their state's ``iter`` reaches that start: a probe of a few dozen steps runs entirely there, where
the reduction has a rounding bound like DDP's own. Each sampled step records whether it did.
"""

from __future__ import annotations

from typing import Any

from healthcheck.measure.local_grads import registered_comm_hook

#: The state attributes at which a hook stops all-reducing exactly (torch's PowerSGDState, PostLocalSGDState):
#: until ``state.iter`` reaches it, the hook returns ``default_hooks._allreduce_fut`` (divide by N, then sum).
EXACT_UNTIL = ("start_powerSGD_iter", "start_localSGD_iter")


def hook_facts(model: Any) -> dict[str, str]:
    """The environment facts of a DDP model's registered hook: ``ddp.comm_hook`` as DDP's logging names it ("none"
    without one, or where the monitor's own hook holds the slot; "?" where unreadable) and ``ddp.comm_hook_state``,
    the type of the state it was registered with ("none" for None or no hook)."""
    name = registered_comm_hook(model)
    state = _registered_state(model) if name else None
    return {
        "ddp.comm_hook": "?" if name is None else (name or "none"),
        "ddp.comm_hook_state": "none" if state is None else type(state).__name__,
    }


def step_extras(model: Any) -> dict[str, float]:
    """``{"comm_hook_exact": 1.0}`` where this step's reduction ran in the hook's exact phase, ``0.0`` past it;
    empty where the hook has no such phase. Read after the step's backward: the hook counted this step already.

    >>> class PowerSGDState:  # the attributes torch's has
    ...     iter, start_powerSGD_iter = 1000, 1000
    >>> class Ddp:
    ...     _comm_hooks = [(None, PowerSGDState())]
    ...     def _get_ddp_logging_data(self): return {"comm_hook": "powerSGD_hook"}
    >>> step_extras(Ddp())  # iter was 999 when the last bucket of this step went through: exact
    {'comm_hook_exact': 1.0}
    >>> PowerSGDState.iter = 1001
    >>> step_extras(Ddp())
    {'comm_hook_exact': 0.0}
    """
    if not registered_comm_hook(model):
        return {}
    state = _registered_state(model)
    for start in EXACT_UNTIL:
        first, count = getattr(state, start, None), getattr(state, "iter", None)
        if isinstance(first, int) and isinstance(count, int):
            return {"comm_hook_exact": 1.0 if count <= first else 0.0}
    return {}


def _registered_state(model: Any) -> Any:
    # DDP records each register_comm_hook call as (hook, state) in _comm_hooks (private, like the logging data
    # the name comes from); a built-in C++ hook leaves no entry.
    hooks = getattr(model, "_comm_hooks", None)
    return hooks[-1][1] if hooks else None
