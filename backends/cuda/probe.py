"""Can the CUDA backend run here? Answered without creating a CUDA context (and without importing
torch until asked: the plugin that declares the backend imports this module)."""

from __future__ import annotations

import importlib.util
import os

from deepinfer.plugins import Availability, import_optional

MIN_CAPABILITY = (9, 0)  # Hopper; the kernels target SM90 and SM100


def triton_version() -> str | None:
    module, _ = import_optional("triton") if importlib.util.find_spec("triton") else (None, None)
    return getattr(module, "__version__", None) if module else None


def nvml_capability() -> tuple[int, int] | None:
    """Compute capability of device 0 via NVML (no CUDA context); None when NVML is not at hand."""
    pynvml, _ = import_optional("pynvml")
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0)))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def device_count() -> int:
    """Visible NVIDIA GPUs (0 with a torch built without CUDA). torch counts them without a context."""
    import torch

    return torch.cuda.device_count() if torch.version.cuda is not None else 0


def probe(interpret: bool = False) -> Availability:
    triton = triton_version()
    if interpret:
        if triton is None:
            return Availability(False, "triton is not installed, so the kernels cannot run in the interpreter", "pip install 'deepinfer[cuda]' (or triton)")
        return Availability(True, f"Triton {triton} interpreter on the CPU (TRITON_INTERPRET=1)", details={"triton": triton})
    import torch

    if torch.version.cuda is None:
        return Availability(False, f"torch {torch.__version__} is built without CUDA", "install a CUDA build of torch on a machine with an NVIDIA GPU")
    if triton is None:
        return Availability(False, "triton is not installed", "pip install 'deepinfer[cuda]'")
    count = device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        hint = "check nvidia-smi and the driver; deepinfer needs an SM90 (Hopper) or SM100 (Blackwell) GPU"
        return Availability(False, f"no NVIDIA GPU is visible{where}", hint)
    capability = nvml_capability()
    details = {"gpus": count, "cuda": torch.version.cuda, "triton": triton}
    if capability is not None:
        details["capability"] = f"sm{capability[0]}{capability[1]}"
        if capability < MIN_CAPABILITY:
            reason = f"GPU 0 is sm{capability[0]}{capability[1]}; the cuda backend targets sm90 and sm100"
            return Availability(False, reason, "use an H100/H200 (sm90) or a Blackwell GPU (sm100)", details)
    return Availability(True, f"{count} GPU(s), CUDA {torch.version.cuda}, Triton {triton}", details=details)
