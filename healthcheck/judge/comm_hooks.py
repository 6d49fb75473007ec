"""What a script's own DDP comm hook does to the all-reduce, for the reduction check's bound (pure: no torch).

The monitor's reduction check (:mod:`healthcheck.measure.exact_pass`) compares the all-reduced gradient with the
float64 mean of the local gradients, over the worst case of rounding a correct sum in the *bucket's* dtype. A script
that compresses its buckets (torch's ``fp16_compress_hook``, ``bf16_compress_hook``; accelerate's
``DistributedDataParallelKwargs(comm_hook=...)``) sums in the wire's dtype instead, so that bound is the wrong one: an
fp16 all-reduce of 2 ranks read 2,260x it. Turning the check off would also lose what it is for, a device or a
reduction that computes wrong. For a hook whose wire dtype is known, the check is judged against that dtype's
rounding instead: fl(Σ fl(fl(g_i) / N)) takes N + 1 roundings in the wire's unit roundoff (the cast, the division,
N − 1 additions), so the bound is γ_{N+1}(u_wire) where it was γ_N(u_bucket). fp16's narrow exponent adds an absolute
floor: a gradient under N·2⁻¹⁴ rounds into the subnormal range, off by up to 2⁻²⁵ whatever its size, and a large
model's gradients mostly are that small (an fp16 all-reduce of values ~2e-5 read 12.9x the relative bound alone). The
pass counts those values (``reduction_fp16_floor``), and the floor they can add joins the bound. Hooks that
approximate the mean by design (PowerSGD's low rank, quantization, local SGD) have no such bound and are not judged,
except on the steps PowerSGD and post-local SGD still all-reduce exactly, before their state's start iteration
(``comm_hook_exact``). Any other hook is judged as DDP's own reduction is: a hook that reduces exactly passes, and the
message names the hook where not. Messages name a wrapper by its last part (``fp16_compress_wrapper_hook``).

Names are as DDP's logging data records them (``ddp.comm_hook`` in the environment facts).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from healthcheck.measure.precision import gamma

#: Hooks that round to a lower precision on the wire: their wire dtype.
COMPRESSING = {
    "fp16_compress_hook": "fp16",
    "fp16_compress_wrapper_hook": "fp16",
    "BuiltinCommHookType.FP16_COMPRESS": "fp16",
    "bf16_compress_hook": "bf16",
    "bf16_compress_wrapper_hook": "bf16",
}
#: Hooks whose result is not the mean by design (torch's ddp_comm_hooks).
APPROXIMATING = frozenset(
    {"powerSGD_hook", "batched_powerSGD_hook", "quantization_pertensor_hook", "quantization_perchannel_hook", "post_localSGD_hook"}
)
#: Hook states (``ddp.comm_hook_state``) that say the hook approximates, whatever wraps it: a wrapper is logged under
#: its own name (``fp16_compress_wrapper(powerSGD_hook)``: ``fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook``).
APPROXIMATING_STATES = frozenset({"PowerSGDState", "PostLocalSGDState"})
#: Unit roundoff (half the machine epsilon) by dtype name, as the ranks' ``model_dtype`` fact and the wire name them.
ROUNDOFF = {
    "fp16": 2.0**-11, "float16": 2.0**-11, "bf16": 2.0**-8, "bfloat16": 2.0**-8,
    "fp32": 2.0**-24, "float32": 2.0**-24, "float64": 2.0**-53,
}


def wire_bound_ratio(bound_ratio: float, world: int, bucket_dtype: str, wire: str, fp16_floor: float = 0.0) -> float:
    """A row's ``reduction_bound_ratio`` (against rounding in ``bucket_dtype``) re-read against a compressing wire.

    Both relative bounds scale the same ‖mean |g_i|‖, so the ratio converts by the quotient of their factors, each
    with the float64 reference mean's own γ_N(2⁻⁵³). An unknown bucket dtype counts as fp32, the smallest bound there.
    On an fp16 wire the row's ``reduction_fp16_floor`` (what underflow can add, in units of the bucket's bound:
    :func:`healthcheck.measure.precision.fp16_underflow_floor`) is added to the bound; bf16 keeps fp32's exponent range.

    >>> round(wire_bound_ratio(2260.0, 2, "float32", "fp16"), 3)  # the fp16 all-reduce of 2 ranks: within fp16
    0.184
    >>> round(wire_bound_ratio(2260.0, 2, "float32", "fp16", fp16_floor=12306.0), 3)  # underflow as large: half
    0.092
    >>> round(wire_bound_ratio(1.5, 2, "bfloat16", "bf16"), 3)  # bf16 buckets: one rounding more, N + 1 against N
    0.996
    """
    return bound_ratio / (wire_factor(world, bucket_dtype, wire) + (fp16_floor if wire == "fp16" else 0.0))


def wire_factor(world: int, bucket_dtype: str, wire: str) -> float:
    """The wire's relative bound γ_{N+1}(u_wire) over the buckets' γ_N(u_bucket), each with the reference's γ_N(2⁻⁵³).

    >>> round(wire_factor(2, "float32", "fp16"))
    12306
    """
    reference = gamma(world, 2.0**-53)
    bucket = gamma(world, ROUNDOFF.get(bucket_dtype, ROUNDOFF["float32"])) + reference
    wire_u = max(ROUNDOFF[wire], ROUNDOFF.get(bucket_dtype, 0.0))
    return (gamma(world + 1, wire_u) + reference) / bucket


def underflow_share(world: int, bucket_dtype: str, wire: str, fp16_floor: float) -> float:
    """The part of an fp16 wire's bound that is underflow (0 on other wires, or with no value under fp16's normal range).

    >>> round(underflow_share(2, "float32", "fp16", 12306.0), 2)
    0.5
    """
    if wire != "fp16" or not fp16_floor > 0:
        return 0.0
    return fp16_floor / (wire_factor(world, bucket_dtype, wire) + fp16_floor)


def short_name(hook: str) -> str:
    """A hook's name without the function that made it (a wrapper's qualname), as the tables above name it.

    >>> short_name("fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook")
    'fp16_compress_wrapper_hook'
    >>> short_name("BuiltinCommHookType.FP16_COMPRESS")
    'BuiltinCommHookType.FP16_COMPRESS'
    """
    return hook.rsplit(".", 1)[-1] if "<locals>" in hook else hook


def approximates(hook: str, state: str) -> bool:
    """Whether the script's hook does not compute the mean by design (outside an exact phase: :func:`exact_rows`).

    >>> approximates("fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook", "PowerSGDState")
    True
    >>> approximates("fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook", "ProcessGroup")
    False
    """
    return short_name(hook) in APPROXIMATING or state in APPROXIMATING_STATES


def exact_rows(rows: Sequence[Mapping[str, Any]], hook: str) -> tuple[list[Mapping[str, Any]], str]:
    """The checked steps an approximating hook reduced exactly (``comm_hook_exact``: PowerSGD and post-local SGD
    all-reduce until their start iteration), and how the message says which were judged ("" for every step)."""
    exact, hook = [r for r in rows if r.get("comm_hook_exact") == 1], short_name(hook)
    if not exact or len(exact) == len(rows):
        return exact, f"; {hook} still all-reduced exactly (before its start iteration)" if exact else ""
    return exact, (f"; judged on the {len(exact)} checked steps {hook} still all-reduced exactly, not the "
                   f"{len(rows) - len(exact)} after its start iteration, where it approximates")


def approximating_message(hook: str, past_start: bool = False) -> str:
    """The reduction check's "not judged" line for a hook that does not compute the mean by design."""
    return (
        f"not measured: the script's comm hook ({short_name(hook)}) approximates the all-reduce by design"
        + (" (every checked step came after its start iteration)" if past_start else "")
        + ", so the reduced gradient is not the mean of the local gradients and no rounding bound applies"
    )


def wire_phrase(hook: str, wire: str) -> str:
    """How the messages name the bound a compressing hook is judged against.

    >>> print(wire_phrase("fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook", "fp16"))
    rounding in fp16 (the script's fp16_compress_wrapper_hook)
    """
    return f"rounding in {wire} (the script's {short_name(hook)})"
