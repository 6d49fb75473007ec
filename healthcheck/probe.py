"""Run one probe end to end: pre-flight checks, launch (or join) the workers, write ``result.json``.

``run_probe`` works both ways the product is started: outside a launcher it forks
``distributed.nproc`` local workers through the elastic launcher; under torchrun/SLURM it joins as
one worker and rank 0 writes the artifacts.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from healthcheck import __version__
from healthcheck import distributed as hdist
from healthcheck.artifacts import (
    CONFIG_FILE,
    Environment,
    RankInfo,
    RunResult,
    Timing,
    default_run_dir,
    prepare_run_dir,
    utc_now,
    write_result,
    write_text_atomic,
)
from healthcheck.config import ProbeConfig, dump_yaml, resolve_for_rank
from healthcheck.data import check_data_inputs, prepare_samples
from healthcheck.errors import ProbeFailed
from healthcheck.modeling import load_tokenizer, model_source
from healthcheck.summary import summarize_run
from healthcheck.trainer import probe_worker
from healthcheck.watchdog import Watchdog

#: Extra seconds the process group waits beyond distributed.timeout_s under the local launcher.
PG_TIMEOUT_GRACE_S = 30.0


def preflight(config: ProbeConfig) -> None:
    """Fail with exit 2 before any worker starts: missing model dir or data file, unknown preset.

    Every rank's effective config is checked, so a bad path hidden in a rank override is caught too.
    """
    ranks = [0, *sorted(config.rank_overrides)]
    for rank in ranks:
        mine = resolve_for_rank(config, rank)
        model_source(mine.model.name)
        check_data_inputs(mine.data)


def warm_parent_caches(config: ProbeConfig) -> None:
    """Do the shared, expensive set-up once in the launcher so forked workers inherit it.

    Only imports and tokenization happen here, never torch compute: forking after torch's OpenMP
    pool has started can deadlock the children.
    """
    from transformers import AutoConfig  # noqa: F401  (imports the auto machinery once)

    hdist.prepare_fork()
    tokenizer = load_tokenizer(config.model)
    prepare_samples(config.data, tokenizer, cache_key=config.model.name)
    if model_source(config.model.name) == "preset":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from healthcheck.modeling import PRESETS

        MODEL_FOR_CAUSAL_LM_MAPPING[type(PRESETS[config.model.name][1](len(tokenizer), 1024))]


def run_probe(config: ProbeConfig, run_dir: Path | None = None) -> tuple[RunResult | None, Path]:
    """Run the probe and return ``(result, run_dir)``; ``result`` is None on non-zero ranks under torchrun.

    Raises :class:`ProbeFailed` (exit 3) after writing a result marked incomplete or interrupted.
    """
    started_wall = time.time()
    started_at = utc_now()
    preflight(config)
    if hdist.launched_externally():
        return _run_as_worker(config, run_dir, started_wall, started_at)

    run_dir = prepare_run_dir(run_dir or default_run_dir(config.name))
    write_text_atomic(run_dir / CONFIG_FILE, dump_yaml(config))
    write_result(run_dir, _result(config, started_at, started_wall, None, "running", None, run_dir))
    warm_parent_caches(config)
    timeout_s = config.distributed.timeout_s
    # The watchdog ends a stalled probe at timeout_s and can name the stuck rank; the process
    # group's own timeout comes later so that it does not pre-empt the watchdog with a vaguer error.
    args = (config.model_dump_json(), str(run_dir), started_wall, timeout_s + PG_TIMEOUT_GRACE_S)
    watchdog = Watchdog(run_dir, config.distributed.nproc, timeout_s)
    try:
        with watchdog, hdist.interrupts_as_keyboard_interrupt():
            payloads = hdist.launch_local(probe_worker, config.distributed.nproc, args, run_id=f"healthcheck-{config.name}")
    except ProbeFailed as exc:
        failure = watchdog.fired or describe_failure(run_dir, exc.message)
        result = _result(config, started_at, started_wall, None, "incomplete", failure, run_dir)
        write_result(run_dir, result)
        raise ProbeFailed(f"{result.failure}; partial artifacts in {run_dir}") from None
    except KeyboardInterrupt:
        result = _result(config, started_at, started_wall, None, "interrupted", "interrupted by the user", run_dir)
        write_result(run_dir, result)
        raise ProbeFailed(f"probe interrupted; partial artifacts in {run_dir}") from None
    result = _result(config, started_at, started_wall, payloads.get(0), "complete", None, run_dir)
    write_result(run_dir, result)
    return result, run_dir


def _run_as_worker(config, run_dir, started_wall, started_at):
    """Under torchrun: rank 0 picks the run directory and every rank learns it before training."""
    hdist.init_distributed(
        hdist.resolve_device(config.distributed.device, hdist.get_dist_info().local_world_size),
        hdist.resolve_backend(config.distributed.backend, hdist.resolve_device(config.distributed.device, hdist.get_dist_info().local_world_size)),
        config.distributed.timeout_s,
    )
    is_rank0 = hdist.rank() == 0
    chosen = None
    if is_rank0:
        chosen = str(prepare_run_dir(run_dir or default_run_dir(config.name)))
        write_text_atomic(Path(chosen) / CONFIG_FILE, dump_yaml(config))
    chosen = hdist.broadcast_object(chosen)
    run_path = Path(chosen)
    payload = probe_worker(config.model_dump_json(), chosen, started_wall)
    if not is_rank0:
        return None, run_path
    result = _result(config, started_at, started_wall, payload, "complete", None, run_path)
    write_result(run_path, result)
    return result, run_path


def describe_failure(run_dir: Path, launcher_message: str) -> str:
    """Name the rank and step that died: the earliest worker error report, else the launcher's view.

    When one rank raises, its peers then fail on broken collectives; the earliest report is the cause.
    A rank killed by a signal leaves no report, so the step comes from the last recorded row.
    """
    reports = []
    for path in (run_dir / "errors").glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if reports:
        first = min(reports, key=lambda r: r["time"])
        where = f"at step {first['step']}" if first["step"] is not None else "during start-up"
        return f"rank {first['rank']} failed {where}: {first['reason']}"
    last = summarize_run(run_dir, 0)["last_step"]
    return f"{launcher_message} (last recorded step {last}, so it died in step {last + 1})"


def _environment(payload: dict[str, Any]) -> Environment:
    ranks = [RankInfo.model_validate(r) for r in payload["ranks"]]
    first = ranks[0].versions if ranks else {}
    return Environment(
        python=first.get("python", platform.python_version()),
        torch=first.get("torch", "?"),
        transformers=first.get("transformers", "?"),
        healthcheck=__version__,
        platform=platform.platform(),
        device_type=payload["device_type"],
        backend=payload["backend"],
        world_size=payload["world_size"],
        nnodes=len({r.node for r in ranks}) or 1,
        ranks=ranks,
    )


def _result(config, started_at, started_wall, payload, status, failure, run_dir: Path) -> RunResult:
    """Build result.json from the step files written so far plus rank 0's payload (if it finished)."""
    window_start = config.metrics.warmup_steps
    summary = summarize_run(run_dir, window_start)
    steps_completed = payload["steps_completed"] if payload else summary["last_step"] + 1
    if payload and payload.get("stopped_early"):
        failure = payload["stopped_early"]
    wall = time.time() - started_wall if status != "running" else None
    timing = Timing(
        started_at=started_at,
        finished_at=utc_now() if status != "running" else None,
        wall_s=wall,
        startup_s=payload["startup_s"] if payload else None,
        train_s=payload["train_s"] if payload else None,
        mean_step_ms=(payload["train_s"] / payload["steps_completed"] * 1000) if payload and payload["steps_completed"] else None,
    )
    return RunResult(
        name=config.name,
        status=status,
        failure=failure,
        config=config,
        config_fingerprint=config.fingerprint(),
        environment=_environment(payload) if payload else None,
        timing=timing,
        steps_planned=config.train.steps,
        steps_completed=steps_completed,
        window_start_step=window_start,
        window_steps=summary["window_steps"],
        summary=summary["summary"],
        per_rank=summary["per_rank"],
        nonfinite=summary["nonfinite"],
    )
