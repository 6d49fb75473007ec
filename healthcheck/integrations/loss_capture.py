"""Each rank's own loss for one optimizer step, taken from a training script that knows nothing about it.

A micro-batch starts with each forward of the watched model under autograd (evaluation forwards run
without gradients and are ignored). Within it, the summed token loss S and the number of
loss-carrying tokens N come from the first source that saw them:

1. ``healthcheck.record_loss(loss, tokens)``, the one optional call for custom losses;
2. a fused output with ``log_probs`` and ``label_mask`` (TRL's ``SFTTrainer``: no cross-entropy call
   happens, S = −Σ log_probs, N = Σ label_mask);
3. ``torch.nn.functional.cross_entropy`` (which ``nn.CrossEntropyLoss`` and Hugging Face models call):
   S is recovered exactly from the call's own result and reduction (``mean`` × N, ``sum``, ``none``
   summed), N counts the targets that are not ``ignore_index``;
   transformers' ``LabelSmoother`` (the Trainer's ``label_smoothing_factor``, which takes the labels away from
   the model) counts as one: S is its result times its denominator, N its label count;
4. the model output's ``loss`` times ``num_items_in_batch`` when the Trainer passed it (S / N_global
   then, with N_global the count over every rank), else times the label count.

The step's loss is S/N summed over its micro-batches: the token-weighted mean of this rank's step,
whatever scaling the trainer applied afterwards (transformers multiplies by the world size, TRL
divides by a global count). Where no source is unambiguous the loss is not measured and the reason
says why; a number is never silently rescaled. No host sync happens until :meth:`LossCapture.take`.

Outside a probe, :func:`record_loss` does nothing, so a script may call it unconditionally.

A ``torch.compile``'d model: the hooks run eagerly (:mod:`healthcheck.measure.eager`), so the model's
``loss`` output is seen. A cross-entropy inside the compiled graph is not: dynamo takes the patched
``F.cross_entropy`` for torch's own (its rules look the function up by name), evaluates it once on fake
tensors while tracing, and the compiled code never calls it again. Those fake results are ignored, and a
step with no other source says that its loss ran inside compiled code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Optional

from healthcheck.integrations.cross_entropy_calls import resolve_calls
from healthcheck.integrations.loss_graph import LossGraph
from healthcheck.integrations.loss_hooks import (
    ACTIVE,
    IGNORE_INDEX,
    SETTING_NAMES,
    cross_entropy_settings,
    patch_cross_entropy,
    patch_label_smoother,
    unpatch,
    when_trained,
)
from healthcheck.integrations.loss_weight import WeightProbe, step_weight
from healthcheck.integrations.target_shift import TargetShifts, token_ids
from healthcheck.measure.eager import eager


@dataclasses.dataclass
class StepLoss:
    """One rank's loss for one optimizer step: the token-weighted mean, or why it is not measured."""

    loss: Optional[float]
    tokens: Optional[int]
    reason: Optional[str] = None  #: why ``loss`` is None
    #: The loss's weight in this rank's backward (:mod:`healthcheck.integrations.loss_weight`); NaN: not known.
    weight: float = math.nan
    #: The unit roundoff of the coarsest dtype the weight was read in (``WeightProbe.rounding``).
    weight_rounding: float = 0.0


@dataclasses.dataclass
class _MicroBatch:
    explicit: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    fused: Optional[tuple[Any, Any]] = None
    cross_entropy: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    model_loss: Optional[Any] = None
    # Each source's WeightProbe, in the same order as its entries.
    explicit_probes: list[WeightProbe] = dataclasses.field(default_factory=list)
    fused_probe: Optional[WeightProbe] = None
    cross_entropy_probes: list[WeightProbe] = dataclasses.field(default_factory=list)
    model_probe: Optional[WeightProbe] = None
    labels: Optional[Any] = None
    num_items: Optional[Any] = None
    inputs: Optional[Any] = None  #: the forward's input ids, at the first step (:mod:`.target_shift`)
    problem: Optional[str] = None

    def trained(self) -> bool:
        """Whether the backward reached any loss this micro-batch computed."""
        probes = [*self.explicit_probes, self.fused_probe, *self.cross_entropy_probes, self.model_probe]
        return any(probe is not None and probe.grad is not None for probe in probes)


class LossCapture:
    """Collects the current step's micro-batch losses on this rank; :meth:`take` closes the step."""

    def __init__(self, read_settings: bool = True) -> None:
        """``read_settings``: record the first step's loss settings for :meth:`loss_settings` (a probe of a script);
        without it (the Trainer callback, which never reads them) no step pays for them."""
        self._micro: list[_MicroBatch] = []
        self._outside: list[tuple[Any, Any]] = []  # record_loss calls before any training forward
        self._outside_probes: list[WeightProbe] = []
        self._handles: list[Any] = []
        self._paused = False
        self._compiled_loss = False  # a cross-entropy was met only while torch.compile traced it
        # How the cross-entropies that the backward went through were called, until :meth:`loss_settings` reads
        # it (the first step).
        self._settings: Optional[set[tuple[str, ...]]] = set()
        self._shifts = TargetShifts()  # which shift of the inputs the trained losses' targets are, at the first step
        self._graph = LossGraph()  # what the first step's backwards compute above the model's outputs
        if not read_settings:
            self.loss_settings()  # read now: nothing more is recorded

    # ------------------------------------------------------------------ wiring

    def watch(self, module: Any) -> list[Any]:
        """Open a micro-batch at every training forward of ``module`` and read its output; returns the
        hook handles (removed by :meth:`close`, or earlier by the caller)."""
        patch_label_smoother()  # the script has built its model, so a Trainer's module is imported by now
        handles = [
            module.register_forward_pre_hook(eager(self._before_forward), with_kwargs=True),
            module.register_forward_hook(eager(self._after_forward), with_kwargs=True, always_call=True),
        ]
        self._handles.extend(handles)
        return handles

    def __enter__(self) -> LossCapture:
        ACTIVE.append(self)
        patch_cross_entropy()
        if self._settings is not None:
            self._graph.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._graph.close()
        if self in ACTIVE:
            ACTIVE.remove(self)
        if not ACTIVE:
            unpatch()

    # ------------------------------------------------------------------ observations

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """See nothing while a forward that is not the script's training runs (the replay audit's)."""
        active = self in ACTIVE
        if active:
            ACTIVE.remove(self)  # the patched cross_entropy reports only to active captures
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            if active:
                ACTIVE.append(self)

    def _before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if self._paused or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        inputs = token_ids(args, kwargs) if self._settings is not None else None
        self._micro.append(
            _MicroBatch(labels=labels if isinstance(labels, torch.Tensor) else None, num_items=kwargs.get("num_items_in_batch"),
                        inputs=inputs)
        )

    def _after_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        import torch

        if self._paused or not torch.is_grad_enabled() or not self._micro:
            return
        micro = self._micro[-1]
        self._graph.forward_output(output)
        log_probs, label_mask, loss = (_field(output, name) for name in ("log_probs", "label_mask", "loss"))
        if isinstance(log_probs, torch.Tensor) and isinstance(label_mask, torch.Tensor):
            # TRL zeroes ignored positions already; masking again costs nothing and does not rely on it.
            micro.fused = (-(log_probs.detach().float() * label_mask).sum(), label_mask.sum())
            micro.fused_probe = WeightProbe(log_probs, counted=label_mask)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            micro.model_loss = loss.detach().float()
            micro.model_probe = WeightProbe(loss)

    def observe_cross_entropy(self, input: Any, target: Any, kwargs: dict, result: Any) -> None:
        """Called by the patched ``F.cross_entropy`` with its arguments and result."""
        import torch

        if not isinstance(result, torch.Tensor):
            return
        if _traced(result):
            # Only a training loss explains a step without one (an evaluation may be compiled on its own).
            self._compiled_loss = self._compiled_loss or torch.is_grad_enabled()
            return
        if not torch.is_grad_enabled() or not self._micro:
            return
        micro = self._micro[-1]
        if self._settings is not None:  # the first step only
            self._note_settings(result, cross_entropy_settings(kwargs, target, result))
            self._shifts.observe(micro.inputs, target, kwargs.get("ignore_index", IGNORE_INDEX), result)
        if kwargs.get("weight") is not None:
            micro.problem = "the cross-entropy has class weights, so its mean is not a per-token loss"
            return
        if target.is_floating_point():
            micro.problem = "the cross-entropy has soft (probability) targets, so it has no token count"
            return
        ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
        tokens = (target != ignore_index).sum()
        reduction = kwargs.get("reduction", "mean")
        value = result.detach().float()
        if reduction == "mean":
            # An all-ignored micro-batch has a NaN mean (0/0) and contributes nothing.
            summed = torch.where(tokens > 0, value * tokens, torch.zeros_like(value))
        else:
            summed = value.sum()
        micro.cross_entropy.append((summed, tokens))
        micro.cross_entropy_probes.append(WeightProbe(result, counted=target != ignore_index if result.dim() else None))

    def observe_label_smoother(self, smoother: Any, labels: Any, shift_labels: bool, num_items: Any, result: Any) -> None:
        """Called by the patched ``LabelSmoother.__call__``: its result is its per-token objective summed over the
        labels, divided by ``num_items_in_batch`` when the Trainer passed it, else by the label count."""
        import torch

        if not isinstance(result, torch.Tensor) or _traced(result) or not torch.is_grad_enabled() or not self._micro:
            return
        ignore_index = getattr(smoother, "ignore_index", IGNORE_INDEX)
        targets = labels[..., 1:] if shift_labels else labels
        tokens = (targets != ignore_index).sum()
        value = result.detach().float()
        denominator = tokens if num_items is None else torch.as_tensor(num_items).to(value.device)
        # An all-ignored micro-batch without num_items is 0/0 and contributes nothing.
        summed = torch.where(tokens > 0, value * denominator, torch.zeros_like(value))
        self._micro[-1].cross_entropy.append((summed, tokens))
        self._micro[-1].cross_entropy_probes.append(WeightProbe(result))
        if self._settings is not None:
            epsilon = f"{float(getattr(smoother, 'epsilon', 0.0)):g}"
            dtype = str(result.dtype).removeprefix("torch.")
            self._note_settings(result, ("LabelSmoother", str(ignore_index), epsilon, "none", "class indices", dtype))
            self._shifts.observe(self._micro[-1].inputs, targets, ignore_index, result)

    def _note_settings(self, result: Any, settings: tuple[str, ...]) -> None:
        """Record ``settings`` once the backward runs through ``result``: a loss computed only to be logged (rank 0's
        per-token losses, say) is no rank's training loss, and must not make its rank differ."""
        if (seen := self._settings) is not None:  # a later add reaches a set already read: no one looks at it again
            when_trained(result, lambda: seen.add(settings))

    def record(self, loss: Any, tokens: Any = None) -> None:
        """An explicit micro-batch loss (``healthcheck.record_loss``); ``tokens`` defaults to 1."""
        import torch

        value = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        count = tokens if tokens is not None else 1
        entry = (value * count, count)
        probe = WeightProbe(loss if isinstance(loss, torch.Tensor) else value)
        if self._micro:
            self._micro[-1].explicit.append(entry)
            self._micro[-1].explicit_probes.append(probe)
        else:
            self._outside.append(entry)
            self._outside_probes.append(probe)

    def loss_settings(self) -> dict[str, str]:
        """How the cross-entropies this rank's backward went through so far were called, for the environment audit:
        one entry per setting (the distinct values over the calls); read once, at the first optimizer step (later
        calls are not recorded).

        Why: a loss setting that differs on one rank (label smoothing from a per-node config, another
        ``ignore_index``, class weights, a loss computed in bf16) changes what that rank optimises, and the
        statistics may not see it: with a freshly initialised model near the uniform distribution, label
        smoothing 0.1 on one of 4 ranks moved its loss by <0.01 and its gradient norm by ~10%, inside the
        ranks' spread, and a 10-step probe passed. It is exact evidence, compared as strings.

        >>> import torch
        >>> capture = LossCapture()
        >>> capture.loss_settings()
        {'loss.cross_entropy': 'none in the backward', 'loss.target_shift': 'not measured', 'loss.graph': 'not measured'}
        """
        seen, self._settings = self._settings or set(), None
        facts = {"loss.cross_entropy": "in the backward" if seen else "none in the backward", **self._shifts.facts(),
                 **self._graph.facts()}
        if not seen:
            return facts
        for position, name in enumerate(SETTING_NAMES):
            facts[f"loss.{name}"] = " | ".join(sorted({call[position] for call in seen}))
        return facts

    # ------------------------------------------------------------------ the step

    def take(self) -> StepLoss:
        """This rank's loss since the last call (one host sync), and reset."""
        micro, outside, outside_probes = self._micro, self._outside, self._outside_probes
        self._micro, self._outside, self._outside_probes = [], [], []
        explicit = outside + [entry for m in micro for entry in m.explicit]
        if explicit:
            probes = outside_probes + [probe for m in micro for probe in m.explicit_probes]
            return _combine(explicit, probes)
        # A forward whose loss the backward never reached (a validation loss without no_grad, between two updates)
        # is no micro-batch of this step: its loss was added to the step's, and its unknown weight hid the step's.
        trained = [m for m in micro if m.trained()]
        micro = trained or micro
        if not micro:
            return StepLoss(None, None, "no training forward of the model was seen in this step")
        pieces: list[tuple[Any, Any]] = []
        weighed: list[WeightProbe] = []
        for index, m in enumerate(micro):
            piece, probe, problem = _resolve(m, self._compiled_loss)
            if problem is not None:
                return StepLoss(None, _label_tokens_total(micro), f"micro-batch {index}: {problem}")
            pieces.append(piece)
            weighed.append(probe)
        return _combine(pieces, weighed)


def _resolve(micro: _MicroBatch, compiled: bool) -> tuple[Any, Any, Optional[str]]:
    """(summed loss, tokens) of one micro-batch and the probe of the tensor it was read from, or the reason it
    cannot be known (``compiled``: a cross-entropy was met only in a torch.compile trace)."""
    piece, probe, problem = _source(micro, compiled)
    if probe is not None and probe.both_signs():
        return None, None, (
            "the backward pushes some of its tokens' likelihood up and others' down (a preference or RL objective, "
            "such as DPO's, computed from per-token log-probs), so their mean NLL is not the loss this rank trains; "
            "call healthcheck.record_loss(loss, tokens) to report it"
        )
    return piece, probe, problem


def _source(micro: _MicroBatch, compiled: bool) -> tuple[Any, Any, Optional[str]]:
    if micro.problem is not None:
        return None, None, micro.problem
    if micro.fused is not None:
        return micro.fused, micro.fused_probe, None
    if micro.cross_entropy:  # duplicates, losses for a log, chunks of one loss
        return resolve_calls(micro.cross_entropy, micro.cross_entropy_probes)
    if micro.model_loss is not None:
        tokens = _label_tokens(micro.labels)
        if micro.num_items is not None:
            return (micro.model_loss * micro.num_items, tokens if tokens is not None else micro.num_items), micro.model_probe, None
        if tokens is not None:
            return (micro.model_loss * tokens, tokens), micro.model_probe, None
        return None, None, "the model returned a loss but no labels to count its tokens"
    if compiled:
        return None, None, (
            "the loss is computed inside a torch.compile'd region, where healthcheck cannot see its cross-entropy; "
            "return it as the model's `loss` output, or call healthcheck.record_loss(loss, tokens) outside that region"
        )
    return None, None, (
        "no loss was observed (no cross-entropy call, no fused log-probs, no model loss); "
        "call healthcheck.record_loss(loss, tokens) for a custom loss"
    )


def _combine(entries: list[tuple[Any, Any]], probes: list[WeightProbe]) -> StepLoss:
    import torch

    summed = torch.stack([torch.as_tensor(s, dtype=torch.float64).reshape(()).cpu() for s, _ in entries]).sum()
    tokens = int(sum(int(t) for _, t in entries))
    if tokens <= 0:
        return StepLoss(None, tokens, "the step had no loss-carrying tokens")
    weight = step_weight([probe.weight(s, t) for probe, (s, t) in zip(probes, entries, strict=True)])
    return StepLoss(float(summed) / tokens, tokens, None, weight, max((probe.rounding for probe in probes), default=0.0))


def _traced(value: Any) -> bool:
    """Whether ``value`` belongs to a trace (torch.compile's fake tensors), not to the step that runs.

    >>> import torch
    >>> _traced(torch.ones(1))
    False
    """
    import torch
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(value)


def _label_tokens(labels: Any) -> Optional[Any]:
    # A causal LM shifts its labels by one: position 0 is never a target.
    if labels is None:
        return None
    shifted = labels[..., 1:] if labels.dim() >= 2 else labels
    return (shifted != IGNORE_INDEX).sum()


def _label_tokens_total(micro: list[_MicroBatch]) -> Optional[int]:
    total = 0
    for m in micro:
        count = _label_tokens(m.labels)
        if count is None:
            return None
        total += int(count)
    return total


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


# --------------------------------------------------------------------------- the public call


def record_loss(loss: Any, tokens: Any = None) -> None:
    """Tell healthcheck this rank's loss for the current micro-batch (a custom loss it cannot see).

    ``loss`` is the micro-batch's mean loss (a tensor or float) and ``tokens`` the number of items it
    averages over (default 1: micro-batches weigh equally). When called in a step, the automatic
    capture is ignored for that step. Outside a healthcheck probe this does nothing.
    """
    for capture in ACTIVE:
        capture.record(loss, tokens)
