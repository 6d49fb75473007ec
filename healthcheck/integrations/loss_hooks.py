"""The process-wide patches through which :class:`~healthcheck.integrations.loss_capture.LossCapture` sees a
script's loss functions, and what it reads off a call.

* ``torch.nn.functional.cross_entropy`` (which ``nn.CrossEntropyLoss`` and Hugging Face models call), patched
  while any capture is active;
* transformers' ``LabelSmoother.__call__`` (the Trainer's ``label_smoothing_factor``), patched once a capture
  watches a model and only if the script has imported transformers' trainer: healthcheck never imports it.

Each wrapper calls the original, then reports the call and its result to every active capture (:data:`ACTIVE`).
Both are held by one :class:`~healthcheck.integrations.script.patches.Patches`, and :func:`unpatch` puts both back.
"""

from __future__ import annotations

from typing import Any

from healthcheck.integrations.script.patches import Patches
from healthcheck.measure.eager import eager_partial

IGNORE_INDEX = -100

#: The captures the patched functions report to (``LossCapture.__enter__`` appends, ``close`` removes).
ACTIVE: list[Any] = []
#: The loss functions wrapped now (at most once each, whatever the number of captures).
_PATCHES = Patches()


#: What :func:`cross_entropy_settings` reads off a call, in its order.
SETTING_NAMES = ("reduction", "ignore_index", "label_smoothing", "weight", "targets", "dtype")


def cross_entropy_settings(kwargs: dict, target: Any, result: Any) -> tuple[str, ...]:
    """One cross-entropy call's settings (:data:`SETTING_NAMES`) as comparable strings; ``dtype`` is the result's,
    the precision the loss was computed in (autocast computes it in fp32 whatever the logits' dtype).

    >>> import torch
    >>> cross_entropy_settings({"label_smoothing": 0.1}, torch.tensor([1]), torch.tensor(0.5))
    ('mean', '-100', '0.1', 'none', 'class indices', 'float32')
    """
    import hashlib

    weight = kwargs.get("weight")
    if weight is not None:
        # A class-weight vector is small; its digest tells two ranks' weights apart.
        weight = "sha256 " + hashlib.sha256(weight.detach().float().cpu().numpy().tobytes()).hexdigest()[:8]
    return (
        str(kwargs.get("reduction", "mean")),
        str(kwargs.get("ignore_index", IGNORE_INDEX)),
        f"{float(kwargs.get('label_smoothing', 0.0)):g}",
        weight or "none",
        "probabilities" if target.is_floating_point() else "class indices",
        str(result.dtype).removeprefix("torch."),
    )


def when_trained(result: Any, record: Any) -> None:
    """Call ``record()`` once the backward hands ``result`` a gradient: a loss computed only to be logged (rank 0's
    per-token losses, say) gets none, or a None one where no gradient reached it (:mod:`.loss_weight`).

    >>> import torch
    >>> seen = []
    >>> x = torch.ones(2, requires_grad=True)
    >>> trained, logged = x.sum(), x.sum() * 2
    >>> when_trained(trained, lambda: seen.append("trained")); when_trained(logged, lambda: seen.append("logged"))
    >>> trained.backward(); seen
    ['trained']
    """
    if getattr(result, "requires_grad", False):
        result.register_hook(eager_partial(lambda grad: record() if grad is not None else None))


def patch_cross_entropy() -> None:
    import torch.nn.functional as F

    def wrap(original: Any) -> Any:
        def cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(input, target, *args, **kwargs)
            if ACTIVE:
                named = dict(zip(("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"), args, strict=False))
                named.update(kwargs)
                for capture in ACTIVE:
                    capture.observe_cross_entropy(input, target, named, result)
            return result

        return cross_entropy

    if not _PATCHES.holds(F, "cross_entropy"):
        _PATCHES.wrap(F, "cross_entropy", wrap)


def patch_label_smoother() -> None:
    """Wrap transformers' ``LabelSmoother.__call__`` where the script has imported it (never imported here)."""
    import sys

    smoother = getattr(sys.modules.get("transformers.trainer_pt_utils"), "LabelSmoother", None)

    def wrap(original: Any) -> Any:
        def __call__(self: Any, model_output: Any, labels: Any, shift_labels: bool = False, **kwargs: Any) -> Any:
            result = original(self, model_output, labels, shift_labels=shift_labels, **kwargs)
            for capture in ACTIVE:
                capture.observe_label_smoother(self, labels, shift_labels, kwargs.get("num_items_in_batch"), result)
            return result

        return __call__

    if smoother is not None and not _PATCHES.holds(smoother, "__call__"):
        _PATCHES.wrap(smoother, "__call__", wrap)


def unpatch() -> None:
    """Put back every loss function wrapped here."""
    _PATCHES.restore()
