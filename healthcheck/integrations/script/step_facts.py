"""What a rank reports with each optimizer step besides the monitor's numbers (gathered as per-rank extras).

* ``lr``: the learning rate of the optimizer's first parameter group as the rank stepped.
* ``lr_groups``: a digest of every parameter group's learning rate (:func:`rates_digest`), so that a rank whose other
  group steps with another rate is seen too (a schedule for the no-decay group alone). A number, to travel in the
  gathered vector; equal on two ranks exactly when their rates are, barring a CRC-32 collision (one in 2**32).
* ``grad_scale``: the scale of the ``torch.amp.GradScaler`` that stepped this optimizer in this step (fp16 mixed
  precision: PyTorch's AMP recipe, accelerate's and the Trainer's ``fp16``). The monitor measures the gradients DDP
  reduces, and the scaler multiplied those by its scale (2**16 to start): the step's norms are divided by it where
  every rank's is the same (:func:`healthcheck.measure.loss_scale.unscaled`). None without a scaler.
* ``scaler_skips``: the updates the scalers skipped whole since the rank's last probe step (None without a scaler,
  or with a disabled one: it never skips). A skipped update (an inf or NaN gradient) is no probe step
  (:class:`ScaleRecorder` says how it is told, :mod:`.scaler_skips` when it is whole): the session discards what the
  monitor recorded of it, the loss it captured and the forwards it counted.
* ``comm_hook_exact``: whether the script's comm hook still all-reduced exactly (:mod:`healthcheck.measure.script_hook`).

Every key is present on every rank, None where it does not apply: the gathered vector has one column per key.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Optional


class ScaleRecorder:
    """Which GradScaler is stepping which optimizer (``GradScaler.step`` is patched to tell, before it runs), and the
    updates skipped whole (:attr:`skips`, counted by the session: :mod:`.scaler_skips`). A scaler skips a step with an
    inf or NaN gradient in one of two ways: it does not call ``optimizer.step()`` at all (:meth:`skipped`, after it
    returns), or, for an optimizer that takes the scaling itself (``_step_supports_amp_scaling``: fused AdamW,
    transformers' Trainer's default with torch >= 2.8), it calls it with ``optimizer.found_inf`` set and the optimizer
    skips inside (:meth:`overflowed`, at that call).

    >>> class Scaler:
    ...     def get_scale(self): return 65536.0
    ...     def is_enabled(self): return True
    >>> scales, optimizer = ScaleRecorder(), object()
    >>> scales.observe(Scaler(), optimizer); scales.skipped(optimizer)  # an inf gradient: no optimizer step
    True
    >>> scales.skips += 1  # no other optimizer stepped on those gradients: the whole update
    >>> scales.observe(Scaler(), optimizer); scales.overflowed(optimizer), scales.take(optimizer), scales.skipped(optimizer)
    (False, (65536.0, 1), False)
    >>> scales.take(optimizer)  # once per step: the next step's GradScaler.step tells again
    (None, None)
    """

    def __init__(self) -> None:
        self._scalers: dict[int, Any] = {}
        self.skips = 0  #: updates skipped whole since the last probe step

    def observe(self, scaler: Any, optimizer: Any) -> None:
        self._scalers[id(optimizer)] = scaler

    def overflowed(self, optimizer: Any) -> bool:
        """Whether this call of ``optimizer.step()`` is one its scaler found an inf for (the optimizer skips inside)."""
        if id(optimizer) not in self._scalers or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        found = getattr(optimizer, "found_inf", None)
        return found is not None and float(found) > 0

    def take(self, optimizer: Any) -> tuple[Optional[float], Optional[int]]:
        """The scale this step's backward was multiplied by (read before ``GradScaler.update()``, which comes after
        ``step()``; a disabled scaler reads 1.0), and the updates skipped whole since the last probe step (None for a
        disabled scaler); Nones without a scaler."""
        scaler = self._scalers.pop(id(optimizer), None)
        if scaler is None:
            return None, None
        skips, self.skips = self.skips, 0
        return float(scaler.get_scale()), skips if scaler.is_enabled() else None

    def stepped(self, optimizer: Any) -> None:
        """Another optimizer of the update steps (:mod:`.updates`): its scale is the first one's."""
        self._scalers.pop(id(optimizer), None)

    def skipped(self, optimizer: Any) -> bool:
        """After ``GradScaler.step(optimizer)``: whether it skipped the optimizer's step (no :meth:`take` or
        :meth:`stepped` in it)."""
        return self._scalers.pop(id(optimizer), None) is not None


def step_facts(optimizer: Any, model: Any, scales: ScaleRecorder) -> dict[str, Optional[float]]:
    """``lr``, ``lr_groups``, ``grad_scale`` and ``comm_hook_exact`` for this rank's step (see the module docstring)."""
    from healthcheck.measure import script_hook

    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    scale, skips = scales.take(optimizer)
    return {
        "lr": float(lr) if isinstance(lr, (int, float)) else None,
        "lr_groups": rates_digest(optimizer.param_groups),
        "grad_scale": scale,
        "scaler_skips": None if skips is None else float(skips),
        "comm_hook_exact": script_hook.step_extras(model).get("comm_hook_exact"),
    }


def rates_digest(groups: Any) -> Optional[float]:
    """The CRC-32 of every group's learning rate as float64 bytes, as a float (exact: under 2**32); None where a
    group's rate is not a plain number (a tensor ``lr``) or there are no groups.

    >>> rates_digest([{"lr": 1e-3}, {"lr": 1e-3}]) == rates_digest([{"lr": 1e-3}, {"lr": 1e-3}])
    True
    >>> rates_digest([{"lr": 1e-3}, {"lr": 1e-3}]) == rates_digest([{"lr": 1e-3}, {"lr": 1e-2}])
    False
    >>> rates_digest([{"lr": 1e-3}, {"lr": None}]), rates_digest([])
    (None, None)
    """
    rates = [group.get("lr") for group in groups]
    if not rates or not all(isinstance(rate, (int, float)) for rate in rates):
        return None
    return float(zlib.crc32(struct.pack(f"<{len(rates)}d", *rates)))


def patch(patches: Any, observe: Any, stepped: Any) -> None:
    """Have ``torch.amp.GradScaler.step`` call ``observe(scaler, optimizer)`` before it runs and ``stepped(optimizer)``
    when it returns. ``torch.cuda.amp.GradScaler`` and FSDP's ``ShardedGradScaler`` inherit it."""
    from torch.amp import grad_scaler

    def step(original: Any) -> Any:
        def step_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            observe(self, optimizer)
            out = original(self, optimizer, *args, **kwargs)
            stepped(optimizer)
            return out

        return step_

    patches.wrap(grad_scaler.GradScaler, "step", step)
