"""Gluon's Hopper pieces for the cuda backend's Gluon kernels, imported in one place with the Triton version shims.
Not a registration module: the kernel modules that import it register their kernels.

GLUON_IMPORT_ERROR is None where this Triton has them (Triton >= 3.5), else why not: each Gluon kernel module then
declines its calls or says so in its registration. Shims (Triton 3.6 on the GPU machine, 3.9 on the CPU machines):
- `tma_load`: Triton 3.9 calls the TMA global->shared copy `async_load` (3.6's name, async_copy_global_to_shared,
  raises there); 3.6 has only the old name. Same arguments.
- `tma_store`: the TMA shared->global copy, 3.9's `async_store` (3.6's async_copy_shared_to_global raises there); 3.6
  has only the old name. Same arguments.
- `sync_warps`: a barrier over the calling partition's warps, 3.9 `gl.barrier`, 3.6 `gl.thread_barrier` (both lower
  to the partition's named barrier inside warp_specialize).
- `cp_async_load`: the per-thread global->shared copy (cp.async, 16 bytes at most a copy; masked elements are
  zero-filled), 3.9 `async_copy.async_load` (3.6's name, async_copy_global_to_shared, raises there), 3.6 only the old
  name. Same leading arguments (shared destination, pointers, mask). With `async_copy.mbarrier_arrive` (an mbarrier
  arrival once the thread's copies have landed) it gathers rows where TMA cannot (SM90 has no TMA gather).
- `reinterpret_shared(buf, dtype, shape, layout)`: a view of shared memory as another dtype, shape and layout, 3.9's
  `reinterpret`, 3.6's `_reinterpret` (same arguments).
"""

from __future__ import annotations

import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    sync_warps = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    cp_async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def reinterpret_shared(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """`buf`'s shared memory viewed as `dtype` [shape] in `layout` (the module docstring's shim)."""
        if _REINTERPRET_IS_PUBLIC:
            return buf.reinterpret(dtype, shape, layout)
        else:
            return buf._reinterpret(dtype, shape, layout)

    GLUON_IMPORT_ERROR = None
except ImportError as exc:  # a Triton without Gluon's Hopper pieces
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def gluon_unusable(option: str, import_error: str | None) -> str | None:
    """A registration's `unusable` answer for a kernel that backend option `option` (e.g. "fp8_path=gluon") asks for:
    why it cannot run where Gluon's Hopper pieces did not import (`import_error`, the kernel module's
    GLUON_IMPORT_ERROR), else None."""
    if import_error is None:
        return None
    return f"backend option {option}, but Triton {triton.__version__} has no usable Gluon for Hopper ({import_error})"


__all__ = ["GLUON_IMPORT_ERROR", "TensorDescriptor", "async_copy", "cp_async_load", "fence_async_shared", "gl", "gluon", "gluon_unusable", "mbarrier",
           "reinterpret_shared", "sync_warps", "tma", "tma_load", "tma_store", "warpgroup_mma", "warpgroup_mma_wait"]  # fmt: skip
