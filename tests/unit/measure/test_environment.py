"""The environment audit's facts about a rank's math: settings that change its results, read as torch holds them."""

from __future__ import annotations

import pytest
import torch

from healthcheck.judge.exact_audits import environment_audit
from healthcheck.measure import environment
from healthcheck.measure.environment import numerics, rank_environment


@pytest.fixture
def restored():
    cuda, mkldnn = torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision
    flash = torch.backends.cuda.flash_sdp_enabled()
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = cuda, mkldnn
    torch.backends.cuda.enable_flash_sdp(flash)


def _audit(rows):
    return environment_audit([{"versions": row, "env": {}, "device_name": "cpu", "precision": "fp32"} for row in rows])


def test_a_rank_that_lowers_its_matmul_precision_or_drops_an_attention_kernel_is_named(restored):
    clean = numerics()
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # what allow_tf32 = True sets
    tf32 = numerics()
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # set explicitly: the same math as never set
    assert numerics() == clean
    torch.backends.cuda.enable_flash_sdp(False)
    no_flash = numerics()
    assert tf32["fp32_precision.cuda.matmul"] == "tf32" and clean["fp32_precision.cuda.matmul"] == "ieee"
    outcome = _audit([clean, clean, tf32, clean])
    assert not outcome.passed and outcome.ranks == (2,)
    assert outcome.message == "fp32_precision.cuda.matmul differs: ranks 0-1, 3 ieee; rank 2 tf32"
    outcome = _audit([no_flash, clean, clean, clean])
    assert outcome.ranks == (0,) and outcome.message.startswith("sdpa_kernels differs: ranks 1-3 flash, mem_efficient, math")
    assert _audit([clean] * 4).passed


def test_a_setting_torch_refuses_to_read_is_left_out():
    # Once a script mixed the legacy and new TF32 APIs, torch raises on the legacy getters.
    class Refusing:
        @property
        def allow_tf32(self):
            raise RuntimeError("PyTorch is checking whether allow_tf32_new is enabled for cuBlas matmul")

    assert environment._read(Refusing(), "allow_tf32") is None and environment._read(Refusing(), "missing") is None
    assert environment._read(torch.backends, "cuda.flash_sdp_enabled", call=True) in ("True", "False")


def test_the_variables_that_change_cublas_math_are_compared(monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    env = rank_environment()
    assert env["NVIDIA_TF32_OVERRIDE"] == "0" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "UNRELATED_SETTING" not in env


def test_a_rank_that_prefers_another_gemm_library_is_named(monkeypatch):
    # torch.backends.cuda.preferred_blas_library("cublaslt") on one node: other kernels for every matmul. (This CPU
    # build refuses to set cuBLASLt, so the getter is replaced.)
    clean = numerics()
    assert clean["cuda.preferred_blas_library"] == "Cublas" and clean["cuda.preferred_linalg_library"] == "Default"
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda backend=None: "_BlasBackend.Cublaslt")
    outcome = _audit([clean, numerics(), clean])
    assert not outcome.passed and outcome.ranks == (1,)
    assert outcome.message == "cuda.preferred_blas_library differs: ranks 0, 2 Cublas; rank 1 Cublaslt"
