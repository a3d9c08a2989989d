"""Probe: torch's blockwise-scaled fp8 GEMM (cuBLAS, 1x128 activations x 128x128 weights) against our fp8_block linear,
at V4-Flash's prefill projection shapes. Scratch, not committed."""
import sys, torch, triton
import torch.nn.functional as F
from deepinfer.ops import quant
from deepinfer_cuda.kernels import gemm as kg
from deepinfer_cuda.bench.gemm import v4_prefill_fp8_gemms

dev = torch.device("cuda")
print(torch.__version__, triton.__version__, torch.version.cuda, "F.scaled_mm" if hasattr(F, "scaled_mm") else "no F.scaled_mm")
g = torch.Generator(device=dev).manual_seed(0)
rows = [f"{'shape':34} {'ours ms':>8} {'TF':>6} | {'quant ms':>8} {'cublas ms':>9} {'TF':>6} {'q+cub TF':>8} | {'pertensor':>9} | maxrel"]
for T in (8192, 16384):
    for gm in v4_prefill_fp8_gemms():
        if gm.layout == "masked":
            continue
        n, k = gm.n, gm.k
        x = (torch.randn(T, k, device=dev, generator=g)).to(torch.bfloat16)
        w = torch.randn(n, k, device=dev, generator=g) * 0.05
        wq, ws = quant.quantize_weight_fp8_block(w)
        ours = lambda: kg.linear(x, wq, weight_scale=ws, fmt="fp8_block")
        qfn = lambda: kg.quantize_act_fp8(x, scale_rows_contiguous=True)
        xq, xs = qfn()
        sb = ws.T  # [K/128, N/128], stride (1, K/128)
        def cub():
            return torch._scaled_mm(xq, wq.T, scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16)
        try:
            yc = cub(); ok = True
        except Exception as e:
            print("cublas blockwise failed:", type(e).__name__, str(e).splitlines()[0][:300]); ok = False
        yo = ours()
        one = torch.ones((), device=dev)
        pt = lambda: torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        t_o = triton.testing.do_bench(ours, warmup=20, rep=100)
        t_q = triton.testing.do_bench(qfn, warmup=20, rep=100)
        t_c = triton.testing.do_bench(cub, warmup=20, rep=100) if ok else float("nan")
        t_p = triton.testing.do_bench(pt, warmup=20, rep=100)
        fl = 2 * T * n * k / 1e12
        rel = ((yc.float() - yo.float()).abs().max() / yo.float().abs().max()).item() if ok else float("nan")
        rows.append(f"{gm.name + ' ' + str(T) + 'x' + str(k) + '->' + str(n):34} {t_o:8.3f} {fl / t_o * 1e3:6.0f} | {t_q:8.3f} {t_c:9.3f} {fl / t_c * 1e3:6.0f} {fl / (t_c + t_q) * 1e3:8.0f} | {t_p:9.3f} | {rel:.2e}")
print("\n".join(rows))
# wo_a: the grouped output projection (masked, 8 groups of every token, x the transposed view)
import deepinfer_cuda.kernels.gemm_fp8_cublas as gc
for T in (8192, 16384):
    G, K, N = 8, 4096, 1024
    x = torch.randn(T, G, K, device=dev, generator=g).bfloat16().transpose(0, 1)
    w, s = quant.quantize_weight_fp8_block(torch.randn(G, N, K, device=dev, generator=g) * 0.05)
    mm = torch.full((G,), T, dtype=torch.int32, device=dev)
    o = lambda: kg.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    c = lambda: gc.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    rel = ((c().float() - o().float()).abs().max() / o().float().abs().max()).item()
    t_o, t_c = triton.testing.do_bench(o, warmup=20, rep=100), triton.testing.do_bench(c, warmup=20, rep=100)
    fl = 2 * T * G * N * K / 1e12
    print(f"wo_a masked {G}x{T}x{K}->{N}: ours {t_o:.3f} ms {fl / t_o * 1e3:.0f} TF | cublas per group {t_c:.3f} ms {fl / t_c * 1e3:.0f} TF | maxrel {rel:.2e}")
