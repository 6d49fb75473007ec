"""Exact mode's step through shared memory, where every rank runs on this host's CPU: no gradient all-gather.

Why: exact mode needs every rank's whole local gradient for the float64 Gram. Its chunked all-gather
(:func:`~healthcheck.measure.exact_pass.stream_local_gradients`) sends each rank's gradient through gloo's TCP ring
to every other rank, and then every rank computes the same N×N Gram: on issue 13's harness (8 ranks sharing 2
cores, a 0.5M-parameter Llama) that made a step 1.46× as long as without the monitor (README, Measured figures).

Ranks on one host can instead write their local gradients where all of them can read them: each rank's row in
:mod:`.shared_rows` holds the step's header and the gradient's fp32 bits (``pack``'s sketch layout), the rank that
finds every row in computes the Gram once and publishes the step's metrics, and the others read them (a step later
with ``overlap``, as sketch mode's rows). The Gram is the same float64 sum of products as the chunked pass's, in
another order, so its values agree to float64 rounding.

Where it does not apply, the chunked pass runs, as before: a rank's tensors on an accelerator, an fp64 gradient
(whose values fp32 bits cannot hold), a model of more than ``exact_chunk_numel`` parameters (the file holds two
steps of every rank's gradient: 2 × N × P × 4 bytes), a reduction-check step (its check needs the all-reduced
buckets beside the gathered ones), or a host whose ranks could not map the file.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from healthcheck.measure.step_gather import InFlight, pack


def shareable(local: Sequence[Any], limit: int) -> bool:
    """Whether this rank's local gradient pieces can travel as fp32 bits through shared memory, whole.

    >>> import torch
    >>> shareable([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)], limit=5)
    True
    >>> shareable([torch.zeros(3, dtype=torch.float64)], limit=5), shareable([torch.zeros(6)], limit=5)
    (False, False)
    """
    import torch

    exact_in_fp32 = (torch.float32, torch.bfloat16, torch.float16)
    return (
        bool(local)
        and all(piece.device.type == "cpu" and piece.dtype in exact_in_fp32 for piece in local)
        and sum(piece.numel() for piece in local) <= limit
    )


def reserved(direction: str, parameters: Iterable[Any], limit: int) -> int:
    """fp32 values the shared rows must hold besides a step's header: in exact mode the local gradient, the
    parameters that take one (a DDP bucket holds those), unless more than ``limit``. The file is sized at the first
    post, which may be a reduction-check step's header alone.

    >>> import torch
    >>> params = [torch.zeros(3, requires_grad=True), torch.zeros(4)]
    >>> reserved("exact", params, limit=5), reserved("exact", params, limit=2), reserved("sketch", params, limit=5)
    (3, 0, 0)
    """
    if direction != "exact":
        return 0
    numel = sum(p.numel() for p in parameters if p.requires_grad)
    return numel if numel <= limit else 0


def post_step(
    *,
    step: int,
    world: int,
    post: Callable[..., Any],
    loss: Any,
    tokens: Any,
    sqnorm: Any,
    extras: Mapping[str, Any],
    local: Sequence[Any],
    buckets: int,
) -> Optional[InFlight]:
    """Post this rank's header and its whole local gradient (``local``: the step's pieces in bucket order, which
    :func:`shareable` accepted) as one row, ``post(flat, tail=local)`` (:meth:`.SharedRows.post`, through the
    monitor's attach); None where it took nothing (every rank then runs the chunked pass).

    The step's ‖g_i‖², ⟨g_i, ḡ⟩ and ‖ḡ‖² are read off the Gram (``from_gram="all"``), as the chunked pass's are.
    """
    flat, names = pack(loss=loss, tokens=tokens, sqnorm=sqnorm, dot=0.0, mean_sqnorm=0.0, extras=extras)
    # The gradient goes into the row straight from the pieces, and the reader computes the Gram where they lie
    # (SharedRows.post).
    posted = post(flat, tail=local)
    if posted is None:
        return None
    work, rows = posted
    return InFlight(
        step=step, direction="exact", world=world, work=work, rows=rows, names=names, gram=None, buckets=buckets, from_gram="all"
    )


def host_copy(kept: dict[int, Any], index: int, buffer: Any, keep: bool = True) -> Any:
    """A copy of bucket ``index``'s local gradient, before the all-reduce replaces it. On the host with ``keep``
    (exact mode, which copies every step) into the buffer kept from the bucket's last step: a fresh multi-MiB tensor
    a step cost the allocator page faults (glibc maps each anew) that every rank paid. Otherwise a clone, as before:
    an accelerator's memory, and sketch mode's (a copy on reduction-check steps only), is not held between steps.

    >>> import torch
    >>> kept = {}
    >>> first = host_copy(kept, 0, torch.ones(3)); again = host_copy(kept, 0, torch.zeros(3))
    >>> again is first, again.tolist()
    (True, [0.0, 0.0, 0.0])
    >>> host_copy(kept, 0, torch.ones(3), keep=False) is first
    False
    """
    if not keep or buffer.device.type != "cpu":
        return buffer.clone()
    copy = kept.get(index)
    if copy is None or copy.shape != buffer.shape or copy.dtype != buffer.dtype:
        copy = kept[index] = buffer.clone()
        return copy
    return copy.copy_(buffer)

