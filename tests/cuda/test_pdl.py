"""Programmatic dependent launch (PDL) in the cuda backend, checked without a GPU.

Every kernel of deepinfer_cuda.kernels (moe_ep_symm's aside, which order themselves across ranks and
keep plain launches) takes `PDL: tl.constexpr`, waits on the preceding grid before anything else
(`pdl_prologue(PDL)` first), and every launch site passes `**pdl_launch(device)`: read from the
sources, for every module of the package (found by iterating it). `pdl_launch` gives PDL only on an
SM90+ GPU outside the interpreter and outside a kernel resolved with backend option pdl=off; pdl=on
is a one-line error at resolve where PDL cannot run (here: the interpreter). That the PDL variants
compile to griddepcontrol.wait / launch_dependents without new spills is the compile check's
(tests/cuda/test_compile_check.py); that results are unchanged on a GPU is the conformance run's.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest
import torch

import deepinfer_cuda.kernels as kernels_package
from deepinfer.options import BackendOptionError
from deepinfer.plugins import Plugins
from deepinfer.registry import RegistryError
from deepinfer.runtime import open_runtime
from deepinfer_cuda.options import OPTIONS, PDL

WITHOUT_PDL = {"moe_ep_symm"}  # cross-rank ordering through symmetric memory: see its docstring


def _modules():
    return sorted(m.name for m in pkgutil.iter_modules(kernels_package.__path__))


def _source(name: str) -> str:
    return (Path(kernels_package.__file__).parent / f"{name}.py").read_text()


def _launches(tree: ast.Module):
    """(kernel name, call) of every `name[grid](...)` in the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        return body[1]
    return body[0]


def test_every_kernel_waits_first_and_every_launch_passes_pdl():
    checked = 0
    for name in _modules():
        tree = ast.parse(_source(name))
        jit = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        launches = [(k, call) for k, call in _launches(tree) if k in jit]
        for kernel, call in launches:
            fn = jit[kernel]
            params = {a.arg: a for a in fn.args.args}
            pdl_kwargs = [kw for kw in call.keywords if kw.arg is None and ast.unparse(kw.value).startswith("pdl_launch(")]
            first = ast.unparse(_first_statement(fn))
            if name in WITHOUT_PDL:
                assert "PDL" not in params and not pdl_kwargs, f"{name}.{kernel}: the symmetric-memory kernels keep plain launches"
                continue
            assert "PDL" in params and ast.unparse(params["PDL"].annotation) == "tl.constexpr", f"{name}.{kernel} has no `PDL: tl.constexpr`"
            assert first == "pdl_prologue(PDL)", f"{name}.{kernel} starts with {first!r}, not pdl_prologue(PDL)"
            assert len(pdl_kwargs) == 1, f"{name}.{kernel}: a launch (line {call.lineno}) without **pdl_launch(device)"
            checked += 1
    assert checked >= 50  # every launch site of the package, not a few


def test_pdl_launch_only_on_sm90_gpus_outside_the_interpreter_and_pdl_off(monkeypatch):
    from deepinfer_cuda.kernels import common

    gpu = torch.device("cuda", 0)
    assert common.pdl_launch(torch.device("cpu")) == {"PDL": False}
    assert common.pdl_launch(gpu) == {"PDL": False}  # TRITON_INTERPRET=1 in this process
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "_pdl_capable", lambda index: True)
    assert common.pdl_launch(gpu) == {"PDL": True, "launch_pdl": True}
    assert common.without_pdl(lambda: common.pdl_launch(gpu))() == {"PDL": False}
    assert common.pdl_launch(gpu) == {"PDL": True, "launch_pdl": True}  # only inside the wrapped call
    assert common.pdl_unavailable(gpu) is None
    monkeypatch.setattr(common, "_pdl_capable", lambda index: False)  # an SM80 GPU
    assert common.pdl_launch(gpu) == {"PDL": False}


def test_the_option(monkeypatch):
    """auto by default (DEEPINFER_CUDA_PDL may set it); on is an error at resolve where PDL cannot run;
    off wraps every kernel once, with the op's signature, computing the same."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("DEEPINFER_CUDA_PDL", raising=False)
    assert PDL in OPTIONS and PDL.choices == ("auto", "on", "off") and PDL.default == "auto"
    plugins = Plugins()
    with pytest.raises(RegistryError) as err:
        open_runtime("cuda", interpret=True, plugins=plugins, options={"pdl": "on"})
    message = str(err.value)
    assert "\n" not in message and "backend option pdl=on, but PDL cannot run here: the kernels run under the Triton interpreter" in message
    from deepinfer_cuda.kernels import norm

    auto = open_runtime("cuda", interpret=True, plugins=plugins)
    off = open_runtime("cuda", interpret=True, plugins=plugins, options={"pdl": "off"})
    assert auto.ops.kernel("rms_norm") is norm.rms_norm
    assert off.ops.kernel("rms_norm") is not norm.rms_norm and off.ops.kernel("rms_norm").__wrapped__ is norm.rms_norm
    assert off.ops.kernel("linear", "mxfp4") is off.ops.kernel("linear", "dense")  # one wrapper per function
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    assert torch.equal(off.ops.rms_norm(x, w)[0], auto.ops.rms_norm(x, w)[0])
    monkeypatch.setenv("DEEPINFER_CUDA_PDL", "off")
    assert open_runtime("cuda", interpret=True, plugins=plugins).options["pdl"] == "off"
    monkeypatch.setenv("DEEPINFER_CUDA_PDL", "maybe")
    with pytest.raises(BackendOptionError, match=r"pdl='maybe' \(from DEEPINFER_CUDA_PDL\)"):
        open_runtime("cuda", interpret=True, plugins=plugins)
