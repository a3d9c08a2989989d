"""Benchmarks of rms_norm (+residual), silu_and_mul and rope at DeepSeek-V3 prefill sizes.

All three are memory-bound: the rate that matters is bytes moved (inputs read once, outputs written
once) against the device copy bandwidth. The peers are the torch formulations of the references
(float32 arithmetic, as the op docstrings specify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer_cuda.bench.common import BenchCase

OPS = ("rms_norm", "rope", "silu_and_mul")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 60  # where its rows sit in `deepinfer bench ops`: attention first, misc last

EPS = 1e-6


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """A case timed from a CUDA graph replay (the runner reads `graph`): calls of a few microseconds
    are otherwise measured as host launch overhead. These ops are graph-safe (no host sync)."""

    graph: bool = True


def _rms_norm_setup(T: int, D: int, residual: bool):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        state = {
            "x": torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g),
            "w": torch.randn(D, device=device, dtype=torch.bfloat16, generator=g),
        }
        state["r"] = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g) if residual else None
        return state

    return setup


def _rms_norm_kernel(s: dict):
    from deepinfer_cuda.kernels.norm import rms_norm

    return rms_norm(s["x"], s["w"], eps=EPS, residual=s["r"])


def _rms_norm_peer(s: dict):
    x, w, r = s["x"], s["w"], s["r"]
    h = x if r is None else (x.float() + r.float()).to(x.dtype)
    hf = h.float()
    out = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)
    return out, (None if r is None else h)


def _rms_norm_bytes(s: dict) -> float:
    x = s["x"]
    tensors = 4 if s["r"] is not None else 2  # x (+ residual) read, out (+ h) written
    return tensors * x.numel() * x.element_size() + s["w"].numel() * s["w"].element_size()


def _rms_norm_flops(s: dict) -> float:
    return (6 if s["r"] is not None else 4) * s["x"].numel()


def _silu_setup(T: int, I: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        return {"x": torch.randn(T, 2 * I, device=device, dtype=torch.bfloat16, generator=g)}

    return setup


def _silu_kernel(s: dict):
    from deepinfer_cuda.kernels.activation import silu_and_mul

    return silu_and_mul(s["x"])


def _silu_peer(s: dict):
    a, b = s["x"].chunk(2, dim=-1)
    return F.silu(a) * b


def _silu_bytes(s: dict) -> float:
    x = s["x"]
    return 1.5 * x.numel() * x.element_size()  # [T, 2I] read, [T, I] written


def _silu_flops(s: dict) -> float:
    return 2.5 * s["x"].numel()  # per output: exp, add, divide, multiply (~5)


def _rope_setup(T: int, H: int, D: int, interleaved: bool, max_positions: int = 16384):
    def setup(device: torch.device) -> dict:
        from deepinfer.ops.rope import rope_cos_sin_cache

        g = torch.Generator(device=device).manual_seed(0)
        return {
            "x": torch.randn(T, H, D, device=device, dtype=torch.bfloat16, generator=g),
            "positions": torch.randint(0, max_positions, (T,), device=device, generator=g),
            "cache": rope_cos_sin_cache(D, max_positions, 10000.0).to(device),
            "interleaved": interleaved,
        }

    return setup


def _rope_kernel(s: dict):
    from deepinfer_cuda.kernels.rope import rope

    return rope(s["x"], s["positions"], s["cache"], interleaved=s["interleaved"])


def _rope_peer(s: dict):
    from deepinfer.ops.rope import rope

    return rope(s["x"], s["positions"], s["cache"], interleaved=s["interleaved"])


def _rope_bytes(s: dict) -> float:
    x, cache = s["x"], s["cache"]
    T, _, D = x.shape
    # x read and written; each token's table row read once; the positions.
    return 2 * x.numel() * x.element_size() + T * D * cache.element_size() + T * s["positions"].element_size()


def _rope_flops(s: dict) -> float:
    return 3 * s["x"].numel()  # per element: two multiplies and an add


RMS_PEER = "torch (float32, as the reference)"
SILU_PEER = "torch F.silu(a) * b"
ROPE_PEER = "torch reference (deepinfer.ops.rope)"
# each family's kernel, peer, peer name, flops and bytes: the fields after a case's setup
RMS_NORM = (_rms_norm_kernel, _rms_norm_peer, RMS_PEER, _rms_norm_flops, _rms_norm_bytes)
SILU = (_silu_kernel, _silu_peer, SILU_PEER, _silu_flops, _silu_bytes)
ROPE = (_rope_kernel, _rope_peer, ROPE_PEER, _rope_flops, _rope_bytes)

CASES = [
    # Prefill-sized: the targets (>= 75% of copy bandwidth).
    BenchCase("rms_norm", "T16384_D7168_bf16", _rms_norm_setup(16384, 7168, False), *RMS_NORM),
    BenchCase("rms_norm", "T16384_D7168_bf16_residual", _rms_norm_setup(16384, 7168, True), *RMS_NORM),
    BenchCase("silu_and_mul", "T16384_I2048_bf16", _silu_setup(16384, 2048), *SILU),
    BenchCase("silu_and_mul", "T16384_I18432_bf16", _silu_setup(16384, 18432), *SILU),
    BenchCase("rope", "T16384_H128_D64_interleaved_bf16", _rope_setup(16384, 128, 64, True), *ROPE),
    BenchCase("rope", "T16384_H128_D64_half_bf16", _rope_setup(16384, 128, 64, False), *ROPE),
    # DeepSeek-V3's other norm widths (kv_lora_rank 512, q_lora_rank 1536): tens of microseconds, so
    # graph-timed (host launch overhead exceeds them); x larger than L2 (50 MB) so no call finds its
    # input cached from the previous one.
    GraphCase("rms_norm", "T65536_D512_bf16", _rms_norm_setup(65536, 512, False), *RMS_NORM),
    GraphCase("rms_norm", "T16384_D1536_bf16", _rms_norm_setup(16384, 1536, False), *RMS_NORM),
    # Decode-sized (batch 64): latency, far from any bandwidth ceiling; timed from a CUDA graph as the
    # engine runs them (inputs L2-resident, as when the previous kernel of the step wrote them).
    GraphCase("rms_norm", "T64_D7168_bf16_residual", _rms_norm_setup(64, 7168, True), *RMS_NORM),
    GraphCase("silu_and_mul", "T64_I2048_bf16", _silu_setup(64, 2048), *SILU),
    GraphCase("rope", "T64_H128_D64_interleaved_bf16", _rope_setup(64, 128, 64, True), *ROPE),
]


# ---------------------------------------------------------------------------------------------
# Tuning sweep and CUDA-graph check (GPU only): `python -m deepinfer_cuda.bench.misc [--sweep] [--graph]`


def _sweep(only: set[str] | None = None) -> None:
    from deepinfer_cuda.bench.common import time_ms as stream_time_ms
    from deepinfer_cuda.bench.runner import graph_time_ms, measure_copy_tbs
    from deepinfer_cuda.kernels import activation, norm, rope

    dev = torch.device("cuda")
    bw = measure_copy_tbs(dev, stream_time_ms)
    print(f"copy bandwidth {bw:.3f} TB/s")
    targets = [(norm, "rms_norm"), (activation, "silu_and_mul"), (rope, "rope")]
    for module, op in targets:
        cases = [c for c in CASES if c.op == op and (only is None or c.name in only)]
        original = module._config
        base = dict(original(dev))
        keys = {"rms_norm": {"tile_elems": (2048, 4096, 8192, 16384), "bytes_per_thread": (16, 32, 64)},
                "silu_and_mul": {"tile_elems": (2048, 4096, 8192, 16384), "bytes_per_thread": (16, 32, 64), "max_block_i": (1024, 2048, 4096)},
                "rope": {"tile_elems": (1024, 2048, 4096, 8192, 16384), "bytes_per_thread": (16, 32, 64)}}[op]
        for case in cases:
            time_ms = graph_time_ms if getattr(case, "graph", False) else stream_time_ms
            _sweep_case(case, module, base, keys, time_ms, bw, dev)  # the case's tensors are freed on return
            torch.cuda.empty_cache()
        module._config = original


def _sweep_case(case, module, base: dict, keys: dict, time_ms, bw: float, dev: torch.device) -> None:
    """Every combination of `keys` over the module's `base` config, timed on one case; prints the default, best four and worst."""
    import itertools

    original = module._config
    state = case.setup(dev)
    nbytes = case.bytes(state)
    results = []
    for values in itertools.product(*keys.values()):
        cfg = dict(base, **dict(zip(keys, values)), max_warps=32)
        module._config = lambda device, cfg=cfg: cfg
        case.kernel(state)
        ms = time_ms(lambda: case.kernel(state))
        results.append((ms, dict(zip(keys, values))))
    results.sort(key=lambda r: r[0])
    module._config = original
    case.kernel(state)
    default_ms = time_ms(lambda: case.kernel(state))
    print(f"{case.op} {case.name}: default {default_ms * 1e3:.1f} us = {nbytes / default_ms / 1e9 / bw:.1%} of copy")
    for ms, cfg in results[:4] + results[-1:]:
        print(f"    {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:.3f} TB/s  {nbytes / ms / 1e9 / bw:6.1%}  {cfg}")


def _graph_check() -> None:
    """The decode-path wrappers captured in a CUDA graph: replays match eager calls."""
    dev = torch.device("cuda")
    from deepinfer.ops.rope import rope_cos_sin_cache
    from deepinfer_cuda.kernels.activation import silu_and_mul
    from deepinfer_cuda.kernels.norm import rms_norm
    from deepinfer_cuda.kernels.rope import rope

    x = torch.randn(8, 7168, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(7168, device=dev, dtype=torch.bfloat16)
    q = torch.randn(8, 16, 64, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 100, (8,), device=dev)
    cache = rope_cos_sin_cache(64, 100, 10000.0).to(dev)
    g = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)

    def step():
        return rms_norm(x, w, residual=r), rope(q, pos, cache), silu_and_mul(g)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, h), ro, so = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        pos.copy_(torch.randint(0, 100, (8,), device=dev))
        graph.replay()
        (e_out, e_h), e_ro, e_so = step()
        assert torch.equal(out, e_out) and torch.equal(h, e_h) and torch.equal(ro, e_ro) and torch.equal(so, e_so)
    print("CUDA graph capture and replay: rms_norm(+residual), rope, silu_and_mul match eager calls")


def _host_overhead() -> None:
    """Host time per wrapper call (launch-bound, batch 1): what CUDA graphs remove from a decode step."""
    import time

    from deepinfer.ops.rope import rope_cos_sin_cache
    from deepinfer_cuda.kernels.activation import silu_and_mul
    from deepinfer_cuda.kernels.norm import rms_norm
    from deepinfer_cuda.kernels.rope import rope

    d = torch.device("cuda")
    x = torch.randn(1, 7168, device=d, dtype=torch.bfloat16)
    w = torch.randn(7168, device=d, dtype=torch.bfloat16)
    g = torch.randn(1, 4096, device=d, dtype=torch.bfloat16)
    q = torch.randn(1, 128, 64, device=d, dtype=torch.bfloat16)
    p = torch.zeros(1, dtype=torch.long, device=d)
    c = rope_cos_sin_cache(64, 10, 1e4).to(d)
    for name, f in [("rms_norm+residual", lambda: rms_norm(x, w, residual=x)), ("silu_and_mul", lambda: silu_and_mul(g)),
                    ("rope", lambda: rope(q, p, c)), ("torch x + x (reference point)", lambda: x + x)]:
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            f()
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call (host-bound loop)")


if __name__ == "__main__":
    import sys

    if "--overhead" in sys.argv:
        _host_overhead()
    if "--graph" in sys.argv:
        _graph_check()
    if "--sweep" in sys.argv:
        names = [a for a in sys.argv[1:] if not a.startswith("--")]
        _sweep(set(names) or None)
