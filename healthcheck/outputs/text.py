"""Text every report format shares: the verdict headline, numbers, envelopes and rank suffixes.

The terminal, Markdown, HTML, JUnit, annotations and plot titles all word things through here.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from healthcheck.artifacts import RunResult
from healthcheck.judge.findings import Finding, Verdict
from healthcheck.ranks import ranks_phrase

#: Columns of the checks table, in every format.
CHECK_COLUMNS = ("check", "statistic", "observed", "envelope", "status", "margin")
#: How each attribution metric prints (losses and cosines differ in the third decimal).
RANK_FORMATS = {"loss": ".3f", "grad_norm": ".4g", "cosine_to_mean": ".3f", "compute_ms": ".1f"}


def verdict_headline(verdict: Optional[Verdict], status: str, failure: Optional[str] = None) -> tuple[str, str, str]:
    """(label, sentence, style key) for the banner, the markdown title, JUnit and plot titles.

    >>> verdict_headline(None, "complete")[:2]
    ('NO BASELINE', 'probe complete, nothing judged (no verdict)')
    """
    if status != "complete":
        label = "INTERRUPTED" if status == "interrupted" else "INCOMPLETE"
        return label, f"probe did not finish: {failure or f'result still marked {status}'}", "fail"
    if verdict is None:
        return "NO BASELINE", "probe complete, nothing judged (no verdict)", "warn"
    total, failed = len(verdict.findings), len(verdict.failures)
    unmeasured = sum(1 for f in verdict.findings if not f.measured)
    scope = " (audits only: no envelope was judged)" if verdict.audits_only else ""
    if verdict.status == "fail":
        early = f" ({verdict.stopped_early})" if verdict.stopped_early else ""
        return "FAIL", f"silent inconsistency: {failed} of {total} checks failed{scope}{early}", "fail"
    judged = f"{total - unmeasured} checks" + (f" ({unmeasured} not measured)" if unmeasured else "")
    if verdict.audits_only:
        return "PASS", f"all {judged} meet their ideal expectations{scope}", "pass"
    return "PASS", f"all {judged} within their baseline envelopes", "pass"


def format_number(value: Optional[float], spec: str = ".4g") -> str:
    """A number for a table cell: ``-`` for None, ``nan``/``+inf``/``-inf`` spelled out.

    >>> format_number(None), format_number(float("inf")), format_number(0.123456)
    ('-', '+inf', '0.1235')
    """
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    return format(value, spec)


def format_envelope(finding: Finding) -> str:
    """``[lower, upper]`` of an envelope finding, ``-`` for a check without bounds."""
    if finding.lower is None and finding.upper is None:
        return "-"
    lower = format_number(finding.lower) if finding.lower is not None else "-inf"
    upper = format_number(finding.upper) if finding.upper is not None else "+inf"
    return f"[{lower}, {upper}]"


def ranks_suffix(finding: Finding) -> str:
    """`` (rank 3)`` after a finding's message, unless the message already names its ranks.

    >>> ranks_suffix(Finding(check="audit.x", title="x", passed=False, message="went wrong", ranks=[3]))
    ' (rank 3)'
    """
    # The verdict already names the ranks in an envelope's message; other checks may only fill ``ranks``.
    if not finding.ranks or "rank" in finding.message:
        return ""
    return f" ({ranks_phrase(finding.ranks)})"


def check_rows(verdict: Verdict) -> list[tuple[Finding, tuple[str, ...]]]:
    """One row per finding, failures first, then the closest to a bound: cells as in :data:`CHECK_COLUMNS`."""
    ordered = sorted(verdict.findings, key=lambda f: (f.passed, not f.measured, f.margin if f.margin is not None else math.inf))
    return [
        (
            f,
            (
                f.metric or f.check,
                f.statistic or "-",
                format_number(f.observed),
                format_envelope(f),
                "FAIL" if not f.passed else ("ok" if f.measured else "n/a"),
                format_number(f.margin, "+.2f"),
            ),
        )
        for f in ordered
    ]


#: How the run line names :attr:`.RankInfo.gradient_source` (where the monitor read each rank's local gradient).
SOURCES = {
    "grads": ", gradients from .grad",
    "comm_hook": ", gradients from the comm hook",
    "reduce_scatter": ", gradients from the reduce-scatter",
}


def run_line(result: RunResult, separator: str = " · ") -> str:
    """One line on where and how the probe ran: ranks, devices, steps, wall time, config fingerprint."""
    env = result.environment
    where = ""
    if env:
        source = SOURCES.get(env.ranks[0].gradient_source or "", "") if env.ranks else ""
        where = f"{env.world_size} ranks ({env.device_type}/{env.backend}, {env.nnodes} node{'s' * (env.nnodes > 1)}{source})"
    parts = [
        f"probe {result.name}",
        where,
        f"steps {result.steps_completed}/{result.steps_planned}, window from step {result.window_start_step}"
        f" ({result.window_steps} sampled)",
        f"{result.timing.wall_s:.1f} s" if result.timing.wall_s is not None else "",
        f"config {result.config_fingerprint}",
    ]
    return separator.join(p for p in parts if p)


def config_value(value: Any) -> str:
    r"""A config value on one line: plain strings bare, everything else (and multi-line prompts) as JSON.

    >>> config_value("rank0_differs"), config_value(None), config_value("### Input:\n{input}")
    ('rank0_differs', 'null', '"### Input:\\n{input}"')
    """
    if isinstance(value, str) and value and value.isprintable() and value.strip() == value:
        return value
    return json.dumps(value, sort_keys=True, default=str)
