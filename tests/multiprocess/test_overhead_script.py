"""Smoke test of ``benchmarks/overhead.py``: its core runs end to end and prints the promised columns.

The numbers themselves are not checked (2 steps on a shared CPU say nothing); the benchmark is a
script whose table goes into the README, not a timed test.

    python -m pytest tests/unit/test_overhead_script.py -q
"""

from __future__ import annotations

import math

import pytest

from tests.benchmark_scripts import loaded_script, run_script


@pytest.fixture(scope="module")
def overhead():
    with loaded_script("overhead") as module:
        yield module


def test_cli_defaults_cover_the_matrix(overhead):
    args = overhead.parse_args([])
    assert overhead.plan_matrix(args.models, args.nproc, args.scaling_nproc) == [
        ("tiny-gpt2", 2), ("tiny-gpt2", 4), ("tiny-gpt2", 8), ("small-gpt2", 8),
    ]
    assert set(args.modes) == {"sketch", "exact"}
    assert overhead.parse_args(["--modes", "hook-only", "sketch-carry"]).modes == ["hook-only", "sketch-carry"]
    assert overhead.parse_args(["--modes", "python-hook"]).modes == ["python-hook"]


@pytest.mark.multiprocess
def test_two_ranks_two_steps_print_every_column(overhead):
    out = run_script("overhead", "--models", "tiny-gpt2", "--nproc", "2", "--modes", "sketch", "exact", "python-hook",
                     "--steps", "2", "--warmup", "1", "--block", "1")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["model"])
    assert lines[header].split() == list(overhead.COLUMNS)
    rows = [line.split() for line in lines[header + 1:header + 4]]
    assert [row[:3] for row in rows] == [["tiny-gpt2", "2", "sketch"], ["tiny-gpt2", "2", "exact"], ["tiny-gpt2", "2", "python-hook"]]
    for _model, _world, _mode, plain, monitored, ratio, ci90, paired, cpu_ratio in rows:
        assert float(plain) > 0 and float(monitored) > 0 and float(paired) > 0 and float(cpu_ratio) > 0
        assert math.isclose(float(ratio), float(monitored) / float(plain), rel_tol=0.02)  # printed to 0.1 ms and 0.001
        low, high = map(float, ci90.split("-"))
        assert 0 < low <= high
    assert lines[header + 4:] and lines[-1].startswith("# blocks of 1 steps, 1 warmup steps per arm")


def test_target_lines_name_both_target_settings(overhead):
    rows = [overhead.Row("tiny-gpt2", 8, "sketch", 10, 10.2, 1.02, (1.0, 1.04), 1.02, 1.02),
            overhead.Row("harness-llama", 8, "sketch", 10, 10.5, 1.05, (1.0, 1.1), 1.05, 1.05),
            overhead.Row("harness-llama", 8, "exact", 10, 15, 1.5, (1.4, 1.6), 1.5, 1.5)]
    assert overhead.target_lines(rows) == [
        "target sketch <= 1.03 on tiny-gpt2, 8 ranks: met (1.020)",
        "target sketch <= 1.03 on harness-llama, 8 ranks: MISSED (1.050)",
    ]


@pytest.mark.multiprocess
def test_hook_cost_smoke_run_on_cpu(capsys):
    # The GPU measurement's script, on a tiny model and one gloo rank: every arm runs and prints a row.
    with loaded_script("hook_cost") as hook_cost:
        results = hook_cost.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128",
                                  "--heads", "4", "--vocab", "256", "--seq", "32", "--steps", "2", "--warmup", "1", "--pieces",
                                  "--local-from", "grads", "--rounds", "3"])
    arms = ["plain", "hook-only", "sketch", "sketch-buckets", "sketch-torch", "exact"]
    assert list(results) == arms and all(r["step_ms"] > 0 for r in results.values())
    assert all(len(r["blocks"]) == 3 and all(len(block) == 2 for block in r["blocks"]) for r in results.values())
    out = capsys.readouterr().out
    table = out.splitlines()
    rows = [line.split(" | ")[0] for line in table if line.startswith("| ") and not line.startswith("| arm")]
    assert rows == [f"| {arm}" for arm in arms]
    # Each monitored arm's cost against the plain arm of the same rounds, with an interval from 3 rounds, and the target.
    costs = [line for line in table if " cost " in line and "90% interval" in line]
    assert [line.split(":")[0] for line in costs] == arms[1:], costs
    assert any(line.startswith("target sketch <= 1% of the plain step: ") for line in table)
    # --pieces timed the monitor's code in the monitored arms, and put the methods back afterwards.
    # The sketch arm read .grad with no comm hook (--local-from grads): its two callbacks, before DDP's finalize and
    # after it, ran; sketch-buckets' hook sketched each bucket.
    sketch = next(line for line in table if line.startswith("arm sketch, wall ms per timed step inside: "))
    assert "LocalGradientPass._local" in sketch and "LocalGradientPass._mean" in sketch and "_reduce_bucket" not in sketch
    buckets = next(line for line in table if line.startswith("arm sketch-buckets, wall ms per timed step inside: "))
    assert "WorkerConsistencyMonitor._reduce_bucket" in buckets and "LocalGradientPass" not in buckets
    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    assert WorkerConsistencyMonitor.__dict__["_reduce_bucket"].__qualname__ == "WorkerConsistencyMonitor._reduce_bucket"


@pytest.mark.multiprocess
def test_hook_cost_profile_prints_the_arms_top_ops_and_writes_a_trace(capsys, tmp_path):
    # --profile is how the GPU figures were taken apart (README); it must keep working where CI can run it.
    with loaded_script("hook_cost") as hook_cost:
        hook_cost.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4",
                        "--vocab", "256", "--seq", "32", "--steps", "1", "--warmup", "1", "--arms", "sketch",
                        "--profile", "5", "--trace", str(tmp_path / "trace")])
    out = capsys.readouterr().out
    assert "profile of arm sketch, 1 steps, by self_cpu_time_total:" in out and "aten::" in out
    assert (tmp_path / "trace-sketch.json").stat().st_size > 0


def test_sketch_cost_table(capsys):
    with loaded_script("sketch_cost") as sketch_cost:
        import sys

        argv, sys.argv = sys.argv, ["sketch_cost.py", "--sizes", "20000", "--repeats", "1"]
        try:
            sketch_cost.main()
        finally:
            sys.argv = argv
    sketches, reads, rows = [[cell.strip() for cell in line.strip("|").split("|")]
                             for line in capsys.readouterr().out.splitlines() if line.startswith("| 20,000 |")]
    # elements | before, drawn again, cold | after, cold | ratios | state before | state after
    assert all(float(c) > 0 for c in sketches[1:6]) and all(float(c) > 0 for c in sketches[6].split(","))
    assert sketches[7] == "0.1 MiB" and sketches[8] == "0 (256 KiB sign table, any model)"
    # The hook's reads of a host bucket: three passes, the one pass by numpy and by C (warm, then cold), the ratios.
    assert len(reads) == 8 and all(float(c) > 0 for c in reads[1:7])
    assert reads[7].endswith("(C)") and all(float(c) > 0 for c in reads[7].removesuffix("(C)").split(","))
    # The rows' hashes when nothing is cached (FSDP2's per-step salt): one segment, the loop and the arrays timed.
    assert rows[1] == "1" and all(float(c) > 0 for c in rows[2:5])


@pytest.mark.multiprocess
def test_fsdp_cost_smoke_run():
    # FSDP2 against DDP: every arm trains, and each of 2 sharded ranks holds half the gradient a DDP rank holds.
    out = run_script("fsdp_cost", "--model", "tiny-gpt2", "--nproc", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                     "--arms", "ddp", "fsdp", "fsdp+sketch")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-3:]}
    assert set(rows) == {"ddp", "fsdp", "fsdp+sketch"} and all(float(row[1]) > 0 for row in rows.values())
    assert float(rows["fsdp"][-1]) == pytest.approx(float(rows["ddp"][-1]) / 2, rel=0.05)
