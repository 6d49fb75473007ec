"""The ``healthcheck`` command: parse, validate, call one function, map the outcome to an exit code.

No training, judging or rendering logic lives here; each subcommand hands a validated config or
path to the module that owns the work.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn, Optional

from healthcheck.errors import ExitCode, HealthcheckError, InvalidInput, one_line
from healthcheck.version import __version__

EXIT_CODES_HELP = """exit codes:
  0  pass: every envelope and audit check passed
  1  silent inconsistency detected: an envelope was violated or an audit failed
  2  invalid input: bad config or --set, bad/corrupt baseline, no baseline for this probe or one
     recorded for another layout or training program, a config whose statistical window is
     empty, missing model dir or data file, unwritable output directory
  3  the probe could not finish: a worker crashed or hung (timeout), or it was interrupted
"""


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="probe config YAML (default: the embedded default probe)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config field (repeatable; validated like the file), e.g. --set train.steps=20",
    )
    parser.add_argument(
        "--script",
        metavar="PATH",
        help="probe this training script, unmodified, instead of the built-in trainer (the config's script.path); "
        "its own arguments follow --",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="--script names a module, run as `python -m NAME` runs it (as torchrun's -m; the config's script.module)",
    )


#: Subcommands that take a script's arguments after ``--``.
SCRIPT_COMMANDS = {("probe",), ("baseline", "record"), ("config", "show"), ("config", "check")}


def split_script_args(argv: list[str]) -> tuple[list[str], Optional[list[str]]]:
    """``healthcheck ... -- ARGS``: the arguments before ``--`` and the script's (None without ``--``).

    >>> split_script_args(["probe", "--script", "t.py", "--", "--lr", "1e-4"])
    (['probe', '--script', 't.py'], ['--lr', '1e-4'])
    """
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _load(args: argparse.Namespace) -> Any:
    """The config of a command with --config/--set/--script (and the script's arguments)."""
    from healthcheck.config import load_config

    if args.module and args.script is None:
        raise InvalidInput("-m/--module makes --script's value a module's name; give --script NAME -m")
    return load_config(args.config, args.sets, script=args.script, script_args=args.script_args, module=args.module)


def _record_hint(args: argparse.Namespace) -> str:
    from healthcheck.judge.baseline import record_command

    return record_command(args.config, args.sets, args.script, args.script_args, module=args.module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthcheck",
        description="Catch silent worker-level inconsistency in data-parallel fine-tuning before you launch.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"healthcheck {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    probe = commands.add_parser(
        "probe",
        help="run a distributed fine-tuning probe and judge it against its baseline",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(probe)
    probe.add_argument("--out", metavar="DIR", type=Path, help="run directory (default: runs/<name>-<UTC timestamp>/)")
    probe.add_argument(
        "--baseline", metavar="FILE", type=Path, help="baseline to judge against (default: config's, else baselines/<name>.json)"
    )
    probe.add_argument("--force", action="store_true", help="compare even if the baseline was recorded for another world size/device")
    probe.add_argument(
        "--no-judge", action="store_true", help="run and record only; skip the baseline verdict (exit 0 if the probe finished)"
    )
    probe.add_argument(
        "--verbose", action="store_true", help="show every worker's output on the console (default: RUN_DIR/logs/rank-N.log)"
    )
    probe.add_argument(
        "--no-plots",
        action="store_true",
        help="skip the PNG plots (report.md then has none; report.html draws its own charts; "
        "`healthcheck report RUN_DIR` draws them later)",
    )
    probe.add_argument(
        "--audits-only",
        action="store_true",
        help="judge the exact audits against their ideal expectations; no baseline needed, no envelope judged",
    )
    probe.add_argument(
        "--no-fail-fast",
        action="store_true",
        help="run every step even after a decisive audit failure (default: stop every rank at the "
        "first one, exit 1; a non-finite value stops the run either way)",
    )

    config = commands.add_parser("config", help="show the resolved config or its JSON Schema")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the fully resolved config as YAML (re-usable with --config)")
    _add_config_args(show)
    config_commands.add_parser("schema", help="print the config's JSON Schema (for editor autocompletion)")
    check = config_commands.add_parser(
        "check", help="validate the config and its inputs (model dir, data files, presets) without running anything"
    )
    _add_config_args(check)

    baseline = commands.add_parser("baseline", help="record, update or show a baseline")
    baseline_commands = baseline.add_subparsers(dest="baseline_command", required=True, metavar="ACTION")
    record = baseline_commands.add_parser("record", help="run K probes with seeds seed..seed+K-1 and fit the envelopes")
    _add_config_args(record)
    record.add_argument("--repeats", type=int, default=5, metavar="K", help="probes to fit from (default 5, at least 3)")
    record.add_argument("--reason", default="initial baseline", help="why this baseline is approved")
    record.add_argument("--approved-by", default=None, help="who approved it (default: $USER)")
    record.add_argument("--output", type=Path, help="baseline file (default: the config's baseline path)")
    record.add_argument("--runs-root", type=Path, default=Path("runs"), help="where the K run directories go")
    update = baseline_commands.add_parser("update", help="build a baseline from finished, approved runs")
    update.add_argument("--from", dest="run_dirs", nargs="+", type=Path, required=True, metavar="RUN_DIR")
    update.add_argument("--reason", required=True, help="why the change is approved (kept in the baseline)")
    update.add_argument("--approved-by", default=None)
    update.add_argument("--output", type=Path, help="baseline file (default: the runs' config baseline path)")
    show_baseline = baseline_commands.add_parser("show", help="print a baseline readably")
    show_baseline.add_argument("path", type=Path)

    compare = commands.add_parser(
        "compare",
        help="judge a finished run against a baseline without re-running it",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("run_dir", type=Path)
    compare.add_argument("--baseline", type=Path, help="default: the run config's baseline path")
    compare.add_argument("--force", action="store_true", help="compare despite a world-size/device mismatch")
    compare.add_argument("--audits-only", action="store_true", help="judge only the exact audits (no baseline)")

    report = commands.add_parser("report", help="re-render the report and its files from a finished run")
    report.add_argument("run_dir", type=Path)

    scenarios = commands.add_parser("scenarios", help="the fault-injection catalogue")
    scenario_commands = scenarios.add_subparsers(dest="scenarios_command", required=True, metavar="ACTION")
    scenario_commands.add_parser("list", help="list the named faults")
    run = scenario_commands.add_parser("run", help="run named faults against the default probe and its baseline")
    run.add_argument("names", nargs="+", metavar="NAME")
    run.add_argument("--seeds", type=int, default=1, metavar="R", help="seeds per scenario (default 1)")
    run.add_argument("--baseline", type=Path, help="default: the base probe's (baselines/default.json, or default-fsdp.json)")
    run.add_argument("--runs-root", type=Path, default=Path("runs"), help="where the run directories go")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the base probe every fault is injected into (e.g. distributed.strategy=fsdp); repeatable",
    )
    return parser


# --------------------------------------------------------------------------- commands


def cmd_probe(args) -> int:
    from healthcheck.config.window import empty_window
    from healthcheck.gate import gate_run
    from healthcheck.run.probe import run_probe

    config = _load(args)
    empty = empty_window(config) if not (args.audits_only or args.no_judge) else None
    if empty:  # every envelope would fail as "not recorded": refused before any worker starts
        raise InvalidInput(f"{empty}: no envelope can be judged; raise train.steps, lower metrics.warmup_steps, or pass --audits-only")
    baseline_path = args.baseline or config.baseline_path()
    result, run_dir = run_probe(config, args.out, verbose=args.verbose, fail_fast=_fail_fast_policy(args, baseline_path))
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return int(ExitCode.PASS)
    return gate_run(
        result,
        run_dir,
        baseline_path,
        force=args.force,
        record_hint=_record_hint(args),
        judge_against_baseline=not args.no_judge,
        audits_only=args.audits_only,
        plots=not args.no_plots,
    )


def _fail_fast_policy(args: argparse.Namespace, baseline_path: Path) -> Any:
    """Stop at decisive failures unless --no-fail-fast or --no-judge; spare what the baseline approves.

    A missing or unreadable baseline approves nothing here: the gate reports it after the run.
    """
    from healthcheck.artifacts import FailFastPolicy
    from healthcheck.errors import BaselineError
    from healthcheck.judge.baseline import load_baseline

    if args.no_fail_fast or args.no_judge:
        return FailFastPolicy(enabled=False)
    approved: dict[str, str] = {}
    if not args.audits_only:
        try:
            approved = dict(load_baseline(baseline_path).audits)
        except BaselineError:
            pass
    return FailFastPolicy(approved=approved)


def cmd_config(args) -> int:
    from healthcheck.config import dump_yaml, json_schema

    if args.config_command == "schema":
        print(json.dumps(json_schema(), indent=2))
    elif args.config_command == "check":
        from healthcheck.run.probe import preflight

        config = _load(args)
        preflight(config)
        what = f" (script {config.script.target})" if config.script else ""
        print(f"config OK: probe {config.name!r}, {config.distributed.nproc} workers{what}, fingerprint {config.fingerprint()}")
    else:
        print(dump_yaml(_load(args)), end="")
    return int(ExitCode.PASS)


def cmd_baseline(args) -> int:
    from healthcheck.judge import baseline as baselines

    if args.baseline_command == "show":
        from healthcheck.outputs.baseline_text import render_baseline_text

        print(render_baseline_text(baselines.load_baseline(args.path)))
        return int(ExitCode.PASS)
    if args.baseline_command == "update":
        built = baselines.baseline_from_runs(args.run_dirs, reason=args.reason, approved_by=args.approved_by)
        output = args.output or built.config_snapshot_baseline_path()
    else:
        from healthcheck.run.recording import record_baseline

        if args.repeats < 3:
            raise InvalidInput(f"--repeats: at least 3 probes are needed to fit an envelope, got {args.repeats}")
        from healthcheck.config.window import empty_window

        config = _load(args)
        if empty := empty_window(config):
            raise InvalidInput(f"{empty}: no envelope can be fitted; raise train.steps or lower metrics.warmup_steps")
        built = record_baseline(config, args.repeats, runs_root=args.runs_root, reason=args.reason, approved_by=args.approved_by)
        output = args.output or config.baseline_path()
    baselines.save_baseline(built, output)
    print(f"baseline written: {output}")
    return int(ExitCode.PASS)


def cmd_compare(args) -> int:
    from healthcheck.artifacts import load_result
    from healthcheck.gate import gate_run
    from healthcheck.judge.baseline import record_command

    result = load_result(args.run_dir)
    baseline_path = args.baseline or result.config.baseline_path()
    hint = record_command(str(args.run_dir / "config.yaml"))
    return gate_run(result, args.run_dir, baseline_path, force=args.force, record_hint=hint, audits_only=args.audits_only)


def cmd_report(args) -> int:
    from healthcheck.gate import rerender

    return rerender(args.run_dir)


def cmd_scenarios(args) -> int:
    from healthcheck.run import scenarios

    if args.scenarios_command == "list":
        scenarios.print_catalogue()
        return int(ExitCode.PASS)
    return scenarios.run_named(args.names, seeds=args.seeds, baseline=args.baseline, runs_root=args.runs_root, base_sets=args.overrides)


COMMANDS = {
    "probe": cmd_probe,
    "config": cmd_config,
    "baseline": cmd_baseline,
    "compare": cmd_compare,
    "report": cmd_report,
    "scenarios": cmd_scenarios,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    own, script_args = split_script_args(list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(own)
    command = tuple(v for v in (args.command, getattr(args, f"{args.command}_command", None)) if v)
    if unknown:
        hint = ""
        if command in SCRIPT_COMMANDS and getattr(args, "script", None):  # the likeliest cause, said where it happens
            hint = f"; a script's own arguments go after --: healthcheck {' '.join(command)} --script PATH [options] -- {' '.join(unknown)}"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if script_args is not None and command not in SCRIPT_COMMANDS:
        parser.error(f"arguments after -- are a script's; {' '.join(command)} takes none")
    args.script_args = script_args
    try:
        return COMMANDS[args.command](args)
    except HealthcheckError as exc:
        # One line, always: a CI log reader greps for it, and user text can carry newlines.
        print(f"healthcheck: error: {one_line(exc.message)}", file=sys.stderr)
        return int(exc.exit_code)
    except BrokenPipeError:
        # `healthcheck baseline show X | head`: the reader left; that is not an error of ours. Before
        # OSError, which it subclasses. stdout goes to /dev/null so the interpreter's final flush
        # does not raise again on the closed pipe.
        _silence_stdout()
        return int(ExitCode.PASS)
    except OSError as exc:
        # Output that cannot be written (disk full, read-only mount) after the inputs were accepted.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"healthcheck: error: {where}cannot write ({exc.strerror or exc})", file=sys.stderr)
        return int(ExitCode.INVALID_INPUT)
    except KeyboardInterrupt:
        print("healthcheck: interrupted", file=sys.stderr)
        return int(ExitCode.PROBE_FAILED)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (pytest capture): nothing to flush
        pass


def run(argv: list[str] | None = None) -> NoReturn:
    """The ``healthcheck`` console script and ``python -m healthcheck``: :func:`main`, then out of the process
    without the interpreter's teardown.

    Python frees every module one by one as it exits: with torch and transformers loaded that took 1.2-1.3 s of a
    4-rank script probe on the 2-core host (``benchmarks/script_startup.py --arms default teardown``), after the last
    artifact was written, on every probe a CI job runs. Nothing is lost by
    skipping it: the non-daemon threads are joined and the ``atexit`` handlers run (logging's flush, temporary
    folders), as at a normal exit, and every file healthcheck writes is closed or flushed per row before
    :func:`main` returns. An exception out of :func:`main` still takes the normal path, traceback and all.
    """
    code = main(argv)
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (`| head`), or a stream already closed
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
