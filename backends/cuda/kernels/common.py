"""What the cuda kernel modules share beyond `deepinfer.triton_common`: the registration record,
CUDA facts (compute capability, SM count, tf32 dots, warps per tile), the bf16x3 dot, the split programs' arrival
counters and programmatic dependent launch (PDL). Not a registration module."""

from __future__ import annotations

import functools
from contextvars import ContextVar
from functools import cache, lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.registry import Registration  # noqa: F401  (kernel modules import it from here)
from deepinfer.triton_common import interpreting, next_power_of_2


def dot_precision(dot_f32: bool) -> str:
    """`input_precision` of tl.dot: float32 operands must not be truncated to tf32 (Triton's default
    on GPUs): the conformance tolerance for float32 is 1.3e-6 relative."""
    return "ieee" if dot_f32 else "tf32"


def capability(device: torch.device | None = None) -> tuple[int, int]:
    """Compute capability of the tensors' device; (0, 0) on the CPU (interpreter)."""
    if device is None or device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; 4 on the CPU (the interpreter: a few programs are
    plenty, and split choices stay exercised)."""
    if device.type != "cuda":
        return 4
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def num_warps_for(tile_elems: int, elem_bytes: int, cfg: dict) -> int:
    """Enough warps that each thread holds `bytes_per_thread` of the tile (whole 16-byte vectors),
    within the tuning entry's min_warps..max_warps."""
    warps = next_power_of_2(max((tile_elems * elem_bytes) // (32 * cfg["bytes_per_thread"]), 1))
    return max(cfg.get("min_warps", 1), min(cfg["max_warps"], warps))


ARRIVALS = 1 << 16  # arrival counters per device and user; a launch with more tiles than this merges by a second kernel


@lru_cache(maxsize=None)
def arrival_counters(device: torch.device, user: str) -> torch.Tensor:
    """Zeroed int32 counters in which a kernel's split programs count their arrivals, so that the last
    one to arrive merges the partials (no second launch). Each tile's merging program resets its
    counter to zero, so one allocation per (device, kernel family) serves every launch on the
    device's single compute stream, CUDA-graph replays included."""
    return torch.zeros(ARRIVALS, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL)
#
# Every kernel of this backend (the expert-parallel symmetric-memory kernels of moe_ep_symm aside: see
# there) takes `PDL: tl.constexpr` and starts with `pdl_prologue(PDL)`; every launch site passes
# `**pdl_launch(device)`. Launched with PDL, kernel N+1 may be launched, and its programs made
# resident, as soon as every program of kernel N has passed its prologue's launch_dependents, instead
# of when kernel N has finished; its own prologue's griddepcontrol.wait then blocks until kernel N
# has completed and its memory is visible. Nothing is read or written before that wait, so the
# results are those of stream-ordered launches: what overlaps is the launch and the block scheduling
# of N+1 with the tail of N (the gaps between the kernels of a replayed decode graph). The wait
# covers every earlier kernel too, as N finished only after its own wait. A kernel launched without
# PDL (torch's, or one with PDL off) is waited for in full, as always. Off under the interpreter (no
# griddepcontrol there) and below SM90; the backend option `pdl` (deepinfer_cuda.options) turns it off.


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the preceding grid (completed, its memory
    visible), then let the next grid launch. Nothing when PDL is False (the interpreter never sees the
    griddepcontrol builtins)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_PDL_OFF = {"PDL": False}
_PDL_ON = {"PDL": True, "launch_pdl": True}
# False inside a kernel resolved with backend option pdl=off (`without_pdl`); the default is the
# option's default (auto). A context variable, not a module global: it belongs to the call.
_pdl_allowed: ContextVar[bool] = ContextVar("deepinfer_cuda_pdl_allowed", default=True)

PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and newer


@cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= PDL_MIN_CAPABILITY


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a kernel on `device`: {"PDL": True, "launch_pdl": True} where PDL runs
    (a GPU of SM90 or newer, not the interpreter, not turned off by backend option pdl=off), else
    {"PDL": False}. Pass them as `kernel[grid](..., **pdl_launch(x.device))`."""
    if device.type != "cuda" or not _pdl_allowed.get() or interpreting():
        return _PDL_OFF
    return _PDL_ON if _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()) else _PDL_OFF


def without_pdl(fn):
    """`fn` (a registered kernel wrapper) with its launches made without PDL; same signature (the
    registry checks it through __wrapped__) and qualname."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        token = _pdl_allowed.set(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _pdl_allowed.reset(token)

    return call


def pdl_unavailable(device: torch.device) -> str | None:
    """Why PDL cannot run on `device` (None: it can): what backend option pdl=on turns into a one-line
    error at resolve."""
    if interpreting():
        return "the kernels run under the Triton interpreter (no griddepcontrol)"
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _pdl_capable(index):
        major, minor = torch.cuda.get_device_capability(index)
        return f"GPU {index} is SM{major}{minor}; griddepcontrol needs SM{PDL_MIN_CAPABILITY[0]}{PDL_MIN_CAPABILITY[1]} or newer"
    return None


@triton.jit
def bf16x3_dot(x, f, acc, UPCAST: tl.constexpr):
    """acc + x @ f for bfloat16 x and float32 f: f = hi + mid + lo exactly (three bfloat16 parts, each the rounding of
    what the parts before left), so the three bfloat16 dots' products are exact and only the float32 sums round.
    The smallest part goes first, as tf32x3 does. x stays the 16-bit operand it was loaded as, with no float32 copy
    split in two, and the dots run at the bfloat16 rate, twice tf32's (hc_pre's mix, the routers' logits).
    UPCAST (the interpreter, whose bfloat16 dot is wrong: triton_common.upcast_dot): the same parts as float32."""
    hi = f.to(tl.bfloat16)
    rest = f - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    if UPCAST:
        xf = x.to(tl.float32)
        acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
    part = tl.dot(x, lo)
    part = tl.dot(x, mid, part)
    part = tl.dot(x, hi, part)
    return acc + part
