"""What a rank runs on and with, for the environment audit: software versions, determinism settings,
communication variables and the device's name."""

from __future__ import annotations

import os
import platform
from typing import Any


def versions() -> dict[str, str]:
    """The software and determinism settings a rank runs with (compared by the environment audit)."""
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
    out["deterministic_algorithms"] = str(torch.are_deterministic_algorithms_enabled())
    out["cudnn_deterministic"] = str(torch.backends.cudnn.deterministic)
    out["cudnn_benchmark"] = str(torch.backends.cudnn.benchmark)
    return out


ENV_PREFIXES = ("NCCL_", "HCCL_", "TORCH_", "CUDA_VISIBLE_DEVICES", "ASCEND_")


def rank_environment() -> dict[str, str]:
    """The communication/runtime variables that must agree across ranks (for the environment audit)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def device_name(device: Any) -> str:
    """Human name of a device: the GPU model, or the CPU's."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    return platform.processor() or platform.machine() or "cpu"


def rank_identity(info: Any, device: Any) -> dict[str, Any]:
    """The :class:`~healthcheck.artifacts.RankInfo` fields every kind of worker fills alike: where the rank runs
    (``info``: a :class:`~healthcheck.measure.distributed.DistInfo`) and with what software and variables."""
    return {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "node": info.node,
        "node_rank": info.node_rank,
        "device": str(device),
        "device_name": device_name(device),
        "versions": versions(),
        "env": rank_environment(),
    }


#: cuBLAS workspace settings under which its kernels are deterministic (the CUDA documentation's two).
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def replay_determinism(device: Any) -> tuple[str, str]:
    """How the replay audit can compare ranks on ``device``: ``("bitwise" | "tolerance", why)``.

    Equal inputs give equal bits on CPU (every rank runs the same kernels and thread count). On CUDA
    that needs ``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG`` set to one of
    :data:`DETERMINISTIC_CUBLAS`; without them ranks are compared within a tolerance measured from repeat
    replays on the same rank.
    """
    import torch

    if device.type == "cpu":
        return "bitwise", "CPU kernels are deterministic: equal parameters and batch give bit-identical gradients"
    missing = []
    if not torch.are_deterministic_algorithms_enabled():
        missing.append("torch.use_deterministic_algorithms(True)")
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if device.type == "cuda" and workspace not in DETERMINISTIC_CUBLAS:
        missing.append(f"CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS[0]}")
    if not missing:
        return "bitwise", f"{device.type} with deterministic algorithms (CUBLAS_WORKSPACE_CONFIG={workspace})"
    return (
        "tolerance",
        f"{device.type} without {' and '.join(missing)}: kernels may differ run to run, so replays are compared "
        "within a tolerance measured from repeat replays on each rank",
    )
