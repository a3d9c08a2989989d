"""Benchmarks of `sample` and `apply_token_bitmask` at DeepSeek-V3's vocabulary (129280), batch 256.

Bytes: the logits read once (the floor: one pass over them). The `sample` peers are what torch
offers: a sort-based top-k / top-p filter then torch.multinomial (what the issue's 3.36 ms figure
measures), and torch.argmax for greedy rows. Every row of a case carries the same parameters; the
kernel reads them per row anyway.

`python -m deepinfer_cuda.bench.sampling` (GPU) also compares the kernel's tokens with the CPU
reference's on random rows of every kind and prints the mismatch rate and the path each row took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_cuda.bench.common import BenchCase

VOCAB = 129280


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Timed from a CUDA graph replay (the runner reads `graph`)."""

    graph: bool = True


def _setup(B: int, V: int, temperature: float, top_k: int, top_p: float, min_p: float, scale: float = 1.0):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        return {
            "logits": torch.randn(B, V, device=device, dtype=torch.float32, generator=g) * scale,
            "temperature": torch.full((B,), temperature, device=device),
            "top_k": torch.full((B,), top_k, device=device, dtype=torch.int32),
            "top_p": torch.full((B,), top_p, device=device),
            "min_p": torch.full((B,), min_p, device=device),
            "seeds": torch.randint(-(2**62), 2**62, (B,), device=device, generator=g),
            "positions": torch.randint(0, 1 << 20, (B,), device=device, generator=g),
        }

    return setup


def _kernel(s: dict):
    from deepinfer_cuda.kernels.sampling import sample

    return sample(s["logits"], s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"], s["positions"])


def _torch_top_k_top_p(s: dict):
    """The common torch sampler: sort once, mask the tail past top-k and past top-p, multinomial."""
    logits = s["logits"] / s["temperature"][:, None]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    V = logits.shape[-1]
    k = s["top_k"].long().clamp(1, V)
    ranks = torch.arange(V, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    tail = probs.cumsum(dim=-1) - probs > s["top_p"][:, None]
    probs = probs.masked_fill(tail, 0.0)
    picked = torch.multinomial(probs, 1)
    return order.gather(-1, picked).squeeze(-1)


def _torch_argmax(s: dict):
    return s["logits"].argmax(dim=-1)


def _torch_temperature(s: dict):
    probs = (s["logits"] / s["temperature"][:, None]).softmax(dim=-1)
    return torch.multinomial(probs, 1).squeeze(-1)


def _bytes(s: dict) -> float:
    return float(s["logits"].numel() * 4)


def _zero(s: dict) -> float:
    return 0.0


def _bitmask_setup(B: int, V: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        return {
            "logits": torch.randn(B, V, device=device, dtype=torch.float32, generator=g),
            "bitmask": torch.randint(-(2**31), 2**31, (B, (V + 31) // 32), device=device, dtype=torch.int64, generator=g).to(torch.int32),
        }

    return setup


def _bitmask_kernel(s: dict):
    from deepinfer_cuda.kernels.sampling import apply_token_bitmask

    return apply_token_bitmask(s["logits"], s["bitmask"])


def _bitmask_peer(s: dict):
    from deepinfer.ops.sampling import apply_token_bitmask

    return apply_token_bitmask(s["logits"], s["bitmask"])


def _bitmask_bytes(s: dict) -> float:
    # logits read and (about half of them) written, the mask read: count read + write as an upper bound
    return float(2 * s["logits"].numel() * 4 + s["bitmask"].numel() * 4)


SORT_PEER = "torch sort top-k/top-p + multinomial"

CASES = [
    BenchCase("sample", "B256_V129280_topk50_topp0.9", _setup(256, VOCAB, 1.0, 50, 0.9, 0.0), _kernel, _torch_top_k_top_p, SORT_PEER, _zero, _bytes),
    BenchCase("sample", "B256_V129280_greedy", _setup(256, VOCAB, 0.0, 0, 1.0, 0.0), _kernel, _torch_argmax, "torch.argmax", _zero, _bytes),
    # Informative: temperature only (every token is a candidate: one pass with the noise per element),
    # and top-p alone on peaked logits (the candidates come from the lane maxima).
    BenchCase("sample", "B256_V129280_temperature", _setup(256, VOCAB, 0.8, 0, 1.0, 0.0), _kernel, _torch_temperature, "torch softmax + multinomial", _zero, _bytes),
    BenchCase("sample", "B256_V129280_topp0.9_peaked", _setup(256, VOCAB, 1.0, 0, 0.9, 0.0, scale=4.0), _kernel, _torch_top_k_top_p, SORT_PEER, _zero, _bytes),
    # Decode-sized: a CUDA graph (proves no host synchronisation).
    GraphCase("sample", "B16_V129280_topk50_topp0.9", _setup(16, VOCAB, 1.0, 50, 0.9, 0.0), _kernel, _torch_top_k_top_p, SORT_PEER, _zero, _bytes),
    BenchCase("apply_token_bitmask", "B256_V129280_fp32", _bitmask_setup(256, VOCAB), _bitmask_kernel, _bitmask_peer, "torch reference", _zero, _bitmask_bytes),
]


# ---------------------------------------------------------------------------------------------
# `python -m deepinfer_cuda.bench.sampling`: token agreement with the CPU reference on the GPU


def _random_rows(B: int, V: int, gen: torch.Generator, kind: str):
    if kind == "peaked":
        logits = torch.randn(B, V, generator=gen) * 2 + torch.randn(B, V, generator=gen).pow(4)
    elif kind == "flat":
        logits = torch.randn(B, V, generator=gen) * 0.3
    elif kind == "ties":
        logits = (torch.randn(B, V, generator=gen) * 2).round()
    else:
        logits = torch.randn(B, V, generator=gen) * 3
        logits[torch.rand(B, V, generator=gen) < 0.5] = float("-inf")
    temp = torch.where(torch.rand(B, generator=gen) < 0.15, 0.0, torch.rand(B, generator=gen) * 1.5 + 0.2)
    top_k = torch.where(torch.rand(B, generator=gen) < 0.5, torch.randint(1, 200, (B,), generator=gen), 0).to(torch.int32)
    top_p = torch.where(torch.rand(B, generator=gen) < 0.5, torch.rand(B, generator=gen) * 0.9 + 0.05, 1.0)
    min_p = torch.where(torch.rand(B, generator=gen) < 0.3, torch.rand(B, generator=gen) * 0.3, 0.0)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=gen)
    positions = torch.randint(0, 1 << 20, (B,), generator=gen)
    return logits, temp, top_k, top_p, min_p, seeds, positions


def agreement(batches: int = 8, B: int = 256) -> None:
    from deepinfer.ops.sampling import sample as reference
    from deepinfer_cuda.kernels.sampling import _sample

    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    for V in (1003, 32000, VOCAB):
        for kind in ("peaked", "flat", "ties", "masked"):
            rows = mismatches = 0
            paths = torch.zeros(4, dtype=torch.int64)
            for _ in range(batches):
                args = _random_rows(B, V, gen, kind)
                p = torch.empty(B, dtype=torch.int32, device=dev)
                got = _sample(*(a.to(dev) for a in args), paths=p).cpu()
                want = reference(*args)
                rows += B
                mismatches += int((got != want).sum())
                paths += torch.bincount(p.cpu().long(), minlength=4)
            print(f"V={V:6d} {kind:7s}: {mismatches}/{rows} rows differ; paths greedy/unfiltered/candidates/fallback = {paths.tolist()}")


def sweep() -> None:
    """Time `sample` on the main case over tile sizes and warps (GPU)."""
    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.kernels.sampling import _sample

    dev = torch.device("cuda")
    for name, setup in (("topk50_topp0.9", _setup(256, VOCAB, 1.0, 50, 0.9, 0.0)), ("greedy", _setup(256, VOCAB, 0.0, 0, 1.0, 0.0)),
                        ("temperature", _setup(256, VOCAB, 0.8, 0, 1.0, 0.0)), ("topp0.9_peaked", _setup(256, VOCAB, 1.0, 0, 0.9, 0.0, 4.0))):
        s = setup(dev)
        args = [s[k] for k in ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "positions")]
        for block, warps in ((2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
            _sample(*args, block=block, num_warps=warps)
            ms = time_ms(lambda: _sample(*args, block=block, num_warps=warps))
            print(f"sample {name:15s} BLOCK={block:5d} warps={warps:2d}: {ms * 1e3:8.1f} us  {_bytes(s) / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    import sys

    if "--sweep" in sys.argv:
        sweep()
    else:
        agreement(batches=1)
