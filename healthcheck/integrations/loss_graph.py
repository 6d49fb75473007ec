"""What a rank computes between its model's outputs and the root of its backward: the loss code every rank shares.

A rank that adds a term of its own to the loss (a z-loss on its logits, an L2 penalty on its parameters, switched on
by a per-node config or present in another revision of the loss code) trains another objective. Its cross-entropy,
whose settings and weight in the backward are audited, agrees with everyone's; the extra term is no cross-entropy
call. On a freshly initialised model a z-loss of weight 1e-2 on one of 4 ranks passed a 20-step ``--audits-only``
probe, its rank-outlier and spike tests included.

At each backward of the first step (``torch.autograd.backward``, which ``Tensor.backward``, accelerate, the
Trainer, Lightning and a ``GradScaler``'s scaled loss all go through), the autograd graph is walked from the root
down to the outputs of the model's training forwards, and the kinds of its operations (``Add``, ``NllLoss``,
``LogSoftmax``: the names torch gives their backward nodes, without ``Backward0``) become one fact,
``loss.graph``. A set of kinds, not a count: a loss that loops over the documents of a packed batch repeats its
operations as often as its data says, and ranks differ in that. Operations that only move or select values
(:data:`LAYOUT`) are left out: whether ``flatten`` copies (``Clone``, ``UnsafeView``) or views (``View``) depends on
the micro-batch's shape (a batch of one row is contiguous after a slice, a batch of two is not).

A model that computes its loss itself (a Hugging Face model given labels) backwarded as it is reads "the model's
output"; the model's own operations below its outputs are never visited (its settings are audited elsewhere). A
backward that reaches none of the outputs (a sanity loss on another model) is left out; nested backwards (reentrant
checkpointing's) are not roots.

The outputs are marked in their nodes' ``metadata``, which lives on the C++ node: autograd nodes take no weak
reference, and holding them would keep a dropped forward's activations alive until the next backward.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from healthcheck.integrations.script.patches import Patches
from healthcheck.judge.exact_audits import NOT_MEASURED
from healthcheck.measure.eager import eager
from healthcheck.measure.output_tensors import differentiable_tensors

#: The key that marks a model output's node (in ``Node.metadata``).
OUTPUT_MARK = "healthcheck.model_output"
#: Nodes walked at most per backward: the graph above a model's outputs is tens of nodes; a root whose walk never
#: meets an output would otherwise visit the whole model.
MAX_NODES = 4096
#: Kinds that move, view or select values and compute nothing: which of them a loss records follows its tensors'
#: shapes and strides, not its code.
LAYOUT = frozenset({
    "Alias", "AsStrided", "Cat", "Clone", "Expand", "Index", "Permute", "Reshape", "ReshapeAlias", "Select", "Slice",
    "Split", "SplitWithSizes", "Squeeze", "Stack", "T", "Transpose", "Unbind", "Unsqueeze", "UnsafeView", "View",
})


def mark_outputs(output: Any) -> None:
    """Mark the nodes of a training forward's differentiable outputs (a tensor, a ``ModelOutput``, a tuple...)."""
    for tensor in differentiable_tensors(output, 3):
        if tensor.grad_fn is not None:
            tensor.grad_fn.metadata[OUTPUT_MARK] = True


def graph_kinds(roots: Iterable[Any], max_nodes: int = MAX_NODES) -> Optional[frozenset[str]]:
    """The kinds of the backward nodes between ``roots`` (tensors) and the marked outputs, but :data:`LAYOUT`'s, or
    None when no root reaches one. A parameter the loss uses directly (an L2 penalty) shows as ``AccumulateGrad``.

    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> logits = w * 2
    >>> mark_outputs(logits)
    >>> sorted(graph_kinds([torch.logsumexp(logits, 0) + 0.1 * w.pow(2).sum()]))
    ['AccumulateGrad', 'Add', 'Logsumexp', 'Mul', 'Pow', 'Sum']
    >>> sorted(graph_kinds([logits]))
    []
    >>> graph_kinds([(w * 3).sum()]) is None
    True
    """
    stack = [root.grad_fn for root in roots if getattr(root, "grad_fn", None) is not None]
    # The visited nodes' Python objects are held, not only their ids: a node's object can be freed and made again on
    # the next access, and a freed object's id can come back as another node's.
    seen: dict[int, Any] = {}
    kinds: set[str] = set()
    reached = False
    while stack and len(seen) < max_nodes:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if node.metadata.get(OUTPUT_MARK):
            reached = True
            continue
        kinds.add(re.sub(r"Backward\d*$", "", type(node).__name__))
        stack.extend(child for child, _ in node.next_functions)
    return frozenset(kinds - LAYOUT) if reached else None


class LossGraph:
    """This rank's ``loss.graph`` fact over its first step's backwards; :meth:`facts` reads it once and unpatches.

    >>> import torch
    >>> graph = LossGraph().start()
    >>> w = torch.ones(3, requires_grad=True)
    >>> logits = w * 2
    >>> graph.forward_output(logits)
    >>> (torch.logsumexp(logits, 0) * 0.5).backward()
    >>> graph.facts()
    {'loss.graph': 'Logsumexp, Mul'}
    """

    def __init__(self) -> None:
        self._kinds: Optional[set[str]] = set()  # None once read
        self._reached = False
        self._patches = Patches()

    def start(self) -> LossGraph:
        """Watch ``torch.autograd.backward`` until :meth:`facts` is read."""
        import torch

        walk = eager(self._walk)  # in a script's compiled step, on the real graph: dynamo had traced it on fake tensors

        def wrap(original: Any) -> Any:
            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                walk(tensors)
                return original(tensors, *args, **kwargs)

            return backward

        self._patches.wrap(torch.autograd, "backward", wrap)
        return self

    def forward_output(self, output: Any) -> None:
        """A training forward's output: its tensors are where the loss's own code ends."""
        if self._kinds is not None:
            mark_outputs(output)

    def _walk(self, tensors: Any) -> None:
        import torch

        if self._kinds is None or torch._C._current_autograd_node() is not None:  # read, or nested in a backward
            return
        kinds = graph_kinds([tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
        if kinds is not None:
            self._reached = True
            self._kinds.update(kinds)

    def facts(self) -> dict[str, str]:
        """``loss.graph``: the operations' kinds, sorted; "the model's output" when the backward starts there; "not
        measured" when no backward reached an output."""
        kinds, self._kinds = self._kinds or set(), None
        reached, self._reached = self._reached, False
        self._patches.restore()
        if not reached:
            return {"loss.graph": NOT_MEASURED}
        return {"loss.graph": ", ".join(sorted(kinds)) or "the model's output"}

    def close(self) -> None:
        self._patches.restore()
