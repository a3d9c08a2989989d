"""Exact sums for the reference backend's batch-invariant kernels: no result depends on an order.

A CPU BLAS picks its kernel by the matrix shape (MKL: another one for 1, 2, 3, 16 rows) and, for a
fixed shape, may still give the rows of a tile different arithmetic (OpenBLAS's Haswell sgemm
does from 12 rows on; measured), so a row's product changes with the batch around it. Fixing the
call shape is not enough. Here the order cannot matter: every product and every sum is computed
exactly, then rounded once.

Each operand is cut into slices of beta-bit integers on a grid set by its own row's largest
element (Ozaki's error-free splitting): x = x_1 + x_2 + ... with x_i a multiple of 2^(e - i*beta)
and |x_i| <= 2^(e - (i-1)*beta). A product of two slices sums K terms, each a (2*beta)-bit integer
on one grid, so with 2*beta + log2(K) <= 53 a float64 GEMM computes it exactly in any order, with
or without FMA. The slice products are added in a fixed order in float64 and rounded to the output
dtype. The slices keep at least 40 bits below each row's largest element (float32 has 24), so
what is dropped lies below 2^-40 of that element; the result is a function of the row's own
values, not of the batch, the call's shape or the BLAS.

`ExactOrder` is a torch function mode that routes matmul, einsum, linear, sum, mean, softmax,
log_softmax and logsumexp through these, and sigmoid, silu and softplus through exp, log1p and a
division: torch's vectorised and scalar loops give those three different last bits, so an
element's value would depend on where it falls in the tensor (measured; exp, log1p and division
agree in every lane). Reductions it cannot make exact raise instead of running in some order.
Used by the reference backend (its deterministic kernels) and by model glue in deterministic mode.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kept_bits(dtype: torch.dtype) -> int:
    """Bits below a row's largest element that the slices keep."""
    return 72 if dtype == torch.float64 else 40


def _exponent(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """e with |x| < 2^e over `dims` (kept), from the largest magnitude; 0 for all-zero rows."""
    top = x.abs().amax(dim=dims, keepdim=True) if dims else x.abs()
    _, exp = torch.frexp(top)  # top = m * 2^exp, 0.5 <= m < 1
    return torch.where(top > 0, exp, torch.zeros_like(exp)).to(torch.float64)


def _power_of_two(n: torch.Tensor) -> torch.Tensor:
    """2.0 ** n for integer-valued float64 n in float64's normal range, built from its bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _slices(x64: torch.Tensor, dims: tuple[int, ...], beta: int, count: int) -> list[torch.Tensor]:
    """x64 as `count` slices of beta-bit integers on grids 2^(e - i*beta), i = 1..count."""
    e = _exponent(x64, dims)
    rest, out = x64, []
    for i in range(1, count + 1):
        grid = _power_of_two(e - i * beta)
        part = torch.round(rest / grid) * grid  # division and product by a power of two: exact
        out.append(part)
        rest = rest - part  # exact: part is rest rounded to a coarser grid
    return out


def _finite_split(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x with its infs and nans zeroed, and whether it may have had any (callers then merge the plain result). On an
    accelerator the answer is always True: asking would wait for the device, and cannot be asked at all while a
    device graph is captured (deterministic decode in graphs)."""
    finite = torch.isfinite(x)
    if x.device.type == "cpu" and bool(finite.all()):
        return x, False
    return torch.where(finite, x, torch.zeros_like(x)), True


# Slices of tensors that outlive a call (weights), per base tensor; an entry goes with its tensor.
_SLICE_CACHE: dict[int, tuple[weakref.ref, dict]] = {}


def _operand_slices(x: torch.Tensor, dims: tuple[int, ...], beta: int, count: int) -> tuple[list[torch.Tensor], bool]:
    """(slices of x in float64, whether x has an inf or nan); cached for tensors made outside
    inference mode (the weights), recomputed for activations."""
    if x.is_inference() or x.requires_grad:
        x64, bad = _finite_split(x.to(torch.float64))
        return _slices(x64, dims, beta, count), bad
    base = x._base if x._base is not None else x
    entry = _SLICE_CACHE.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = (weakref.ref(base, lambda _, key=id(base): _SLICE_CACHE.pop(key, None)), {})
        _SLICE_CACHE[id(base)] = entry
    # One entry per view (a grouped GEMM's experts are views of one tensor); a write to the tensor
    # bumps its version and makes the entry stale.
    key = (x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, dims, beta, count)
    cached = entry[1].get(key)
    if cached is None or cached[0] != x._version:
        x64, bad = _finite_split(x.to(torch.float64))
        cached = entry[1][key] = (x._version, _slices(x64, dims, beta, count), bad)
    return cached[1], cached[2]


def exact_contract(
    a: torch.Tensor, b: torch.Tensor, a_dims: tuple[int, ...], b_dims: tuple[int, ...], length: int,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], out_dtype: torch.dtype,
) -> torch.Tensor:
    """product(a, b) (a contraction summing `length` terms per output over a's `a_dims` and b's
    `b_dims`), computed exactly from slices and rounded once to out_dtype."""
    beta = max(1, (53 - math.ceil(math.log2(max(length, 1) + 1))) // 2)
    count = -(-_kept_bits(out_dtype) // beta)
    a_parts, a_bad = _operand_slices(a, a_dims, beta, count)
    b_parts, b_bad = _operand_slices(b, b_dims, beta, count)
    total = None
    for level in range(2, count + 2):  # i + j = level, the largest terms first
        for i in range(1, level):
            j = level - i
            if i > count or j > count:
                continue
            term = product(a_parts[i - 1], b_parts[j - 1])
            total = term if total is None else total + term
    out = total.to(out_dtype)
    if a_bad or b_bad:
        # An inf or nan makes its outputs inf or nan in every order; the plain product says which.
        plain = product(a.to(torch.float64), b.to(torch.float64)).to(out_dtype)
        out = torch.where(torch.isfinite(plain), out, plain)
    return out


def exact_sum(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """x summed over `dims` exactly (beta-bit slices, each summed in float64 without rounding), rounded once."""
    x64, bad = _finite_split(x.to(torch.float64))
    length = math.prod(x.shape[d] for d in dims) if dims else 1
    beta = max(1, 53 - math.ceil(math.log2(length + 1)))
    count = -(-_kept_bits(out_dtype) // beta)
    total = None
    for part in _slices(x64, dims, beta, count):
        term = part.sum(dim=dims, keepdim=keepdim) if dims else part
        total = term if total is None else total + term
    out = total.to(out_dtype)
    if bad:
        plain = x.to(torch.float64).sum(dim=dims, keepdim=keepdim).to(out_dtype)
        out = torch.where(torch.isfinite(plain), out, plain)
    return out


# --- the overrides -----------------------------------------------------------------------------


def _dims(x: torch.Tensor, dim) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.dim()))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % x.dim() for d in dims)) if x.dim() else ()


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _matmul(a, b):
    if a.dtype not in _FLOATS or b.dtype not in _FLOATS:
        return torch.matmul(a, b)
    a_dims = (a.dim() - 1,)
    b_dims = (0,) if b.dim() == 1 else (b.dim() - 2,)
    return exact_contract(a, b, a_dims, b_dims, a.shape[-1], torch.matmul, _result_dtype(a, b))


def _linear(x, weight, bias=None):
    out = _matmul(x, weight.T)
    return out if bias is None else out + bias


def _einsum(equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2 or "..." in equation or "->" not in equation:
        raise NotImplementedError(f"deterministic mode: einsum {equation!r} has no exact-order form here (two operands, explicit output)")
    a, b = operands
    inputs, output = equation.replace(" ", "").split("->")
    ia, ib = inputs.split(",")
    contracted = [c for c in ia if c in ib and c not in output]
    if any(c not in output and c not in contracted for c in ia + ib):
        raise NotImplementedError(f"deterministic mode: einsum {equation!r} sums an index of one operand only")
    length = math.prod(a.shape[ia.index(c)] for c in contracted)
    a_dims = tuple(ia.index(c) for c in contracted)
    b_dims = tuple(ib.index(c) for c in contracted)
    return exact_contract(a, b, a_dims, b_dims, length, lambda x, y: torch.einsum(equation, x, y), _result_dtype(a, b))


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    if x.dtype not in _FLOATS and (dtype is None or dtype not in _FLOATS):
        return torch.sum(x, dim=dim, keepdim=keepdim, dtype=dtype) if dim is not None else torch.sum(x, dtype=dtype)
    out_dtype = dtype or x.dtype
    return exact_sum(x.to(out_dtype) if dtype else x, _dims(x, dim), keepdim, out_dtype)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    count = math.prod(x.shape[d] for d in dims) if dims else 1
    out_dtype = dtype or x.dtype
    total = exact_sum(x.to(out_dtype) if dtype else x, dims, keepdim, torch.float64)
    return (total / count).to(out_dtype)


def _exp_sum(x, dim):
    top = x.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(x - top)
    return top, e, exact_sum(e, (dim % x.dim(),), True, x.dtype)


def _softmax(x, dim=None, dtype=None, **_):
    x = x.to(dtype) if dtype is not None else x
    _, e, s = _exp_sum(x, dim)
    return e / s


def _log_softmax(x, dim=None, dtype=None, **_):
    x = x.to(dtype) if dtype is not None else x
    top, _, s = _exp_sum(x, dim)
    return x - top - torch.log(s)


def _logsumexp(x, dim, keepdim=False):
    dims = _dims(x, dim)
    if len(dims) != 1:
        raise NotImplementedError("deterministic mode: logsumexp over several dims has no exact-order form here")
    top, _, s = _exp_sum(x, dims[0])
    out = top + torch.log(s)
    return out if keepdim else out.squeeze(dims[0])


def _sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _silu(x, inplace=False):
    return x / (1.0 + torch.exp(-x))


def _softplus(x, beta=1.0, threshold=20.0):
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)


_OVERRIDES: dict[Callable, Callable] = {
    torch.matmul: _matmul, torch.Tensor.matmul: _matmul, torch.Tensor.__matmul__: _matmul,
    torch.Tensor.__rmatmul__: lambda b, a: _matmul(a, b),
    torch.mm: _matmul, torch.Tensor.mm: _matmul, torch.bmm: _matmul, torch.Tensor.bmm: _matmul,
    F.linear: _linear, torch.einsum: _einsum,
    torch.sum: _sum, torch.Tensor.sum: _sum, torch.mean: _mean, torch.Tensor.mean: _mean,
    torch.softmax: _softmax, torch.Tensor.softmax: _softmax, F.softmax: _softmax,
    torch.log_softmax: _log_softmax, torch.Tensor.log_softmax: _log_softmax, F.log_softmax: _log_softmax,
    torch.logsumexp: _logsumexp, torch.Tensor.logsumexp: _logsumexp,
    torch.sigmoid: _sigmoid, torch.Tensor.sigmoid: _sigmoid, F.sigmoid: _sigmoid, torch.special.expit: _sigmoid,
    F.silu: _silu, F.softplus: _softplus,
}  # fmt: skip

# Reductions with no exact form here: refused, so none runs in an order that the batch could change.
_REFUSED = {
    torch.prod, torch.Tensor.prod, torch.norm, torch.Tensor.norm, torch.linalg.norm, torch.linalg.vector_norm,
    torch.var, torch.Tensor.var, torch.std, torch.Tensor.std, torch.var_mean, torch.std_mean, torch.nansum,
    torch.Tensor.nansum, torch.nanmean, torch.Tensor.nanmean, torch.dot, torch.Tensor.dot, torch.vdot, torch.mv,
    torch.Tensor.mv, torch.addmm, torch.Tensor.addmm, torch.addmv, torch.baddbmm, torch.Tensor.baddbmm, torch.addbmm,
    torch.tensordot, torch.cumprod, torch.Tensor.cumprod, torch.logcumsumexp, torch.trace, torch.cdist, F.normalize,
    F.layer_norm, F.rms_norm, F.gelu, torch.Tensor.sigmoid_, F.scaled_dot_product_attention,
}  # fmt: skip


class ExactOrder(TorchFunctionMode):
    """Inside this mode, torch's sums and products on float tensors are exact (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _OVERRIDES.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        if func in _REFUSED:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            raise NotImplementedError(f"deterministic mode: {name} has no exact-order form in the reference backend")
        return func(*args, **kwargs)


def glue(deterministic: bool):
    """The context model glue (torch code between ops) runs in: ExactOrder in deterministic mode,
    so a few sums and sigmoids between kernels cannot bring the batch back in; else nothing."""
    return ExactOrder() if deterministic else contextlib.nullcontext()


def invariant(fn: Callable) -> Callable:
    """fn run inside ExactOrder: the reference kernel as a batch-invariant one (same signature)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with ExactOrder():
            return fn(*args, **kwargs)

    return run


__all__ = ["ExactOrder", "exact_contract", "exact_sum", "glue", "invariant"]
