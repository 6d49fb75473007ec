"""Smoke test of ``benchmarks/gpu_bucket_cost.py``'s two tables without a GPU: Triton's interpreter runs the kernel
on host tensors, the CUDA-event timer is replaced by one call (the numbers are the GPU's to give), and the host
table's all-reduces go over a 1-rank gloo group.

    python -m pytest tests/unit/benchmarks/test_gpu_bucket_cost_script.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.benchmark_scripts import BENCHMARKS

SCRIPT = textwrap.dedent(
    f"""
    import argparse, importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("gpu_bucket_cost", {str(BENCHMARKS / "gpu_bucket_cost.py")!r})
    cost = importlib.util.module_from_spec(spec); spec.loader.exec_module(cost)
    cost.gpu_us = lambda fn, repeats: (fn(), 1.0)[1]
    args = argparse.Namespace(numel=70_000, repeats=1, buckets=42, settings=["128x4xf32", "64x2xi8"])
    torch.cuda.synchronize = lambda: None  # nothing to wait for on the host
    real_randn, real_zeros = torch.randn, torch.zeros
    torch.randn = lambda *a, device=None, **k: real_randn(*a, **k)
    torch.zeros = lambda *a, device=None, **k: real_zeros(*a, **k)
    cost.kernel_table(args)
    # The host table: every row's call, the monitor's planned one among them, on a 1-rank gloo group.
    import socket, torch.distributed as dist
    from healthcheck.measure import sketch, sketch_kernel
    sketch._kernel_for = lambda x: sketch_kernel  # as for a CUDA bucket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=0, world_size=1)
    cost.host_table(argparse.Namespace(small=65_536, buckets=42, calls=1))
    dist.destroy_process_group()
    """
)


def test_the_kernel_rows_run_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    alone = [line for line in lines if "launch alone" in line]
    assert [line.split("|")[1].strip() for line in alone] == [
        "the default kernel's launch alone, division off", "the default kernel's launch alone, division on"]
    assert any(line.startswith("| the table's zero_ (42 x ") for line in lines)
    hosted = [line.split("|")[1].strip() for line in lines[lines.index("|---|---:|") + 1:]]
    assert len(hosted) == 10 and hosted[:4] == [
        "the kernel's launch (Triton JIT)", "the monitor's planned call (its table row, the launch)",
        "DeviceBucket.divide_square_sketch (a vector of its own, the launch)", "the table's zero_ (42 rows, once a step)"]
    # Both settings' sketches agree with the first's, and the division is div_'s (the interpreter truncates bf16, so
    # only the sketch's agreement is asserted here; the CUDA test checks the bits).
    settings = [line for line in lines if line.startswith("| kernel ")]
    assert len(settings) == 2 and all(float(line.split("off the first by ")[1].split(";")[0]) <= 1e-6 for line in settings)
