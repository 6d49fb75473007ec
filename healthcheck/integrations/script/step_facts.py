"""What a rank reports with each optimizer step besides the monitor's numbers (gathered as per-rank extras).

* ``lr``: the learning rate of the optimizer's first parameter group as the rank stepped.
* ``grad_scale``: the scale of the ``torch.amp.GradScaler`` that unscaled this optimizer in this step (fp16 mixed
  precision: PyTorch's AMP recipe, accelerate's and the Trainer's ``fp16``). The monitor measures the gradients DDP
  reduces, and the scaler multiplied those by its scale (2**16 to start): the step's norms are divided by it where
  every rank's is the same (:func:`healthcheck.measure.loss_scale.unscaled`). None without a scaler.
* ``scaler_skips``: the steps that scaler skipped since the rank's last probe step. A skipped step (an inf or NaN
  gradient) never calls ``optimizer.step()``, so it is not a probe step: the session drops the loss it captured, and
  the next backward's buckets replace the monitor's numbers.
* ``comm_hook_exact``: whether the script's comm hook still all-reduced exactly (:mod:`healthcheck.measure.script_hook`).

Every key is present on every rank, None where it does not apply: the gathered vector has one column per key.
"""

from __future__ import annotations

from typing import Any, Optional


class ScaleRecorder:
    """Which GradScaler unscaled which optimizer in the current step (``GradScaler.unscale_`` is patched to tell),
    and the steps it skipped (``GradScaler.step`` returned without the optimizer's step taking the scale).

    >>> class Scaler:
    ...     def get_scale(self): return 65536.0
    >>> scales, optimizer = ScaleRecorder(), object()
    >>> scales.observe(Scaler(), optimizer); scales.skipped(optimizer)  # an inf gradient: no optimizer step
    True
    >>> scales.observe(Scaler(), optimizer); scales.take(optimizer), scales.skipped(optimizer)
    ((65536.0, 1), False)
    >>> scales.take(optimizer)  # once per step: the next step's unscale_ tells again
    (None, None)
    """

    def __init__(self) -> None:
        self._scalers: dict[int, Any] = {}
        self._skips: dict[int, int] = {}

    def observe(self, scaler: Any, optimizer: Any) -> None:
        self._scalers[id(optimizer)] = scaler

    def take(self, optimizer: Any) -> tuple[Optional[float], Optional[int]]:
        """The scale this step's backward was multiplied by (read before ``GradScaler.update()``, which comes after
        ``step()``; a disabled scaler reads 1.0), and the steps its scaler skipped since the last one; Nones without."""
        scaler = self._scalers.pop(id(optimizer), None)
        if scaler is None:
            return None, None
        return float(scaler.get_scale()), self._skips.pop(id(optimizer), 0)

    def skipped(self, optimizer: Any) -> bool:
        """After ``GradScaler.step(optimizer)``: whether it skipped the optimizer's step (no :meth:`take` in it)."""
        if self._scalers.pop(id(optimizer), None) is None:
            return False
        self._skips[id(optimizer)] = self._skips.get(id(optimizer), 0) + 1
        return True


def step_facts(optimizer: Any, model: Any, scales: ScaleRecorder) -> dict[str, Optional[float]]:
    """``lr``, ``grad_scale`` and ``comm_hook_exact`` for this rank's step (see the module docstring)."""
    from healthcheck.measure import script_hook

    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    scale, skips = scales.take(optimizer)
    return {
        "lr": float(lr) if isinstance(lr, (int, float)) else None,
        "grad_scale": scale,
        "scaler_skips": None if skips is None else float(skips),
        "comm_hook_exact": script_hook.step_extras(model).get("comm_hook_exact"),
    }


def patch(patches: Any, observe: Any, stepped: Any) -> None:
    """Have ``torch.amp.GradScaler.unscale_`` (which ``step()`` calls where the script did not) call ``observe(scaler,
    optimizer)``, and ``GradScaler.step`` call ``stepped(optimizer)`` when it returns. ``torch.cuda.amp.GradScaler``
    is a subclass and inherits both; FSDP's ``ShardedGradScaler`` has its own ``unscale_``, wrapped too."""
    from torch.amp import grad_scaler

    def unscale(original: Any) -> Any:
        def unscale_(self: Any, optimizer: Any) -> Any:
            out = original(self, optimizer)
            observe(self, optimizer)
            return out

        return unscale_

    def step(original: Any) -> Any:
        def step_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, optimizer, *args, **kwargs)
            stepped(optimizer)
            return out

        return step_

    patches.wrap(grad_scaler.GradScaler, "unscale_", unscale)
    patches.wrap(grad_scaler.GradScaler, "step", step)
    try:  # FSDP's ShardedGradScaler has its own unscale_ (and inherits step)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:
        return
    patches.wrap(ShardedGradScaler, "unscale_", unscale)
