"""Run one probe end to end: pre-flight checks, launch (or join) the workers, write ``result.json``.

``run_probe`` works both ways the product is started: outside a launcher it forks
``distributed.nproc`` local workers through the elastic launcher; under torchrun/SLURM it joins as
one worker and rank 0 writes the artifacts.
"""

from __future__ import annotations

import json
import platform
import shutil
import signal
import sys
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
from healthcheck.errors import InvalidInput, ProbeFailed
from healthcheck.modeling import load_tokenizer, model_source
from healthcheck.summary import summarize_run
from healthcheck.trainer import probe_worker
from healthcheck.watchdog import HEARTBEAT_DIR, Watchdog, read_beats

#: Extra seconds the process group waits beyond distributed.timeout_s under the local launcher.
PG_TIMEOUT_GRACE_S = 30.0
#: Launches tried when workers stall before joining the process group (see Watchdog).
STARTUP_ATTEMPTS = 2


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

    A crash, hang or interrupt still returns: the result is marked incomplete or interrupted, names
    the rank and step, and keeps every row written so far. The gate turns it into exit 3.
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
    attempts = 0
    try:
        while True:
            attempts += 1
            args = (config.model_dump_json(), str(run_dir), started_wall, timeout_s + PG_TIMEOUT_GRACE_S, attempts)
            watchdog = Watchdog(run_dir, config.distributed.nproc, timeout_s,
                                startup_timeout_s=config.distributed.startup_timeout_s)
            try:
                with watchdog, hdist.interrupts_as_keyboard_interrupt():
                    payloads = hdist.launch_local(probe_worker, config.distributed.nproc, args,
                                                  run_id=f"healthcheck-{config.name}")
                break
            except ProbeFailed:
                # Stuck before any rank trained: nothing was measured, so starting again changes no
                # result. Forked workers can, rarely, deadlock in start-up on state inherited from the
                # launcher; distributed._protect_forked_workers closes the causes seen so far, and this
                # keeps an unknown one from costing a whole distributed.timeout_s.
                if not (watchdog.stalled_in_startup and attempts < STARTUP_ATTEMPTS):
                    raise
                print(f"healthcheck: {watchdog.fired}; relaunching the workers "
                      f"(attempt {attempts + 1} of {STARTUP_ATTEMPTS})", file=sys.stderr, flush=True)
                clear_launch_state(run_dir)
    except ProbeFailed as exc:
        failure = watchdog.fired or describe_failure(run_dir, exc.message, exc.signals)
        result = _result(config, started_at, started_wall, None, "incomplete", failure, run_dir)
        bad_input = input_error_in_workers(run_dir)
        if bad_input and not watchdog.fired:
            write_result(run_dir, result)
            raise InvalidInput(bad_input)
    except KeyboardInterrupt:
        result = _result(config, started_at, started_wall, None, "interrupted", "interrupted by a signal or Ctrl-C", run_dir)
    else:
        result = _result(config, started_at, started_wall, payloads.get(0), "complete", None, run_dir)
    result.timing.launch_attempts = attempts
    write_result(run_dir, result)
    return result, run_dir


def clear_launch_state(run_dir: Path) -> None:
    """Remove what a stalled launch left (heartbeats, error reports) so the next one starts clean."""
    for folder in (run_dir / HEARTBEAT_DIR, run_dir / "errors"):
        shutil.rmtree(folder, ignore_errors=True)


def _run_as_worker(config, run_dir, started_wall, started_at):
    """Under torchrun: rank 0 picks the run directory and every rank learns it before training."""
    device_type = hdist.resolve_device(config.distributed.device, hdist.get_dist_info().local_world_size)
    hdist.init_distributed(device_type, hdist.resolve_backend(config.distributed.backend, device_type), config.distributed.timeout_s)
    is_rank0 = hdist.rank() == 0
    chosen, refusal = None, None
    if is_rank0:
        try:
            chosen = str(prepare_run_dir(run_dir or default_run_dir(config.name)))
            write_text_atomic(Path(chosen) / CONFIG_FILE, dump_yaml(config))
        except InvalidInput as exc:
            refusal = exc.message
    # Rank 0's refusal (e.g. --out already holds a run) travels with the broadcast, so every rank
    # exits 2 with the same line instead of its peers dying in the broadcast with a gloo/NCCL traceback.
    chosen, refusal = hdist.broadcast_object((chosen, refusal))
    if refusal is not None:
        hdist.destroy_distributed()
        raise InvalidInput(refusal)
    run_path = Path(chosen)
    payload = probe_worker(config.model_dump_json(), chosen, started_wall)
    if not is_rank0:
        return None, run_path
    result = _result(config, started_at, started_wall, payload, "complete", None, run_path)
    write_result(run_path, result)
    return result, run_path


#: Errors a rank raises because a *peer* went away: symptoms, not the cause.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
    "remote process exited", "NCCL communicator was aborted", "Socket Timeout", "Timed out",
)


def describe_failure(run_dir: Path, launcher_message: str, signals: dict[int, int] | None = None) -> str:
    """Name the rank and step that died, not the peers that failed because of it.

    In order: a rank the launcher saw die by a signal; the earliest report that is not a peer
    failure; a rank that left no report while its peers report broken connections (killed by a
    signal or the OOM killer before the launcher noticed); the launcher's own view.
    """
    beats = {beat.rank: beat for beat in read_beats(run_dir)}

    def where(rank: int) -> str:
        beat = beats.get(rank)
        return f"in step {beat.step} ({beat.phase})" if beat and beat.step >= 0 else "during start-up"

    for rank, signum in sorted((signals or {}).items()):
        return f"rank {rank} was killed by signal {signum} ({_signal_name(signum)}) {where(rank)}"
    reports = read_error_reports(run_dir)
    causes = [r for r in reports if not any(marker in r["reason"] for marker in PEER_FAILURE_MARKERS)]
    if causes:
        first = min(causes, key=lambda r: r["time"])
        at = f"at step {first['step']}" if first["step"] is not None else "during start-up"
        return f"rank {first['rank']} failed {at}: {first['reason']}"
    silent = sorted(set(beats) - {r["rank"] for r in reports})
    if reports and silent:
        ranks = ", ".join(map(str, silent))
        peers = ", ".join(str(r["rank"]) for r in sorted(reports, key=lambda r: r["rank"]))
        return (
            f"rank {ranks} died without an error report {where(silent[0])} (killed by a signal or the OOM killer?); "
            f"rank {peers} then lost the connection to it"
        )
    if reports:
        first = min(reports, key=lambda r: r["time"])
        return f"rank {first['rank']} failed at step {first['step']}: {first['reason']}"
    last = summarize_run(run_dir, 0)["last_step"]
    return f"{launcher_message} (last recorded step {last}, so it died in step {last + 1})"


def read_error_reports(run_dir: Path) -> list[dict]:
    """The ``errors/rank-<r>.json`` reports that failing workers left (see ``trainer.record_worker_failure``)."""
    reports = []
    for path in (run_dir / "errors").glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return reports


def input_error_in_workers(run_dir: Path) -> str | None:
    """The reason, when the first failing worker rejected its input (exit 2, not a crash).

    Some inputs can only be checked where the worker runs (a device that this node lacks, a
    dataset that does not tokenize); those are bad input, not a probe that could not finish.
    """
    reports = read_error_reports(run_dir)
    if not reports:
        return None
    first = min(reports, key=lambda r: r["time"])
    if first.get("exit_code") != 2:
        return None
    return first["reason"].split(": ", 1)[-1]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


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
        nnodes=len({(r.node, r.node_rank) for r in ranks}) or 1,
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
        standouts=summary["standouts"],
        nonfinite=summary["nonfinite"],
        audits=_audits(config, payload, run_dir, summary["nonfinite"]),
    )


def _audits(config, payload, run_dir: Path, nonfinite) -> dict[str, Any]:
    """The exact audits, for a probe whose workers finished (they need rank 0's gathered evidence)."""
    if not payload:
        return {}
    from healthcheck.audits import run_audits

    return run_audits(config, payload, run_dir, nonfinite)
