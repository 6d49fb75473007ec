"""The process-wide patches through which :class:`~healthcheck.integrations.loss_capture.LossCapture` sees a
script's loss functions, and what it reads off a call.

* ``torch.nn.functional.cross_entropy`` (which ``nn.CrossEntropyLoss`` and Hugging Face models call), patched
  while any capture is active;
* transformers' ``LabelSmoother.__call__`` (the Trainer's ``label_smoothing_factor``), patched once a capture
  watches a model and only if the script has imported transformers' trainer: healthcheck never imports it.

Each wrapper calls the original, then reports the call and its result to every active capture (:data:`ACTIVE`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

IGNORE_INDEX = -100

#: The captures the patched functions report to (``LossCapture.__enter__`` appends, ``close`` removes).
ACTIVE: list[Any] = []
_ORIGINAL_CROSS_ENTROPY: Optional[Callable[..., Any]] = None


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


def patch_cross_entropy() -> None:
    global _ORIGINAL_CROSS_ENTROPY
    import torch.nn.functional as F

    if _ORIGINAL_CROSS_ENTROPY is not None:
        return
    original = F.cross_entropy
    _ORIGINAL_CROSS_ENTROPY = original

    @functools.wraps(original)
    def cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(input, target, *args, **kwargs)
        if ACTIVE:
            named = dict(zip(("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"), args, strict=False))
            named.update(kwargs)
            for capture in ACTIVE:
                capture.observe_cross_entropy(input, target, named, result)
        return result

    F.cross_entropy = cross_entropy


_ORIGINAL_LABEL_SMOOTHER: Optional[Callable[..., Any]] = None


def patch_label_smoother() -> None:
    """Wrap transformers' ``LabelSmoother.__call__`` where the script has imported it (never imported here)."""
    global _ORIGINAL_LABEL_SMOOTHER
    import sys

    module = sys.modules.get("transformers.trainer_pt_utils")
    smoother = getattr(module, "LabelSmoother", None)
    if smoother is None or _ORIGINAL_LABEL_SMOOTHER is not None:
        return
    original = smoother.__call__
    _ORIGINAL_LABEL_SMOOTHER = original

    @functools.wraps(original)
    def __call__(self: Any, model_output: Any, labels: Any, shift_labels: bool = False, **kwargs: Any) -> Any:
        result = original(self, model_output, labels, shift_labels=shift_labels, **kwargs)
        for capture in ACTIVE:
            capture.observe_label_smoother(self, labels, shift_labels, kwargs.get("num_items_in_batch"), result)
        return result

    smoother.__call__ = __call__


def unpatch_label_smoother() -> None:
    global _ORIGINAL_LABEL_SMOOTHER
    import sys

    smoother = getattr(sys.modules.get("transformers.trainer_pt_utils"), "LabelSmoother", None)
    if smoother is not None and _ORIGINAL_LABEL_SMOOTHER is not None:
        smoother.__call__ = _ORIGINAL_LABEL_SMOOTHER
    _ORIGINAL_LABEL_SMOOTHER = None


def unpatch_cross_entropy() -> None:
    global _ORIGINAL_CROSS_ENTROPY
    import torch.nn.functional as F

    if _ORIGINAL_CROSS_ENTROPY is not None:
        F.cross_entropy = _ORIGINAL_CROSS_ENTROPY
        _ORIGINAL_CROSS_ENTROPY = None
