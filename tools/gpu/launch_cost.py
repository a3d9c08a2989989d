"""Host cost of launching the symmetric-memory path's Triton kernels on one GPU (no peers, no
waiting): the same arguments as a 128-token dispatch's send kernel, launched 200 times."""

import time

import torch

from deepinfer_cuda.kernels import moe_ep_symm as symm

dev = torch.device("cuda", 0)
T, K, E, W, D = 128, 8, 256, 2, 7168 * 2 // 8
x = torch.zeros(T, D, dtype=torch.int64, device=dev)
ids = torch.randint(0, E, (T, K), dtype=torch.int32, device=dev)
tok = torch.zeros(W * T * D, dtype=torch.int64, device=dev)
meta = torch.zeros(W + W * T * K, dtype=torch.int32, device=dev)
row = torch.empty(T * K, dtype=torch.int32, device=dev)


def ptr(t: torch.Tensor) -> torch.Tensor:
    """The pointer table of a symmetric buffer: both "ranks" write to this one tensor."""
    return torch.tensor([t.data_ptr()] * W, dtype=torch.int64, device=dev)


def launch():
    symm._send_kernel[(T + 1, 8)](x, ids, tok_ptrs, meta_ptrs, row, row, row, row,
                                  T, D, E, E // W, W, 0, T, 1, D, D // 8, W + W * T * K, W + W * T * K,
                                  K=K, TILE_S=1, COUNTED=False, BLOCK_E=E, BLOCK_K=K, BLOCK_D=1024, num_warps=8)


tok_ptrs, meta_ptrs = ptr(tok), ptr(meta)
for _ in range(5):
    launch()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(200):
    launch()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"send kernel: {(t1 - t0) / 200 * 1e6:.1f} us per launch on the host, {(t2 - t0) / 200 * 1e6:.1f} us per kernel end to end")
