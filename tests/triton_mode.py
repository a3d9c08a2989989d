"""How the Triton kernels run in this test process, checked loudly: interpreted on the CPU, or compiled on a GPU.

Triton decides whether a @triton.jit function is interpreted when it is decorated, from
TRITON_INTERPRET at that moment. tests/conftest.py sets TRITON_INTERPRET=1 (unless the environment
already sets it) before anything imports triton, so under pytest every kernel is interpreted (numpy
on the CPU). Two modes are legitimate:

* "interpreter": TRITON_INTERPRET=1 and triton's own jit functions are InterpretedFunctions;
* "gpu": TRITON_INTERPRET set to something else (e.g. TRITON_INTERPRET=0) and a CUDA device present,
  which is how the kernels are checked on a GPU (only test files that say so support it).

Anything else (triton imported before TRITON_INTERPRET=1 was set, TRITON_INTERPRET changed after
triton was imported, a kernel module decorated in the other mode, or neither interpreter nor GPU)
fails the test with a message saying what is wrong. Nothing is skipped and nothing is re-run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch
import triton
import triton.language
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

INTERPRETER = "interpreter"
GPU = "gpu"


def mode() -> str:
    """INTERPRETER or GPU; fails the calling test when the kernels can run neither way in this process."""
    env = os.environ.get("TRITON_INTERPRET")
    decorated_for_interpreter = isinstance(triton.language.standard.sum, InterpretedFunction)
    if env == "1":
        if not decorated_for_interpreter:
            pytest.fail(
                "TRITON_INTERPRET=1, but triton was imported before it was set, so its jit functions are "
                "compiled for a GPU. Set TRITON_INTERPRET=1 before triton is imported (tests/conftest.py does).",
                pytrace=False,
            )
        return INTERPRETER
    if decorated_for_interpreter:
        pytest.fail(
            f"triton was imported under TRITON_INTERPRET=1, but TRITON_INTERPRET is now {env!r}: the kernels "
            "and the wrappers (which read TRITON_INTERPRET when called) would disagree.",
            pytrace=False,
        )
    if not torch.cuda.is_available():
        pytest.fail(
            f"TRITON_INTERPRET={env!r} and no CUDA device: the Triton kernels can run neither in the interpreter "
            "nor on a GPU. Leave TRITON_INTERPRET unset (tests/conftest.py sets it to 1) or run on a GPU.",
            pytrace=False,
        )
    return GPU


def require_interpreter() -> None:
    """For tests that give the kernels CPU tensors: they run in the interpreter only."""
    if mode() != INTERPRETER:
        pytest.fail(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}: these tests pass CPU tensors and run the "
            "kernels in the Triton interpreter only. Run them with TRITON_INTERPRET=1 (the default under pytest).",
            pytrace=False,
        )


def require_interpreter_or_gpu() -> torch.device:
    """The device the kernels' tensors live on: the CPU when interpreted, the GPU otherwise."""
    return torch.device("cpu" if mode() == INTERPRETER else "cuda")


def kernel_module(name: str) -> ModuleType:
    """Import `name` and check that its Triton functions were decorated in this process's mode.

    A kernel module imported before TRITON_INTERPRET=1 was set would hold GPU-compiled kernels; that
    cannot happen under pytest (conftest sets it first), and if it does this fails instead of reloading.
    """
    want = InterpretedFunction if mode() == INTERPRETER else JITFunction
    module = importlib.import_module(name)
    jitted = {n: v for n, v in vars(module).items() if isinstance(v, (InterpretedFunction, JITFunction))}
    assert jitted, f"{name} defines no Triton jit functions: is it the kernel module?"
    wrong = sorted(n for n, v in jitted.items() if not isinstance(v, want))
    if wrong:
        pytest.fail(
            f"{name} was imported in the other Triton mode (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} "
            f"now): {', '.join(wrong)} are not {want.__name__}s. Something imported it before tests/conftest.py "
            "set TRITON_INTERPRET.",
            pytrace=False,
        )
    return module
