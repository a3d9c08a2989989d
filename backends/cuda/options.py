"""The cuda backend's options (deepinfer.options): declared on its BackendSpec, read by the kernels'
`when` predicates through the ResolveContext. Light: imported when the backend is declared."""

from __future__ import annotations

from deepinfer.options import BackendOption

EP_PATH = BackendOption(
    "ep_path",
    ("auto", "nccl", "symm"),
    "auto",
    "expert-parallel dispatch/combine: auto = symmetric memory where it can run (one host, peer access), "
    "else all_to_all_single over NCCL; nccl = all_to_all_single; symm = symmetric memory (an error where it cannot run)",
    env="DEEPINFER_EP_PATH",
)

MXFP4_PATH = BackendOption(
    "mxfp4_path",
    ("auto", "dot_scaled", "upcast", "register", "gluon"),
    "auto",
    "mxfp4 GEMMs with bf16/fp16 activations: auto = on SM90 (no block-scaled MMA there) e2m1 dequantised in registers, "
    "by the warp-specialised Gluon kernel for every call it serves (prefill and decode sizes; the tl kernel for the rest), "
    "tl.dot_scaled where Triton and the GPU have it (SM100), else the in-kernel e2m1 upcast; "
    "dot_scaled / upcast / register force one (dot_scaled is an error where it is missing; register also takes "
    "mxfp8 and mxfp4_a8 through the register dequant); fp8_block32 (W8A16) takes the same path as mxfp4; "
    "gluon = on SM90, every mxfp4 call with bf16 activations it serves by the Gluon kernel (TMA producer warp, "
    "dequantising wgmma consumers), everything else as auto",
    env="DEEPINFER_CUDA_MXFP4_PATH",
)

FP8_PATH = BackendOption(
    "fp8_path",
    ("auto", "tl", "gluon", "cublas"),
    "auto",
    "fp8_block GEMMs (linear, grouped_gemm) with bf16/fp16 activations: auto = cublas where it runs (SM90, a torch "
    "with block-scaled FP8), else the tl kernel; tl = the tl kernel; "
    "gluon = on SM90, every call it serves by the persistent warp-specialised Gluon kernel (TMA producer warp, fp8 wgmma "
    "consumer warpgroups promoting each 128-K group, DeepGEMM's schedule), the rest by the tl kernel; cublas = on SM90, "
    "linear calls of at least 1024 rows and masked grouped calls of at most 16 groups of 16384 rows by cuBLAS's "
    "block-scaled FP8 GEMM (torch._scaled_mm; an error where torch cannot run it), the rest by the tl kernel",
    env="DEEPINFER_CUDA_FP8_PATH",
)

PDL = BackendOption(
    "pdl",
    ("auto", "on", "off"),
    "auto",
    "programmatic dependent launch of the Triton kernels (each waits for the kernel before it with griddepcontrol.wait, "
    "so the next one is launched and resident while it drains): auto = on where it can run (SM90 or newer, not "
    "under the Triton interpreter); on = the same, an error where it cannot run; off = plain stream-ordered launches",
    env="DEEPINFER_CUDA_PDL",
)

SPARSE_ATTENTION_PATH = BackendOption(
    "sparse_attention_path",
    ("auto", "tl", "gluon"),
    "auto",
    "sparse_attention (DeepSeek-V4's attention): auto = on SM90 with Gluon, calls of at least 2 queries by the Gluon "
    "kernel below of their cache's format, a single query by the tl kernel; tl = the tl kernel; gluon = on SM90, "
    "every call a warp-specialised Gluon kernel serves (bf16 q, 512-wide heads; FP8 caches: a converting warpgroup gathering "
    "the rows into bf16 tiles, bf16 caches: a cp.async loader gathering them; two wgmma warpgroups) "
    "by it, the rest by the tl kernel (kernels/sparse_attention_path.py)",
    env="DEEPINFER_CUDA_SPARSE_ATTENTION_PATH",
)

MLA_DECODE_PATH = BackendOption(
    "mla_decode_path",
    ("auto", "tl", "gluon"),
    "auto",
    "mla_decode on SM90: auto = where Triton has Gluon for Hopper, over an FP8 cache the warp-specialised Gluon kernel (a "
    "converting warpgroup) for the calls it serves, over a bf16 cache the Gluon kernel (a TMA loader warp, two wgmma "
    "warpgroups) for the calls of at least 64 query rows (S * H) it serves, the rest by the tl kernel; tl = the tl kernel "
    "for every cache; gluon = as auto, an error without Gluon for Hopper",
    env="DEEPINFER_CUDA_MLA_DECODE_PATH",
)

PREFILL_PATH = BackendOption(
    "prefill_path",
    ("auto", "tl", "gluon"),
    "auto",
    "prefill attention on SM90: auto = the Gluon kernel below where Triton has Gluon for Hopper, else the tl kernel; tl = "
    "the tl kernel; gluon = the warp-specialised Gluon kernel (FlashAttention-3's schedule: a TMA producer, two wgmma "
    "warpgroups taking turns; its GPU tests passed) for the calls it serves (bf16, Dqk/Dv 192/128 or 128/128, no sliding "
    "window), the tl kernel for the rest; an error without Gluon for Hopper",
    env="DEEPINFER_CUDA_PREFILL_PATH",
)

OPTIONS = (EP_PATH, MXFP4_PATH, FP8_PATH, PDL, SPARSE_ATTENTION_PATH, MLA_DECODE_PATH, PREFILL_PATH)
