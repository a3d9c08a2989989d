"""Benchmarks of the MoE routing ops at DeepSeek-V3 sizes: gate, dispatch, combine.

All three are memory-bound. Bytes are the minimal traffic (inputs read once, outputs written once):
dispatch reads each token row once and writes its top_k copies; combine reads the top_k rows of
each token and writes one. The peers are torch formulations (sort + index_select for dispatch,
index_select + a float32 weighted sum for combine, the reference's torch ops for the gate).
Decode-sized cases are timed from a CUDA graph (which also proves they never synchronise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_cuda.bench.common import BenchCase

OPS = ("gate", "dispatch", "combine")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 40  # where its rows sit in `deepinfer bench ops`: attention first, misc last


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Timed from a CUDA graph replay (the runner reads `graph`)."""

    graph: bool = True


V3_GATE = dict(top_k=8, score_func="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)


def _gate_setup(T: int, E: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        return {
            "logits": torch.randn(T, E, device=device, dtype=torch.float32, generator=g),
            "bias": torch.randn(E, device=device, dtype=torch.float32, generator=g) * 0.1,
        }

    return setup


def _gate_kernel(s: dict):
    from deepinfer_cuda.kernels.moe import gate

    return gate(s["logits"], correction_bias=s["bias"], **V3_GATE)


def _gate_peer(s: dict):
    from deepinfer.ops.moe import gate

    return gate(s["logits"], correction_bias=s["bias"], **V3_GATE)


def _gate_bytes(s: dict) -> float:
    T, E = s["logits"].shape
    return T * E * 4 + E * 4 + T * V3_GATE["top_k"] * (4 + 4)


def _gate_flops(s: dict) -> float:
    return 0.0


def _routing_setup(T: int, K: int, E: int, D: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        scores = torch.rand(T, E, device=device, generator=g)
        ids = scores.topk(K, dim=-1).indices.to(torch.int32)  # distinct experts per token, as a gate gives
        from deepinfer.ops.moe import dispatch

        _, _, row_of_slot = dispatch(torch.zeros(T, 1, device=device), ids, num_experts=E)
        return {
            "x": torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g),
            "ids": ids,
            "E": E,
            "expert_out": torch.randn(T * K, D, device=device, dtype=torch.bfloat16, generator=g),
            "weights": torch.rand(T, K, device=device, generator=g),
            "row_of_slot": row_of_slot,
        }

    return setup


def _dispatch_kernel(s: dict):
    from deepinfer_cuda.kernels.moe import dispatch

    return dispatch(s["x"], s["ids"], num_experts=s["E"])


def _dispatch_peer(s: dict):
    x, ids, E = s["x"], s["ids"], s["E"]
    K = ids.shape[-1]
    flat = ids.reshape(-1).long()
    sorted_ids, slot_of_row = torch.sort(flat, stable=True)
    expert_x = x.index_select(0, slot_of_row // K)
    offsets = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=x.device)).to(torch.int32)
    row_of_slot = torch.empty_like(slot_of_row).scatter_(0, slot_of_row, torch.arange(flat.numel(), device=x.device))
    return expert_x, offsets, row_of_slot.to(torch.int32)


def _dispatch_bytes(s: dict) -> float:
    x, ids = s["x"], s["ids"]
    T, D = x.shape
    S = ids.numel()
    # token rows read once, S rows written; ids read, row_of_slot written, offsets
    return (T + S) * D * x.element_size() + S * 4 * 2 + (s["E"] + 1) * 4


def _combine_kernel(s: dict):
    from deepinfer_cuda.kernels.moe import combine

    return combine(s["expert_out"], s["weights"], s["row_of_slot"])


def _combine_peer(s: dict):
    src, w, rows = s["expert_out"], s["weights"], s["row_of_slot"]
    T, K = w.shape
    picked = src.index_select(0, rows.long()).view(T, K, -1).float()
    return (picked * w.unsqueeze(-1)).sum(dim=1).to(src.dtype)


def _combine_bytes(s: dict) -> float:
    src, w = s["expert_out"], s["weights"]
    T, K = w.shape
    D = src.shape[-1]
    return (T * K + T) * D * src.element_size() + T * K * (4 + 4)


def _zero_flops(s: dict) -> float:
    return 0.0


def _combine_flops(s: dict) -> float:
    return 2.0 * s["expert_out"].numel()


GATE_PEER = "torch reference (sort-based top-k)"
DISPATCH_PEER = "torch sort + index_select"
COMBINE_PEER = "torch index_select + float32 sum"
# each op's kernel, peer, peer name, flops and bytes: the fields after a case's setup
GATE = (_gate_kernel, _gate_peer, GATE_PEER, _zero_flops, _gate_bytes)
DISPATCH = (_dispatch_kernel, _dispatch_peer, DISPATCH_PEER, _zero_flops, _dispatch_bytes)
COMBINE = (_combine_kernel, _combine_peer, COMBINE_PEER, _combine_flops, _combine_bytes)

CASES = [
    BenchCase("gate", "T4096_E256_v3", _gate_setup(4096, 256), *GATE),
    BenchCase("dispatch", "T4096_K8_E256_D7168_bf16", _routing_setup(4096, 8, 256, 7168), *DISPATCH),
    BenchCase("combine", "T4096_K8_E256_D7168_bf16", _routing_setup(4096, 8, 256, 7168), *COMBINE),
    # Decode-sized (batch 64): latency, timed from a CUDA graph as the engine runs them.
    GraphCase("gate", "T64_E256_v3", _gate_setup(64, 256), *GATE),
    GraphCase("dispatch", "T64_K8_E256_D7168_bf16", _routing_setup(64, 8, 256, 7168), *DISPATCH),
    GraphCase("combine", "T64_K8_E256_D7168_bf16", _routing_setup(64, 8, 256, 7168), *COMBINE),
]


def sweep() -> None:
    """Time dispatch and combine at the prefill case over column tiles and warps (GPU)."""
    import itertools

    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.kernels import moe

    dev = torch.device("cuda")
    original = moe._cfg
    for T in (4096, 64):
        s = _routing_setup(T, 8, 256, 7168)(dev)
        for op, run, nbytes in (("dispatch", _dispatch_kernel, _dispatch_bytes(s)), ("combine", _combine_kernel, _combine_bytes(s))):
            base = dict(original(op, "tokens", dev))
            for block_bytes, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
                cfg = dict(base, block_bytes=block_bytes, **({"copy_warps": warps} if op == "dispatch" else {"num_warps": warps}))
                moe._cfg = lambda o, v, d, cfg=cfg, op=op: cfg if o == op else original(o, v, d)
                run(s)
                ms = time_ms(lambda: run(s))
                print(f"{op} T={T} block_bytes={block_bytes:5d} warps={warps:2d}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:.2f} TB/s", flush=True)
            moe._cfg = original


def probe() -> None:
    """Where dispatch's time goes (GPU): the counting sort alone, the whole op, and torch's
    write-heavy broadcast copy of the same bytes (one row read, top_k rows written), all from CUDA
    graphs (no launch overhead)."""
    from deepinfer_cuda.bench.runner import graph_time_ms
    from deepinfer_cuda.kernels.moe import dispatch

    dev = torch.device("cuda")
    s = _routing_setup(4096, 8, 256, 7168)(dev)
    x, ids = s["x"], s["ids"]
    T, D = x.shape
    K = ids.shape[-1]
    x8 = x[:, :8].contiguous()
    nbytes = _dispatch_bytes(s)
    ms_sort = graph_time_ms(lambda: dispatch(x8, ids, num_experts=256))
    ms_all = graph_time_ms(lambda: dispatch(x, ids, num_experts=256))
    out = torch.empty(T, K, D, dtype=x.dtype, device=dev)
    ms_bcast = graph_time_ms(lambda: out.copy_(x[:, None, :].expand(T, K, D)))
    print(f"dispatch T=4096: sort only {ms_sort * 1e3:.1f} us, whole {ms_all * 1e3:.1f} us = {nbytes / ms_all / 1e9:.2f} TB/s; "
          f"torch broadcast copy of the same bytes {ms_bcast * 1e3:.1f} us = {nbytes / ms_bcast / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    import sys

    if "--sweep" in sys.argv:
        sweep()
    else:
        probe()
