"""Which kernel serves a `sparse_attention` call on SM90, by backend option sparse_attention_path (options.py).

Three implementations, one file each: the tl kernel (sparse_attention.py, every call, what the interpreter checks), the
Gluon kernel over FP8 caches (sparse_attention_fp8_gluon.py) and the Gluon kernel over bf16 caches
(sparse_attention_gluon.py). The option is read once, at resolve time, and picks one of the
functions below; the cache's format is a property of each call (its kv), so that function hands a call to the Gluon
kernel of its format where that kernel serves it (`not_served`), and to the tl kernel otherwise:
- auto (the default), on SM90 with Gluon for Hopper: calls of at least AUTO_MIN_QUERIES queries on the Gluon kernel of
  their cache's format (FP8 or bf16; both passed `deepinfer conformance --backend cuda` with them chosen on a GPU),
  a single query (a batch-1 decode step, where the tl kernel measured faster) and the calls they do not serve on the tl
  kernel. Without SM90 or Gluon: the tl kernel.
- gluon, on SM90: every call a Gluon kernel serves on it (FP8 and bf16 caches), the rest on the tl kernel; an error
  where Triton has no Gluon for Hopper; elsewhere the tl kernel.
- tl: the tl kernel.
Deterministic mode keeps the tl kernel's batch-invariant registration whatever the option says (neither Gluon kernel
is batch-invariant: their splits follow the batch).
"""

from __future__ import annotations

import torch

from deepinfer_cuda.kernels import sparse_attention_fp8_gluon as fp8_gluon
from deepinfer_cuda.kernels import sparse_attention_gluon as bf16_gluon
from deepinfer_cuda.kernels.common import Registration
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable
from deepinfer_cuda.options import SPARSE_ATTENTION_PATH

# sparse_attention_path=auto serves calls of at least this many queries on the Gluon kernels (H200, window 128 + top 512,
# 64 heads, ctx 32k): one decode query took 12.7 us on the FP8 kernel against the tl kernel's 11.9 and 11.9 us on the
# bf16 kernel against 9.6; 64 / 256 queries 35.6 / 96.0 us against 97.8 / 212.5 (FP8,
# docs/measurements/2026-12-07/h200/ops_sparse.txt) and 30.4 / 70.9 us against 47.5 / 118.7 (bf16,
# docs/measurements/2026-12-07/h200_round13/b/ops_sparse.txt)
AUTO_MIN_QUERIES = 2


def _op(min_queries: int, bf16_cache: bool):
    """The op on the Gluon kernels for the calls they serve of at least `min_queries` queries (bf16_cache: the bf16-cache
    kernel too, else FP8 caches only), else on sparse_attention.py's tl kernel."""

    def sparse_attention(
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sinks: torch.Tensor,
        *,
        softmax_scale: float,
        extra_kv: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_lengths: torch.Tensor | None = None,
        out_positions: torch.Tensor | None = None,
        out_cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from deepinfer_cuda.kernels import sparse_attention as tl_sparse

        args = (q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
        out = None
        if q.shape[0] >= min_queries:  # each Gluon launch declines (None) the calls it does not serve: another cache format among them
            out = fp8_gluon.launch_sparse_attention_fp8_gluon(*args)
            if out is None and bf16_cache:
                out = bf16_gluon.launch_sparse_attention_gluon(*args)
        return out if out is not None else tl_sparse.launch_sparse_attention(*args)

    return sparse_attention


sparse_attention = _op(1, bf16_cache=True)  # sparse_attention_path=gluon: every call a Gluon kernel serves
sparse_attention_auto = _op(AUTO_MIN_QUERIES, bf16_cache=True)  # sparse_attention_path=auto
sparse_attention_auto.__qualname__ = "sparse_attention_auto"


def _chosen(ctx) -> bool:
    """sparse_attention_path=gluon on an SM90 device (elsewhere that option leaves the op to the tl kernel)."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    return SPARSE_ATTENTION_PATH.value(ctx) == "gluon" and is_sm90(ctx.device)


def _chosen_by_auto(ctx) -> bool:
    """sparse_attention_path=auto on an SM90 device whose Triton has Gluon for Hopper (else auto is the tl kernel)."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    return SPARSE_ATTENTION_PATH.value(ctx) == "auto" and is_sm90(ctx.device) and GLUON_IMPORT_ERROR is None


def _unusable(ctx) -> str | None:
    return gluon_unusable("sparse_attention_path=gluon", GLUON_IMPORT_ERROR)


REGISTRATIONS = [
    Registration(
        op="sparse_attention",
        fn=sparse_attention,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        unusable=_unusable,
        note="Gluon (SM90; sparse_attention_path=gluon): warp-specialised, a warpgroup gathering 64-row tiles into bf16 stages (FP8 caches: "
        "converting them; bf16 caches: cp.async), a softmax warpgroup scoring every row and a value warpgroup, each "
        "owning half the output columns; the tl kernel for the calls they do not serve",
    ),
    Registration(
        op="sparse_attention",
        fn=sparse_attention_auto,
        dtypes=(torch.bfloat16,),
        when=_chosen_by_auto,
        priority=1,
        note="Gluon (SM90; sparse_attention_path=auto): the Gluon kernel of the cache's format (FP8 or bf16) for calls of at least 2 "
        "queries, the tl kernel for one query (where it measured faster) and for the calls the Gluon kernels do not serve",
    ),
]
