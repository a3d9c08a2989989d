"""Backend option sparse_attention_path (kernels/sparse_attention_path.py): which sparse_attention kernel the cuda
backend's registrations resolve to, and where each call then goes (the Gluon kernel of the call's cache format, or the
tl kernel). CPU only: the kernels' launches are replaced by recorders."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.sparse_attention_path as paths  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.options import BackendOptionError, resolve_options
from deepinfer.registry import Registry, RegistryError, ResolveContext

if paths.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {paths.GLUON_IMPORT_ERROR}", allow_module_level=True)

FP8 = torch.float8_e4m3fn


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _chosen(monkeypatch, options, sm90=True, dtype=torch.bfloat16, deterministic=False):
    """The sparse_attention kernel the cuda backend's registrations resolve to."""
    import deepinfer_cuda.kernels.gemm_mxfp4_gluon as gemm_gluon
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse

    monkeypatch.setattr(gemm_gluon, "is_sm90", lambda device: sm90)
    registry = Registry()
    registry.register_all("cuda", tl_sparse.REGISTRATIONS + paths.REGISTRATIONS)
    ctx = ResolveContext("cuda", device=torch.device("cuda", 0), dtype=dtype, options=options, deterministic=deterministic)
    return registry.choose(ctx, "sparse_attention").fn


def test_the_backend_option_chooses_on_sm90_only(monkeypatch):
    """auto (the default) takes the auto entry on SM90 with Gluon (the tl kernel elsewhere, and without Gluon: no error),
    tl keeps the tl kernel; sparse_attention_path=gluon takes the Gluon entry on SM90 for bf16 models, and leaves the tl
    kernels elsewhere, for other dtypes and in deterministic mode (the Gluon kernels are not batch-invariant)."""
    from deepinfer_cuda.kernels import sparse_attention as tl_sparse
    from deepinfer_cuda.options import OPTIONS, SPARSE_ATTENTION_PATH

    assert SPARSE_ATTENTION_PATH in OPTIONS and SPARSE_ATTENTION_PATH.choices == ("auto", "tl", "gluon") and SPARSE_ATTENTION_PATH.default == "auto"
    gluon = {"sparse_attention_path": "gluon"}
    assert _chosen(monkeypatch, {}) is _chosen(monkeypatch, {"sparse_attention_path": "auto"}) is paths.sparse_attention_auto
    assert _chosen(monkeypatch, {}, sm90=False) is _chosen(monkeypatch, {}, dtype=torch.float32) is tl_sparse.sparse_attention
    assert _chosen(monkeypatch, {}, deterministic=True) is tl_sparse.sparse_attention_invariant
    assert _chosen(monkeypatch, {"sparse_attention_path": "tl"}) is tl_sparse.sparse_attention
    assert _chosen(monkeypatch, gluon) is paths.sparse_attention
    assert _chosen(monkeypatch, gluon, sm90=False) is tl_sparse.sparse_attention
    assert _chosen(monkeypatch, gluon, dtype=torch.float32) is tl_sparse.sparse_attention
    assert _chosen(monkeypatch, gluon, deterministic=True) is tl_sparse.sparse_attention_invariant
    monkeypatch.setattr(paths, "GLUON_IMPORT_ERROR", "ImportError: no hopper")
    assert _chosen(monkeypatch, {}) is tl_sparse.sparse_attention
    with pytest.raises(RegistryError, match="sparse_attention_path=gluon, but Triton .* no usable Gluon for Hopper") as err:
        _chosen(monkeypatch, gluon)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("DEEPINFER_CUDA_SPARSE_ATTENTION_PATH", "gluon")
    assert resolve_options("cuda", OPTIONS)["sparse_attention_path"] == "gluon"
    monkeypatch.setenv("DEEPINFER_CUDA_SPARSE_ATTENTION_PATH", "fast")
    with pytest.raises(BackendOptionError, match="DEEPINFER_CUDA_SPARSE_ATTENTION_PATH"):
        resolve_options("cuda", OPTIONS)


@pytest.fixture
def calls(monkeypatch):
    """Each launch replaced by a recorder of (kernel, queries, cache dtype); each Gluon recorder serves only its cache
    format (the real launches decline the others: `not_served`)."""
    import deepinfer_cuda.kernels.sparse_attention as tl_sparse
    import deepinfer_cuda.kernels.sparse_attention_fp8_gluon as fp8_gluon
    import deepinfer_cuda.kernels.sparse_attention_gluon as bf16_gluon

    seen = []

    def recorder(name, serves):
        def launch(q, kv, *args):
            if serves is not None and kv.dtype != serves:
                return None
            seen.append((name, q.shape[0], kv.dtype))
            return q

        return launch

    monkeypatch.setattr(fp8_gluon, "launch_sparse_attention_fp8_gluon", recorder("fp8 gluon", FP8))
    monkeypatch.setattr(bf16_gluon, "launch_sparse_attention_gluon", recorder("bf16 gluon", torch.bfloat16))
    monkeypatch.setattr(tl_sparse, "launch_sparse_attention", recorder("tl", None))
    return seen


def _call(fn, t, cache_dtype):
    width = 528 if cache_dtype == FP8 else 512
    fn(_meta(t, 64, 512), _meta(4096, width, dtype=cache_dtype), _meta(t, 128, dtype=torch.int32), _meta(64), softmax_scale=0.1)


def test_auto_leaves_one_query_to_the_tl_kernel(calls):
    """sparse_attention_path=auto: calls of AUTO_MIN_QUERIES queries or more on the Gluon kernel of their cache's
    format, a single query (a batch-1 decode step) on the tl kernel, where it measured faster."""
    for t in (1, paths.AUTO_MIN_QUERIES, 256):
        _call(paths.sparse_attention_auto, t, FP8)
    for t in (1, 64, 256):
        _call(paths.sparse_attention_auto, t, torch.bfloat16)
    assert calls == [("tl", 1, FP8), ("fp8 gluon", paths.AUTO_MIN_QUERIES, FP8), ("fp8 gluon", 256, FP8),
                     ("tl", 1, torch.bfloat16), ("bf16 gluon", 64, torch.bfloat16), ("bf16 gluon", 256, torch.bfloat16)]  # fmt: skip


def test_gluon_takes_the_kernel_of_the_call_s_cache_format(calls):
    """sparse_attention_path=gluon: every call on the Gluon kernel of its cache's format, one query included; a call
    neither serves (here a float16 cache) on the tl kernel."""
    for t in (1, 64):
        _call(paths.sparse_attention, t, FP8)
        _call(paths.sparse_attention, t, torch.bfloat16)
    _call(paths.sparse_attention, 64, torch.float16)
    assert calls == [("fp8 gluon", 1, FP8), ("bf16 gluon", 1, torch.bfloat16), ("fp8 gluon", 64, FP8), ("bf16 gluon", 64, torch.bfloat16),
                     ("tl", 64, torch.float16)]  # fmt: skip
