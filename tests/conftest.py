"""Shared fixtures: the out-of-tree packages of tests/fixtures, each installed for real into a
temporary folder (the backend plugin; the extension adding an op family, its cases and a backend;
broken op and case packages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# CPU-only test machines: every Triton kernel runs in the interpreter. Triton decides at decoration
# time, so this must be set before anything imports triton (conftest is imported first).
os.environ.setdefault("TRITON_INTERPRET", "1")
# CI's two xdist workers share two cores: each process, and every subprocess a test starts (the
# conformance runs, the ranks), keeps to one OpenMP / BLAS thread; wider teams on a busy machine
# only wait for each other (a conformance run: 150 -> 127 CPU seconds). Tests of the thread rule
# set or clear OMP_NUM_THREADS themselves.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

FIXTURES = Path(__file__).parent / "fixtures"


def _row_invariant_interpreter_dot() -> None:
    """The interpreter's tl.dot is numpy's float32 matmul (OpenBLAS sgemm), whose rounding of a row
    depends on where the row sits in the tile on some CPUs (measured: AMD EPYC, OpenBLAS 0.3.31
    Haswell kernels: 1143 of 4096 values of a 64-row product change when a row moves). A GPU's MMA
    rounds a row the same wherever it sits, and the batch-invariance tests check the kernels' own
    tiling and reduction order, not the host's BLAS: so float32 products are summed in float64 and
    rounded once, which no row position changes."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data
        fp8 = 8 in (a.dtype.primitive_bitwidth, b.dtype.primitive_bitwidth)  # converted by the original (numpy's own fp16 loops, not BLAS)
        if fp8 or acc.dtype != np.float32 or a.data.dtype.kind != "f" or b.data.dtype.kind != "f":
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()

# CI runs two workers that take whole files in collection order (pytest-xdist --dist loadfile). The
# files that take minutes start first, so that neither worker is left running one at the end while
# the other waits (longest first; measured with --durations on the 2-core CI machine).
LONGEST_FIRST = (
    "ascend/test_end_to_end.py",
    "ascend/test_attention_kernels.py",
    "engine/test_deterministic_kernels_ascend.py",
    "engine/test_deterministic.py",
    "cuda/test_end_to_end.py",
    "engine/test_deterministic_kernels_cuda.py",
    "ascend/test_sampling_kernels.py",
    "ascend/test_moe_kernels.py",
    "distributed/test_ep_generate.py",
    "engine/test_speculative.py",
    "ascend/test_misc_kernels.py",
    "engine/test_cli_run_batch.py",
    "cuda/test_batch_invariance.py",
    "serve/test_ep_serve.py",
    "engine/test_structured_output.py",
    "cuda/test_structured_output_kernels.py",
    "ascend/test_structured_output_kernels.py",
)


def pytest_collection_modifyitems(config, items):
    """The LONGEST_FIRST files before the others (each file's tests keep their order)."""
    tests = Path(__file__).parent

    def rank(item) -> int:
        try:
            name = Path(str(item.fspath)).relative_to(tests).as_posix()
        except ValueError:
            return len(LONGEST_FIRST)
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def pip_install_fixture(name: str, tmp_path_factory) -> Path:
    """pip-install tests/fixtures/<name> into a fresh folder; return it (add it to PYTHONPATH)."""
    target = tmp_path_factory.mktemp(f"{name}_site")
    build = tmp_path_factory.mktemp(f"{name}_build")
    # Build from a copy: pip writes build/ and *.egg-info next to the sources.
    src = build / name
    subprocess.run(["cp", "-r", str(FIXTURES / name), str(src)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        check=True,
    )
    return target


def env_with(*sites: Path) -> dict[str, str]:
    """This environment, with `sites` in front of PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="session")
def oot_site(tmp_path_factory) -> Path:
    """tests/fixtures/oot_backend, installed into a folder."""
    return pip_install_fixture("oot_backend", tmp_path_factory)


@pytest.fixture
def oot_env(oot_site) -> dict[str, str]:
    return env_with(oot_site)


@pytest.fixture(scope="session")
def oot_extension_site(tmp_path_factory) -> Path:
    """tests/fixtures/oot_extension (op family softcap, its cases, backend oot_ext), installed into a folder."""
    return pip_install_fixture("oot_extension", tmp_path_factory)


@pytest.fixture(scope="session")
def oot_bad_ops_site(tmp_path_factory) -> Path:
    """tests/fixtures/oot_bad_ops (an op package that fails to import, one that reuses a core op's
    name, cases for an op nobody declares), installed into a folder."""
    return pip_install_fixture("oot_bad_ops", tmp_path_factory)


@pytest.fixture
def oot_extension_env(oot_extension_site) -> dict[str, str]:
    return env_with(oot_extension_site)


@pytest.fixture
def oot_extension_and_bad_ops_env(oot_extension_site, oot_bad_ops_site) -> dict[str, str]:
    return env_with(oot_extension_site, oot_bad_ops_site)
