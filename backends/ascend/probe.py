"""Can the Ascend backend run here? Every failure mode gets its own reason and hint.

torch_npu is imported explicitly here (deepinfer disables torch's device-backend auto-load, which
would otherwise break `import torch` itself on a host without CANN). Nothing here launches work on
a device: the device count, the SoC version and the core counts (from triton-ascend's driver, as
vllm-ascend reads them at start-up) are queries; the CANN version comes from the toolkit's files.
torch itself is imported only when a probe runs: the plugin that declares the backend imports this module.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from deepinfer.plugins import Availability, import_optional

SETUP_DOC = "see docs/backends/ascend.md"
SET_ENV_HINT = "source the CANN environment first: `source /usr/local/Ascend/ascend-toolkit/set_env.sh` (or your CANN install's set_env.sh)"
CANN_ROOT_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")  # set by CANN's set_env.sh
DEFAULT_CANN_ROOT = "/usr/local/Ascend/ascend-toolkit/latest"
# Where a CANN toolkit states its version, most specific first (layouts differ between releases:
# `version.cfg` with `..._running_version=[build:version]`, `*/ascend_toolkit_install.info` and
# `*/version.info` with `version=...`).
CANN_VERSION_FILES = ("version.info", "version.cfg", "*/ascend_toolkit_install.info", "*/version.info", "*/version.cfg")
_VERSION_LINE = re.compile(r"^\s*version\s*[=:]\s*[\"']?([0-9][\w.\-]*)", re.IGNORECASE | re.MULTILINE)
_RUNNING_VERSION = re.compile(r"running_version\s*=\s*\[[^\]:]*:([^\]\s]+)\]")
CANN_LIBRARY = re.compile(r"lib(hccl|ascendcl|acl_op_compiler|ge_runner|graph|runtime|opapi|hccl_fwk|ascend_hal|c_sec|mmpa)\w*\.so")


def chip_from_soc(soc: int | None) -> str:
    """Chip generation from the SoC version number (A2: 220-225, A3: 250-255, 950: 260)."""
    if soc is None:
        return "unknown"
    if 220 <= soc <= 225:
        return "A2"
    if 250 <= soc <= 255:
        return "A3"
    if soc == 260:
        return "950"
    return f"unknown (soc {soc})"


def _base(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def probe_import() -> tuple[object | None, Availability | None]:
    """Import torch_npu, or say precisely why it cannot be imported."""
    if importlib.util.find_spec("torch_npu") is None:
        hint = f"the ascend backend runs in its own environment: pip install 'deepinfer[ascend]' on a host with CANN ({SETUP_DOC})"
        return None, Availability(False, "torch_npu is not installed", hint)
    module, exc = import_optional("torch_npu")
    if module is not None:
        return module, None
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    import torch

    if isinstance(exc, OSError) or CANN_LIBRARY.search(str(exc)):
        return None, Availability(False, f"torch_npu is installed but the CANN libraries are not loadable ({message})", SET_ENV_HINT)
    return None, Availability(False, f"torch_npu failed to import ({message})", f"reinstall torch_npu matching torch {torch.__version__} ({SETUP_DOC})")


def device_count() -> int:
    """Visible Ascend NPUs; 0 when torch_npu cannot be imported (the probe says why)."""
    _, failure = probe_import()
    return 0 if failure is not None else _npu_count()


def _npu_count() -> int:
    import torch

    npu = getattr(torch, "npu", None)  # added by torch_npu
    return npu.device_count() if npu is not None else 0


def probe(interpret: bool = False) -> Availability:
    if interpret:
        if importlib.util.find_spec("triton") is None:
            return Availability(
                False,
                "triton is not installed, so the kernels cannot run in the interpreter",
                "pip install triton (community Triton interprets the triton-ascend kernel sources)",
            )
        return Availability(True, "Triton interpreter on the CPU (TRITON_INTERPRET=1); torch_npu fast paths need hardware and are not run")
    torch_npu, failure = probe_import()
    if failure is not None:
        return failure
    import torch

    npu_version = getattr(torch_npu, "__version__", "unknown")
    if npu_version != "unknown" and _base(npu_version) != _base(torch.__version__):
        return Availability(
            False,
            f"torch_npu {npu_version} does not match torch {torch.__version__}",
            f"install matching versions (known good: torch 2.10.0 with torch-npu 2.10.0.post4, CANN 9.1.0; {SETUP_DOC})",
        )
    count = _npu_count()
    if count == 0:
        return Availability(False, "no Ascend NPU is visible", "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES")
    soc = _soc_version(torch_npu)
    details = {"npus": count, "torch_npu": npu_version, "soc": soc, "chip": chip_from_soc(soc), "cann": cann_version(), **core_counts()}
    cores = f", {details['num_aicore']} AI / {details['num_vectorcore']} vector cores" if details["num_aicore"] != "unknown" else ""
    return Availability(True, f"{count} NPU(s), chip {details['chip']}{cores}, torch_npu {npu_version}, CANN {details['cann']}", details=details)


def cann_version(environ: dict[str, str] | None = None) -> str:
    """The CANN toolkit's version, from its version file; "unknown" when none is found.

    Looks under $ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH and /usr/local/Ascend/ascend-toolkit/latest;
    as a last resort takes the name `latest` links to when it looks like a version (e.g. 9.1.0).
    """
    env = os.environ if environ is None else environ
    roots = [env[name] for name in CANN_ROOT_ENV if env.get(name)] + [DEFAULT_CANN_ROOT]
    for root in dict.fromkeys(roots):
        path = Path(root)
        if not path.is_dir():
            continue
        for pattern in CANN_VERSION_FILES:
            for file in sorted(path.glob(pattern)):
                version = _version_in(file)
                if version:
                    return version
        name = path.resolve().name
        if re.match(r"\d+\.\d+", name):
            return name
    return "unknown"


def _version_in(file: Path) -> str | None:
    try:
        text = file.read_text(encoding="utf-8", errors="replace")[:65536]
    except OSError:
        return None
    found = _VERSION_LINE.search(text) or _RUNNING_VERSION.search(text)
    return found.group(1) if found else None


def core_counts() -> dict[str, int | str]:
    """AI-core and vector-core counts from triton-ascend's driver, as the kernels size their grids.

    Any failure (no triton, community Triton's driver, no device) gives "unknown": the counts are
    facts for the report, not a condition of availability. (vllm-ascend reads the same properties
    at start-up; they come from the runtime's device info, no kernel is launched.)
    """
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(0)
        return {"num_aicore": int(props["num_aicore"]), "num_vectorcore": int(props["num_vectorcore"])}
    except Exception:
        return {"num_aicore": "unknown", "num_vectorcore": "unknown"}


def _soc_version(torch_npu) -> int | None:
    npu = getattr(torch_npu, "npu", None)
    get = getattr(npu, "get_soc_version", None) or getattr(getattr(npu, "utils", None), "get_soc_version", None)
    try:
        return int(get()) if get is not None else None
    except Exception:
        return None
