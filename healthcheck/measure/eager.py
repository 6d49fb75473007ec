"""Run healthcheck's hooks and callbacks eagerly, also inside a script's ``torch.compile``'d code.

healthcheck observes a script's training through forward hooks on its model (the loss capture, the
first-forward facts, the batch kept for the replay audit). When the script compiles its model
(``torch.compile(DDP(model))``), dynamo traces those hooks like the model's own code: it compiled
healthcheck's functions as frames of their own, broke its graph inside them (numpy's RNG state, the
module facts) and guarded on their state, so the model recompiled when that state changed. A 2-rank probe
of a compiled Llama (``TORCH_LOGS=recompiles,graph_breaks``): 1 recompile and 3 graph breaks in
healthcheck's code; with the hooks wrapped in :func:`eager`, none (DDP's own graph break remains).

:func:`eager` makes dynamo stop at the hook and call it as plain Python with the real tensors: the model's
body stays compiled, and no guard depends on healthcheck. In eager code it costs under a microsecond a
call, and no import: ``DistributedDataParallel`` and ``fully_shard`` import ``torch._dynamo`` already.

The same holds for every other function healthcheck hands torch to call during a step: the global optimizer step
hooks, DDP's communication hook, the tensor hooks and queued callbacks of the backward, the clip's recording. A script
may compile its optimizer step (PyTorch's compiled-optimizer recipe) or its whole training step with the backward
inside it (as the compiled-autograd tutorial does): dynamo then traced the step hooks with the step, and compiled the
communication hook the backward ran from inside that function, and both crashed on the process group
(``UnsafeScriptObjectError``, exit 3 on every rank); a clip recorded while traced saw fake tensors. Measured: 0.38 µs a
call for the wrapper, against 0.05 µs for a bare call; building one takes ~57 µs, so what is made anew at each forward
or step is an :func:`eager_partial` (0.22 µs).
(The patched ``F.cross_entropy`` is another matter: dynamo takes it for torch's own function;
:mod:`healthcheck.integrations.loss_capture` says what it does about that.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn``, run eagerly even when a compiled region calls it (``torch.compiler.disable``).

    >>> eager(sorted)([3, 1, 2])
    [1, 2, 3]

    tests/unit/measure/test_eager.py counts what a traced hook costs a compiled model.
    """
    import torch

    return torch.compiler.disable(fn, recursive=True)


def eager_partial(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``functools.partial(fn, *args)``, run eagerly as :func:`eager` runs ``fn``: for a hook or callback made anew at
    each forward or step. Building a ``torch.compiler.disable`` wrapper takes ~57 µs on this host, where a partial of
    one wrapper built once takes well under a microsecond.

    >>> eager_partial(sorted, [3, 1, 2])()
    [1, 2, 3]
    """
    return functools.partial(_call_eagerly(), fn, *args)


@functools.lru_cache(maxsize=None)
def _call_eagerly() -> Callable[..., Any]:
    """One eager function that calls what it is given (built at first use: :func:`eager` imports torch)."""
    return eager(lambda fn, *args, **kwargs: fn(*args, **kwargs))
