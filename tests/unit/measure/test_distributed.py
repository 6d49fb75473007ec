"""Device and backend selection (``healthcheck.measure.distributed``), with CUDA and torch_npu simulated.

No accelerator is needed: ``torch.cuda.is_available``/``device_count`` are monkeypatched, and the
NPU path is driven by a missing or fake ``torch_npu`` module in ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
import typing

import pytest
import torch

from healthcheck.config import DistributedConfig
from healthcheck.errors import ExitCode, InvalidInput
from healthcheck.measure import distributed


def fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def fake_torch_npu(monkeypatch, available: bool) -> None:
    """Stand in for Ascend's torch_npu: importable, and registering ``torch.npu`` as it does."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: available), raising=False)


def invalid(requested: str, local_world_size: int = 1) -> str:
    with pytest.raises(InvalidInput) as info:
        distributed.resolve_device(requested, local_world_size)
    assert info.value.exit_code == ExitCode.INVALID_INPUT
    assert info.value.message.startswith("distributed.device: ") and "\n" not in info.value.message
    return info.value.message


def test_cpu_is_always_cpu(monkeypatch):
    fake_cuda(monkeypatch, 8)
    assert distributed.resolve_device("cpu", 8) == "cpu"


@pytest.mark.parametrize(
    ("gpus", "local_workers", "expected"),
    [(0, 1, "cpu"), (0, 8, "cpu"), (8, 8, "cuda"), (8, 4, "cuda"), (4, 8, "cpu"), (1, 2, "cpu")],
)
def test_auto_takes_cuda_only_with_one_gpu_per_local_worker(monkeypatch, gpus, local_workers, expected):
    # NCCL refuses two ranks on one GPU, so too few GPUs means the CPU, not a crash.
    fake_cuda(monkeypatch, gpus)
    assert distributed.resolve_device("auto", local_workers) == expected


@pytest.mark.parametrize(
    ("gpus", "local_workers", "requested", "expected"),
    [(0, 8, "auto", "no CUDA device is visible"), (4, 8, "auto", "4 GPU(s) for 8 local workers"),
     (8, 8, "auto", "one GPU per worker"), (8, 8, "cpu", "device=cpu was requested")],
)
def test_the_device_choice_records_its_reason(monkeypatch, gpus, local_workers, requested, expected):
    fake_cuda(monkeypatch, gpus)
    resolved = distributed.resolve_device(requested, local_workers)
    assert expected in distributed.device_reason(requested, resolved, local_workers)


def test_auto_never_picks_an_npu(monkeypatch):
    fake_cuda(monkeypatch, 0)
    fake_torch_npu(monkeypatch, available=True)
    assert distributed.resolve_device("auto", 8) == "cpu"


def test_cuda_requested_with_enough_gpus(monkeypatch):
    fake_cuda(monkeypatch, 8)
    assert distributed.resolve_device("cuda", 8) == "cuda"


def test_cuda_requested_without_cuda_is_invalid_input(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert "torch.cuda.is_available() is False" in invalid("cuda")


def test_cuda_requested_with_too_few_gpus_names_both_counts(monkeypatch):
    fake_cuda(monkeypatch, 2)
    message = invalid("cuda", 4)
    assert "one GPU per local worker" in message and "have 2" in message and "nproc is 4" in message


def test_npu_without_torch_npu_says_how_to_install_it(monkeypatch):
    # A None entry makes `import torch_npu` raise ImportError, whatever is installed.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    message = invalid("npu")
    assert "needs torch_npu" in message and "pip install 'healthcheck[npu]'" in message


def test_npu_with_torch_npu_but_no_device_is_invalid_input(monkeypatch):
    fake_torch_npu(monkeypatch, available=False)
    assert "torch.npu.is_available() is False" in invalid("npu")


def test_npu_with_a_device(monkeypatch):
    fake_torch_npu(monkeypatch, available=True)
    assert distributed.resolve_device("npu", 8) == "npu"


def test_unknown_device_is_invalid_input():
    assert "expected auto, cpu, cuda or npu, got 'tpu'" in invalid("tpu")


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")])
def test_auto_backend_follows_the_device(device, backend):
    assert distributed.resolve_backend("auto", device) == backend


@pytest.mark.parametrize("explicit", ["gloo", "nccl", "hccl"])
def test_an_explicit_backend_is_kept(explicit):
    assert distributed.resolve_backend(explicit, "cuda") == explicit


def test_every_configurable_device_has_a_default_backend():
    devices = set(typing.get_args(DistributedConfig.model_fields["device"].annotation)) - {"auto"}
    backends = set(typing.get_args(DistributedConfig.model_fields["backend"].annotation)) - {"auto"}
    assert set(distributed.BACKEND_FOR_DEVICE) == devices
    assert set(distributed.BACKEND_FOR_DEVICE.values()) == backends


def test_torch_device_puts_each_local_rank_on_its_own_accelerator():
    assert distributed.torch_device("cpu", 3) == torch.device("cpu")
    assert distributed.torch_device("cuda", 3) == torch.device("cuda", 3)


def test_the_launcher_refuses_an_npu_only_when_torch_npu_is_missing(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "path", [])  # nothing on the path: torch_npu cannot be found
    message = distributed.npu_missing_error("npu")
    assert message is not None and message.startswith("distributed.device: 'npu' needs torch_npu") and "\n" not in message
    assert distributed.npu_missing_error("auto") is None and distributed.npu_missing_error("cuda") is None
    fake_torch_npu(monkeypatch, available=True)  # installed (here: already imported, without a spec)
    assert distributed.npu_missing_error("npu") is None


_SIGTERM_CHILD = """
import os, signal, sys
from healthcheck.measure.distributed import terminable_while_joining
signal.signal(signal.SIGTERM, lambda *_: (print("handled", flush=True), sys.exit(7)))  # the agent's, inherited
if sys.argv[1] == "joining":
    with terminable_while_joining():
        os.kill(os.getpid(), signal.SIGTERM)  # a C++ wait would never run the Python handler: the default ends it
else:
    with terminable_while_joining():
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # joined: the handler is back, and a salvage can run
"""


@pytest.mark.parametrize(("phase", "code", "printed"), [("joining", -15, ""), ("joined", 7, "handled\n")])
def test_sigterm_ends_a_worker_at_once_only_while_it_joins_the_process_group(phase, code, printed):
    import subprocess

    done = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD, phase], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (code, printed), done.stderr
