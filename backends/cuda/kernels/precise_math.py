"""exp/log for kernels whose results are compared exactly with the CPU reference (gate, sample). Not a
registration module.

libdevice's expf/logf are within ~1 ulp; tl.exp/tl.log on a GPU are the approximate MUFU
instructions (several ulp). The interpreter has no libdevice (its stubs return None): numpy's
float32 functions serve there, so callers pass LIBDEVICE=not interpreting().
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def precise_exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def precise_log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y
