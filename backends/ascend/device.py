"""What Ascend kernels size themselves by: chip generation, AI-core and vector-core counts, on-chip buffer.

On hardware the counts come from triton-ascend's driver (`get_device_properties`), as vllm-ascend
reads them. Under the Triton interpreter (CI, no Ascend hardware) a chip is simulated: the backend
option sim_chip = 910B (default) or 950 (its default from DEEPINFER_ASCEND_SIM_CHIP), so the
kernels' persistent grids and in-kernel tile loops are exercised with each chip's core counts.
Like the real device, the simulated one is a fact of the process: the plugin sets it from the
validated option when it registers the kernels (`simulate`); kernels called without a runtime
(tests) get the option's default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from deepinfer_ascend.options import SIM_CHIP


@dataclass(frozen=True)
class AscendDevice:
    chip: str  # "A2", "A3", "950"
    num_aicore: int  # cube cores: grid size for tl.dot kernels
    num_vectorcore: int  # vector cores (2 per AI core): grid size for vector kernels
    ub_bytes: int  # on-chip unified buffer per core: blocks that overflow it fail to compile
    simulated: bool

    @property
    def has_fp8_dot(self) -> bool:
        return self.chip == "950"  # tl.dot has no fp8/fp4 operands on A2/A3


# Simulated chips. 910B: the 910B2's 24 AI cores / 48 vector cores, 192 KB UB (A2).
# 950: 256 KB UB per facts.md; its core counts are an assumption (32/64), to be replaced by the
# values triton-ascend reports on real hardware.
SIMULATED = {
    "910B": AscendDevice("A2", 24, 48, 192 * 1024, True),
    "950": AscendDevice("950", 32, 64, 256 * 1024, True),
}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=None)
def _hardware() -> AscendDevice:
    import torch
    import triton

    from deepinfer_ascend.probe import chip_from_soc, probe_import

    torch_npu, _ = probe_import()
    props = triton.runtime.driver.active.utils.get_device_properties(torch.npu.current_device())
    soc = None
    if torch_npu is not None:
        from deepinfer_ascend.probe import _soc_version

        soc = _soc_version(torch_npu)
    chip = chip_from_soc(soc)
    return AscendDevice(chip, int(props["num_aicore"]), int(props["num_vectorcore"]), (256 if chip == "950" else 192) * 1024, False)


_simulated: str | None = None  # the sim_chip option of the ascend runtime this process opened


def simulate(chip: str) -> None:
    """Simulate `chip` (a validated sim_chip option) under the interpreter from now on."""
    global _simulated
    if chip not in SIMULATED:
        raise ValueError(f"no simulated chip {chip!r}; one of {', '.join(SIMULATED)}")
    _simulated = chip


def current() -> AscendDevice:
    if interpreting():
        # Without an opened runtime: the option's default (DEEPINFER_ASCEND_SIM_CHIP, checked: a bad
        # value is a one-line BackendOptionError).
        return SIMULATED[_simulated or SIM_CHIP.default_for("ascend", os.environ)]
    return _hardware()
