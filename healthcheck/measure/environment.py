"""What a rank runs on and with, for the environment audit: software versions, determinism settings,
communication variables and the device's name."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def versions() -> dict[str, str]:
    """The software, determinism and math settings a rank runs with (compared by the environment audit)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": installed_version("transformers")}
    out.update(stack_versions())
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
        out.update(cuda_libraries())
    out["deterministic_algorithms"] = str(torch.are_deterministic_algorithms_enabled())
    out["cudnn_deterministic"] = str(torch.backends.cudnn.deterministic)
    out["cudnn_benchmark"] = str(torch.backends.cudnn.benchmark)
    out.update(numerics())
    return out


def installed_version(name: str) -> str:
    """A package's version without importing it: a script that never imports transformers would otherwise pay
    its import (about 0.5 s of CPU) on every rank. The imported module's own ``__version__`` where the script
    has it (a source checkout may carry stale metadata), else the installed distribution's.

    >>> installed_version("healthcheck-no-such-package")
    'not installed'
    """
    module = sys.modules.get(name)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


#: The rest of the training stack, where installed: a node with another TRL computes another loss (its defaults
#: move between releases), another accelerate clips otherwise (1.16 reduces the norm in a call of its own), another
#: Triton or flash-attn runs other kernels, and one without flash-attn falls back to another attention (``kernels``,
#: the Hub's kernel loader, wraps transformers' attention forwards where it is installed).
STACK_PACKAGES = ("accelerate", "trl", "peft", "datasets", "tokenizers", "safetensors", "numpy", "triton", "lightning",
                  "deepspeed", "flash_attn", "bitsandbytes", "liger_kernel", "torchao", "kernels")


def stack_versions() -> dict[str, str]:
    """The version of each of :data:`STACK_PACKAGES` installed here (one missing on some ranks reads ``<unset>``
    there). About 25 ms of metadata lookups, once per rank.

    >>> stack_versions()["numpy"] == __import__("numpy").__version__
    True
    """
    found = {name: installed_version(name) for name in STACK_PACKAGES}
    return {name: version for name, version in found.items() if version != "not installed"}


def cuda_libraries() -> dict[str, str]:
    """The cuDNN and NCCL versions this process loaded: a node whose library path finds another copy than the one
    torch's wheel brought runs other kernels, or another all-reduce, under the same torch and CUDA versions."""
    import torch

    out = {}
    try:
        out["cudnn"] = str(torch.backends.cudnn.version())
    except (RuntimeError, OSError):  # no cuDNN to load
        pass
    try:
        nccl = torch.cuda.nccl.version()  # (major, minor, patch), an int in older torch
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (RuntimeError, AttributeError):  # built without NCCL
        pass
    return out


#: The fp32 math of each backend a script can lower: TF32 in cuBLAS and cuDNN, bf16 in oneDNN on a CPU.
_FP32_BACKENDS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv")
_CUDA_MATMUL_FLAGS = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction", "allow_fp16_accumulation")
_SDPA_KERNELS = ("flash", "mem_efficient", "math", "cudnn")


def numerics() -> dict[str, str]:
    """The process-wide math settings that change a rank's results without changing its code: a script (or a
    per-node config) that calls ``torch.set_float32_matmul_precision("high")``, sets ``allow_tf32`` or turns off
    an attention kernel on some ranks computes other gradients from the same batch.

    Each fp32 backend's precision is read through torch's per-backend API (2.9 and later), where ``none``
    (inherit, never set) means full precision, as ``ieee`` does: equal math is equal text. Before that API,
    the legacy TF32 flags. A setting this torch lacks, or that it refuses to read (mixing the legacy and new
    APIs makes some getters raise), is left out.

    >>> import torch
    >>> before = numerics()
    >>> torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    >>> {k: (before[k], v) for k, v in numerics().items() if v != before[k]}
    {'fp32_precision.mkldnn.matmul': ('ieee', 'bf16')}
    >>> torch.backends.mkldnn.matmul.fp32_precision = "none"
    >>> numerics() == before
    True
    """
    import torch

    out: dict[str, str] = {}
    for path in _FP32_BACKENDS:
        value = _read(torch.backends, f"{path}.fp32_precision")
        if value is not None:
            out[f"fp32_precision.{path}"] = "ieee" if value == "none" else value
    if not out:  # torch before the per-backend API
        for key, attribute in (("fp32_precision.cuda.matmul", "cuda.matmul.allow_tf32"), ("fp32_precision.cudnn", "cudnn.allow_tf32")):
            value = _read(torch.backends, attribute)
            if value is not None:
                out[key] = "tf32" if value == "True" else "ieee"
    for flag in _CUDA_MATMUL_FLAGS:
        value = _read(torch.backends, f"cuda.matmul.{flag}")
        if value is not None:
            out[f"cuda.matmul.{flag}"] = value
    # The GEMM and linear-algebra libraries torch.backends.cuda.preferred_*_library picks (cuBLAS or cuBLASLt,
    # hipBLAS or hipBLASLt on ROCm; cuSOLVER or MAGMA): a per-node choice, other kernels for the same matmul.
    for library in ("blas", "linalg"):
        value = _read(torch.backends, f"cuda.preferred_{library}_library", call=True)
        if value is not None:
            out[f"cuda.preferred_{library}_library"] = value.rpartition(".")[2]
    kernels = [name for name in _SDPA_KERNELS if _read(torch.backends, f"cuda.{name}_sdp_enabled", call=True) == "True"]
    out["sdpa_kernels"] = ", ".join(kernels) or "none"
    return out


def _read(root: Any, dotted: str, call: bool = False) -> str | None:
    """``root.a.b`` (called when ``call``) as text; None where torch lacks it or refuses to read it."""
    try:
        value = root
        for part in dotted.split("."):
            value = getattr(value, part)
        return str(value() if call else value)
    except (AttributeError, RuntimeError):
        return None


#: Communication and runtime variables; NVIDIA_TF32_OVERRIDE, CUBLAS_WORKSPACE_CONFIG and cuBLASLt's workspace change
#: cuBLAS's math, PyTorch's TunableOp (``PYTORCH_TUNABLEOP_ENABLED``) picks GEMM kernels by timing them, Transformer
#: Engine's ``NVTE_*`` its attention backend, and the compiler's (``TORCHINDUCTOR_MAX_AUTOTUNE``, ``TORCHDYNAMO_DISABLE``,
#: ``TRITON_F32_DEFAULT``) the kernels a compiled model runs.
ENV_PREFIXES = ("NCCL_", "HCCL_", "TORCH_", "CUDA_VISIBLE_DEVICES", "ASCEND_", "NVIDIA_TF32_OVERRIDE", "CUBLAS_",
                "CUBLASLT_", "PYTORCH_TUNABLEOP_", "NVTE_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TRITON_")
#: Variables that differ between ranks by design (one device per rank), so they are not compared.
PER_RANK_ENV = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES", "ASCEND_DEVICE_ID")
#: Variables that name a node's own files (``TORCH_HOME``, ``TORCHINDUCTOR_CACHE_DIR``, ``NCCL_TOPO_FILE``,
#: ``PYTORCH_TUNABLEOP_FILENAME``): a cluster points them at each node's disk, often a folder per rank so that compile
#: caches do not race, and the path is no setting of the math. Not compared, as the Trainer's ``*_dir`` arguments are
#: not.
NODE_FILE_SUFFIXES = ("_DIR", "_PATH", "_FILE", "_FILENAME", "_HOME")
#: Variables that name a node's network interfaces, adapters or address: a cluster whose nodes name their NICs
#: differently (``eth0`` and ``ens5``, ``mlx5_0`` and ``mlx5_2``) sets them per node, and Ascend's ``HCCL_IF_IP`` is the
#: node's own IP. Which wire carries the bytes changes no sum.
NODE_NETWORK_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_HOSTID", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME",
                    "HCCL_IF_BASE_PORT")
#: Diagnostics that change what a rank logs or dumps, never what it computes or which collectives it calls: a node
#: being debugged runs with ``NCCL_DEBUG=INFO`` or a flight recorder while the others do not, or on Ascend with CANN's
#: log level (``ASCEND_GLOBAL_LOG_LEVEL``, HCCL's logs included) turned up. (``TORCH_DISTRIBUTED_DEBUG`` is compared: at
#: ``DETAIL`` it checks each collective's shapes with collectives of its own.)
DIAGNOSTIC_ENV = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES",
                  "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DESYNC_DEBUG",
                  "TORCHDYNAMO_VERBOSE", "TRITON_PRINT_AUTOTUNING", "ASCEND_GLOBAL_LOG_LEVEL", "ASCEND_MODULE_LOG_LEVEL",
                  "ASCEND_SLOG_PRINT_TO_STDOUT", "ASCEND_GLOBAL_EVENT_ENABLE")


def compared_variable(name: str) -> bool:
    """Whether the environment audit compares the variable ``name`` across ranks.

    >>> [compared_variable(name) for name in ("NCCL_ALGO", "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME")]
    [True, False, False, False]
    >>> [compared_variable(name) for name in ("NCCL_PROTO", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG")]
    [True, False, False, True]
    >>> [compared_variable(name) for name in ("ASCEND_GLOBAL_LOG_LEVEL", "HCCL_ALGO")]
    [False, True]
    """
    return (name not in PER_RANK_ENV and name not in NODE_NETWORK_ENV and name not in DIAGNOSTIC_ENV
            and not name.endswith(NODE_FILE_SUFFIXES))


def rank_environment() -> dict[str, str]:
    """The communication/runtime variables of this rank (those :func:`compared_variable` names must agree)."""
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
