"""Run one probe end to end: pre-flight checks, launch (or join) the workers, write ``result.json``.

``run_probe`` works both ways the product is started: outside a launcher it forks
``distributed.nproc`` local workers through the elastic launcher; under torchrun/SLURM it joins as
one worker and rank 0 writes the artifacts.
"""

from __future__ import annotations

import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Literal, Optional

from healthcheck.artifacts import (
    CONFIG_FILE,
    Environment,
    FailFastPolicy,
    RunResult,
    Timing,
    WorkerReport,
    default_run_dir,
    prepare_run_dir,
    utc_now,
    write_result,
)
from healthcheck.config import ProbeConfig, dump_yaml, resolve_for_rank
from healthcheck.errors import InvalidInput, ProbeFailed
from healthcheck.files import write_text_atomic
from healthcheck.judge.assemble import first_loss_problem, run_audits
from healthcheck.judge.summary import summarize_run
from healthcheck.measure import distributed as hdist
from healthcheck.run import launcher
from healthcheck.run.console import HeartbeatProgress
from healthcheck.run.data import check_data_inputs, prepare_samples
from healthcheck.run.failures import ERRORS_DIR, describe_failure, input_error_in_workers
from healthcheck.run.modeling import PRESETS, load_tokenizer, model_source
from healthcheck.run.script_preload import preload_script_imports
from healthcheck.run.script_worker import script_target_error, script_worker
from healthcheck.run.watchdog import HEARTBEAT_DIR, Watchdog, read_beats
from healthcheck.run.worker import probe_worker
from healthcheck.version import __version__

Status = Literal["complete", "incomplete", "interrupted", "running"]

#: Extra seconds the process group waits beyond distributed.timeout_s under the local launcher.
PG_TIMEOUT_GRACE_S = 30.0
#: Launches tried when workers stall before joining the process group (see Watchdog).
STARTUP_ATTEMPTS = 2


def preflight(config: ProbeConfig) -> None:
    """Fail with exit 2 before any worker starts: missing script, model dir or data file, unknown preset.

    Every rank's effective config is checked, so a bad path hidden in a rank override is caught too.
    """
    problem = hdist.npu_missing_error(config.distributed.device)
    if problem:
        raise InvalidInput(problem)
    if config.script is not None:
        problem = script_target_error(config.script.path, config.script.module)
        if problem:
            raise InvalidInput(problem)
        return
    ranks = [0, *sorted(config.rank_overrides)]
    for rank in ranks:
        rank_config = resolve_for_rank(config, rank)
        model_source(rank_config.model.name)
        check_data_inputs(rank_config.data)


def warm_parent_caches(config: ProbeConfig) -> None:
    """Do the shared, expensive set-up once in the launcher so forked workers inherit it.

    Only imports and tokenization happen here, never torch compute: forking after torch's OpenMP
    pool has started can deadlock the children.
    """
    launcher.prepare_fork()
    # Every worker needs torch and the replay rounds; this module imports neither, so that a bad config
    # or path fails in a fraction of a second (preflight) instead of after torch has loaded.
    import torch  # noqa: F401

    import healthcheck.run.replay_rounds  # noqa: F401

    if config.script is not None:
        # Only the heavy libraries the script's own source imports (script_preload.py): guessing would cost
        # every probe the imports of all.
        if config.script.path is not None:
            preload_script_imports(Path(config.script.path))
        return
    from transformers import AutoConfig  # noqa: F401  (imports the auto machinery once)

    tokenizer = load_tokenizer(config.model)
    prepare_samples(config.data, tokenizer, cache_key=config.model.name)
    if model_source(config.model.name) == "preset":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(PRESETS[config.model.name][1](len(tokenizer), 1024))]


def run_probe(
    config: ProbeConfig, run_dir: Path | None = None, *, verbose: bool = False, fail_fast: Optional[FailFastPolicy] = None
) -> tuple[RunResult | None, Path]:
    """Run the probe and return ``(result, run_dir)``; ``result`` is None on non-zero ranks under torchrun.

    A crash, hang or interrupt still returns: the result is marked incomplete or interrupted, names
    the rank and step, and keeps every row written so far. The gate turns it into exit 3.
    ``fail_fast``: stop at the first decisive audit failure (``healthcheck probe`` passes one unless
    ``--no-fail-fast``); None runs every step, as a baseline recording must.
    """
    fail_fast_json = fail_fast.model_dump_json() if fail_fast is not None else None
    started_wall = time.time()
    started_at = utc_now()
    preflight(config)
    if hdist.launched_externally():
        return _run_as_worker(config, run_dir, started_wall, started_at, fail_fast_json)

    run_dir = prepare_run_dir(run_dir or default_run_dir(config.name))
    write_text_atomic(run_dir / CONFIG_FILE, dump_yaml(config))
    write_result(
        run_dir,
        build_result(config=config, run_dir=run_dir, started_at=started_at, started_wall=started_wall, report=None, status="running"),
    )
    prepared = time.time()
    warm_parent_caches(config)
    # Launcher-side phases; the workers add theirs (spawn is what is left of their "launch").
    launcher_phases = {"preflight": prepared - started_wall, "imports_and_caches": time.time() - prepared}
    timeout_s = config.distributed.timeout_s
    # The watchdog ends a stalled probe at timeout_s and can name the stuck rank; the process
    # group's own timeout comes later so that it does not pre-empt the watchdog with a vaguer error.
    attempts = 0
    try:
        while True:
            attempts += 1
            args = (
                config.model_dump_json(),
                str(run_dir),
                started_wall,
                timeout_s + PG_TIMEOUT_GRACE_S,
                attempts,
                not verbose,
                fail_fast_json,
            )
            progress = HeartbeatProgress(config.name, config.train.steps)
            watchdog = Watchdog(
                run_dir,
                config.distributed.nproc,
                timeout_s,
                startup_timeout_s=config.distributed.startup_timeout_s,
                on_poll=progress.update,
            )
            try:
                entrypoint = script_worker if config.script is not None else probe_worker
                with watchdog, launcher.interrupts_as_keyboard_interrupt():
                    reports = launcher.launch_local(entrypoint, config.distributed.nproc, args, run_id=f"healthcheck-{config.name}")
                progress.update(read_beats(run_dir))  # the last steps may finish between two polls
                break
            except ProbeFailed:
                # Stuck before any rank trained: nothing was measured, so starting again changes no
                # result. Forked workers can, rarely, deadlock in start-up on state inherited from the
                # launcher; launcher._protect_forked_workers closes the causes seen so far, and this
                # keeps an unknown one from costing a whole distributed.timeout_s.
                if not (watchdog.stalled_in_startup and attempts < STARTUP_ATTEMPTS):
                    raise
                progress.close()
                print(
                    f"healthcheck: {watchdog.fired}; relaunching the workers (attempt {attempts + 1} of {STARTUP_ATTEMPTS})",
                    file=sys.stderr,
                    flush=True,
                )
                clear_launch_state(run_dir)
    except ProbeFailed as exc:
        failure = watchdog.fired or describe_failure(run_dir, exc.message, exc.signals)
        result = build_result(
            config=config,
            run_dir=run_dir,
            started_at=started_at,
            started_wall=started_wall,
            report=None,
            status="incomplete",
            failure=failure,
        )
        bad_input = input_error_in_workers(run_dir)
        if bad_input and not watchdog.fired:
            write_result(run_dir, result)
            raise InvalidInput(bad_input) from None
    except KeyboardInterrupt:
        result = build_result(
            config=config,
            run_dir=run_dir,
            started_at=started_at,
            started_wall=started_wall,
            report=None,
            status="interrupted",
            failure="interrupted by a signal or Ctrl-C",
        )
    else:
        result = build_result(
            config=config,
            run_dir=run_dir,
            started_at=started_at,
            started_wall=started_wall,
            report=reports.get(0),
            status="complete",
            launcher_phases=launcher_phases,
        )
    progress.close()  # the progress line ends before the report prints
    result.timing.launch_attempts = attempts
    write_result(run_dir, result)
    return result, run_dir


def clear_launch_state(run_dir: Path) -> None:
    """Remove what a stalled launch left (heartbeats, error reports) so the next one starts clean."""
    for folder in (run_dir / HEARTBEAT_DIR, run_dir / ERRORS_DIR):
        shutil.rmtree(folder, ignore_errors=True)


def _agree_on_run_dir(config: ProbeConfig, run_dir: Optional[Path]) -> str:
    """Collective: rank 0 claims the run directory and every rank learns it (or rank 0's refusal)."""
    chosen, refusal = None, None
    if hdist.rank() == 0:
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
    assert chosen is not None
    return chosen


def _run_as_worker(
    config: ProbeConfig, run_dir: Optional[Path], started_wall: float, started_at: str, fail_fast_json: Optional[str]
) -> tuple[Optional[RunResult], Path]:
    """Under torchrun: every process is one worker; rank 0 picks the run directory and writes the result.

    A --script probe leaves the process group to the script (it calls init_process_group itself), so
    the directory is agreed on inside that call; the built-in probe creates the group first.
    """
    if config.script is not None:
        chosen_box: list[str] = []

        def choose() -> str:
            chosen_box.append(_agree_on_run_dir(config, run_dir))
            return chosen_box[-1]

        report = script_worker(config.model_dump_json(), None, started_wall, fail_fast_json=fail_fast_json, choose_run_dir=choose)
        if not chosen_box:
            raise InvalidInput("the script never created a process group (torch.distributed.init_process_group)")
        run_path = Path(chosen_box[-1])
    else:
        device_type = hdist.resolve_device(config.distributed.device, hdist.get_dist_info().local_world_size)
        backend = hdist.resolve_backend(config.distributed.backend, device_type)
        hdist.init_distributed(device_type, backend, config.distributed.timeout_s)
        run_path = Path(_agree_on_run_dir(config, run_dir))
        report = probe_worker(config.model_dump_json(), str(run_path), started_wall, fail_fast_json=fail_fast_json)
    if hdist.get_dist_info().rank != 0:
        return None, run_path
    result = build_result(
        config=config, run_dir=run_path, started_at=started_at, started_wall=started_wall, report=report, status="complete"
    )
    write_result(run_path, result)
    return result, run_path


def _environment(report: WorkerReport) -> Environment:
    ranks = report.ranks
    first = ranks[0].versions if ranks else {}
    return Environment(
        python=first.get("python", platform.python_version()),
        torch=first.get("torch", "?"),
        transformers=first.get("transformers", "?"),
        healthcheck=__version__,
        platform=platform.platform(),
        device_type=report.device_type,
        device_reason=report.device_reason,
        backend=report.backend,
        world_size=report.world_size,
        nnodes=len({(r.node, r.node_rank) for r in ranks}) or 1,
        ranks=ranks,
    )


def build_result(
    *,
    config: ProbeConfig,
    run_dir: Path,
    started_at: str,
    started_wall: float,
    report: Optional[WorkerReport],
    status: Status,
    failure: Optional[str] = None,
    launcher_phases: Optional[dict[str, float]] = None,
) -> RunResult:
    """result.json from the step files written so far plus rank 0's report (when the workers finished)."""
    window_start = config.metrics.warmup_steps
    summary = summarize_run(run_dir, window_start)
    steps_completed = report.steps_completed if report else summary["last_step"] + 1
    running = status == "running"
    timing = Timing(
        started_at=started_at,
        finished_at=None if running else utc_now(),
        wall_s=None if running else time.time() - started_wall,
        startup_s=report.startup_s if report else None,
        train_s=report.train_s if report else None,
        mean_step_ms=report.train_s / report.steps_completed * 1000 if report and report.steps_completed else None,
        phases=_phases(launcher_phases or {}, report.phases if report else {}),
    )
    return RunResult(
        name=config.name,
        status=status,
        failure=failure,
        config=config,
        config_fingerprint=config.fingerprint(),
        environment=_environment(report) if report else None,
        timing=timing,
        steps_planned=config.train.steps,
        steps_completed=steps_completed,
        window_start_step=window_start,
        window_steps=summary["window_steps"],
        summary=summary["summary"],
        per_rank=summary["per_rank"],
        standouts=summary["standouts"],
        nonfinite=summary["nonfinite"],
        audits=run_audits(config, report, run_dir, summary["nonfinite"]) if report else {},
        loss_note=_loss_note(report),
        gradient_note=_gradient_note(report),
        stopped_early=report.stopped_early if report else None,
    )


def _phases(launcher: dict[str, float], worker: dict[str, float]) -> dict[str, float]:
    """The launcher's phases, then the workers': their ``launch`` (command start to worker entry) minus
    what the launcher accounts for is ``spawn``, the elastic launcher starting the processes.

    >>> _phases({"preflight": 0.5, "imports_and_caches": 4.0}, {"launch": 5.0, "rendezvous": 0.1})
    {'preflight': 0.5, 'imports_and_caches': 4.0, 'spawn': 0.5, 'rendezvous': 0.1}
    """
    phases = dict(launcher)
    rest = dict(worker)
    launch = rest.pop("launch", None)
    if launch is not None:
        phases["spawn" if launcher else "launch"] = max(0.0, launch - sum(launcher.values()))
    return {**phases, **rest}


def _loss_note(report: Optional[WorkerReport]) -> Optional[str]:
    """Why the per-rank loss was not measured: the first rank that could not see it, in its words."""
    found = first_loss_problem(report.evidence.per_rank) if report else None
    return f"rank {found[0]}, {found[1]}" if found else None


def _gradient_note(report: Optional[WorkerReport]) -> Optional[str]:
    """What the gradient metrics describe where it is not each rank's own step gradient, and the steps they skip."""
    notes = [note for note in (_accumulation_note(report), _overflow_note(report)) if note]
    return "; ".join(notes) or None


def _accumulation_note(report: Optional[WorkerReport]) -> Optional[str]:
    """Where a DDP script all-reduced more than once before its first update (accumulation without ``no_sync``,
    ``integrations/script/forwards.py``): what the gradient metrics then describe."""
    counts = {e.extra.get("ddp.reductions_in_step_0", "1") for e in (report.evidence.per_rank if report else ())}
    most = max((int(c) for c in counts if c.isdigit()), default=1)
    if most <= 1:
        return None
    return (
        f"the script all-reduces each of its micro-batches ({most} DDP reductions before its first update, no "
        "no_sync): DDP averages each into .grad before the next adds to it, so the gradient read at the last reduction "
        "is the last micro-batch's own plus the average of the earlier ones, and norms and cosines lean towards the "
        "mean; wrap all but the last backward in model.no_sync(), as accelerate and the Trainer do"
    )


def _overflow_note(report: Optional[WorkerReport]) -> Optional[str]:
    """The steps whose update every rank's GradScaler skipped in part (``integrations/script/scaler_skips.py``).

    >>> from types import SimpleNamespace as N
    >>> note = _overflow_note(N(evidence=N(scaler_overflows=[(3, [0, 1]), (4, [1])])))
    >>> note.split(" in the parameters")[0]
    'steps 3, 4 not measured: the GradScaler found inf or NaN gradients (local on ranks 0, 1)'
    """
    overflows = report.evidence.scaler_overflows if report else []
    if not overflows:
        return None
    steps = ", ".join(str(step) for step, _ in overflows)
    ranks = ", ".join(str(rank) for rank in sorted({rank for _, ranks in overflows for rank in ranks}))
    return (
        f"step{'s' if len(overflows) > 1 else ''} {steps} not measured: the GradScaler found inf or NaN gradients "
        f"(local on ranks {ranks}) in the parameters of some of the script's optimizers and skipped those, while the others stepped"
    )
