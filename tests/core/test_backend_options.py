"""Backend options (deepinfer.options): declared on a BackendSpec, validated once when the backend is
opened, carried by the ResolveContext to the kernels' `when`; a forced kernel that cannot run is one
line at resolve; capabilities are fields of the registration. Checked with a fake backend plugin
(tests/fake_backend.py) and with the cuda backend's real options under the interpreter."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cli.main import main
from deepinfer.options import BackendOptionError, parse_assignments
from deepinfer.plugins import Plugins
from deepinfer.registry import RegistryError
from deepinfer.runtime import open_runtime

from fake_backend import UNUSABLE


def norm_once(runtime):
    runtime.ops.rms_norm(torch.randn(2, 8), torch.ones(8))


def test_options_default_and_choose_the_kernel_at_resolve(fake):
    runtime = open_runtime("fake", dtype=torch.float32, plugins=fake.plugins())
    assert dict(runtime.options) == {"norm_flavour": "plain", "exotic": "off"}
    norm_once(runtime)
    runtime = open_runtime("fake", dtype=torch.float32, plugins=fake.plugins(), options={"norm_flavour": "fancy"})
    norm_once(runtime)
    assert fake.calls == ["plain", "fancy"]


def test_unknown_option_is_one_line_naming_the_backend_and_its_options(fake):
    with pytest.raises(BackendOptionError) as err:
        open_runtime("fake", plugins=fake.plugins(), options={"nope": "1"})
    assert str(err.value) == "backend 'fake' has no option 'nope'; its options: exotic, norm_flavour (see `deepinfer backends`)"
    with pytest.raises(BackendOptionError, match="backend 'reference' has no option 'norm_flavour'; its options: none"):
        open_runtime("reference", plugins=fake.plugins(), options={"norm_flavour": "fancy"})


def test_a_value_the_option_does_not_allow_is_one_line(fake):
    with pytest.raises(BackendOptionError) as err:
        open_runtime("fake", plugins=fake.plugins(), options={"norm_flavour": "spicy"})
    assert str(err.value) == "backend 'fake' option norm_flavour='spicy' is not allowed; use one of: plain, fancy"


def test_the_environment_variable_is_the_options_default(fake, monkeypatch):
    monkeypatch.setenv("DEEPINFER_FAKE_NORM_FLAVOUR", "fancy")
    norm_once(open_runtime("fake", dtype=torch.float32, plugins=fake.plugins()))
    norm_once(open_runtime("fake", dtype=torch.float32, plugins=fake.plugins(), options={"norm_flavour": "plain"}))  # given wins
    assert fake.calls == ["fancy", "plain"]
    monkeypatch.setenv("DEEPINFER_FAKE_NORM_FLAVOUR", "spicy")
    with pytest.raises(BackendOptionError, match=r"norm_flavour='spicy' \(from DEEPINFER_FAKE_NORM_FLAVOUR\) is not allowed; use one of: plain, fancy"):
        open_runtime("fake", plugins=fake.plugins())


def test_a_forced_kernel_that_cannot_run_is_one_line_at_resolve(fake):
    with pytest.raises(RegistryError) as err:
        open_runtime("fake", plugins=fake.plugins(), options={"exotic": "on"})
    assert str(err.value) == f"backend 'fake' cannot serve op 'rms_norm': {UNUSABLE}"


def test_the_llm_keyword_reaches_the_kernel_choice(fake):
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    llm = LLM(backend="fake", backend_options={"norm_flavour": "fancy"}, announce=False, num_kv_blocks=64, enforce_eager=True)
    llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert fake.calls and set(fake.calls) == {"fancy"}
    # The model's facts reached the resolve context too (read from the checkpoint before resolving).
    config = llm.engine.loaded.config
    facts = llm.engine.runtime.ops.ctx.model
    assert (facts.num_experts, facts.top_k, facts.score_func, facts.num_heads, facts.kv_block_size) == (
        config.n_routed_experts, config.num_experts_per_tok, config.scoring_func, config.num_attention_heads, 16)


def test_the_run_flag_reaches_the_kernel_choice(fake, capsys):
    code = main(["run", "--backend", "fake", "--backend-option", "norm_flavour=fancy", "--prompt", "hi", "--max-tokens", "1",
                 "--num-kv-blocks", "64", "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert fake.calls and set(fake.calls) == {"fancy"}


@pytest.mark.parametrize(
    "flag, message",
    [
        ("norm_flavour", "--backend-option 'norm_flavour': expected KEY=VALUE"),
        ("norm_flavour=spicy", "option norm_flavour='spicy' is not allowed; use one of: plain, fancy"),
        ("colour=red", "backend 'fake' has no option 'colour'"),
    ],
)
def test_a_bad_run_flag_exits_2_with_one_line(fake, capsys, flag, message):
    code = main(["run", "--backend", "fake", "--backend-option", flag, "--prompt", "hi", "--max-tokens", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not fake.calls


def test_parse_assignments():
    assert parse_assignments(["a=1", " b = two "]) == {"a": "1", "b": "two"}
    assert parse_assignments(None) == {}
    for bad in (["a"], ["=1"], ["a="]):
        with pytest.raises(BackendOptionError, match="expected KEY=VALUE"):
            parse_assignments(bad)
    with pytest.raises(BackendOptionError, match="given twice"):
        parse_assignments(["a=1", "a=2"])


def test_a_capability_is_read_from_the_chosen_registration(fake):
    """No attribute on a function: the chosen kernel's registration declares it, the table exposes it."""
    ops = open_runtime("fake", dtype=torch.float32, plugins=fake.plugins()).ops
    kernel = ops.registration("dispatch")
    assert kernel.note == "capturable" and kernel.capturable_with_token_bound(2, 4, 8) and not kernel.capturable_with_token_bound(4, 4, 8)
    assert ops.registration("rms_norm").note == "plain" and ops.registration("gate").capturable_with_token_bound is None
    reference = open_runtime("reference", dtype=torch.float32, plugins=fake.plugins()).ops
    assert reference.registration("dispatch").capturable_with_token_bound is None


def test_the_cuda_backends_options_under_the_interpreter(monkeypatch):
    """ep_path=symm where symmetric memory cannot run (here: no GPU) is one line at resolve; ep_path
    and mxfp4_path choose the kernels; the interpreter gets no device graphs and no device memory."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("DEEPINFER_EP_PATH", raising=False)
    monkeypatch.delenv("DEEPINFER_CUDA_MXFP4_PATH", raising=False)
    plugins = Plugins()
    with pytest.raises(RegistryError) as err:
        open_runtime("cuda", interpret=True, ep_size=2, plugins=plugins, options={"ep_path": "symm"})
    message = str(err.value)
    assert "\n" not in message and message.startswith("backend 'cuda' cannot serve op 'combine': backend option ep_path=symm, but the symmetric-memory")
    runtime = open_runtime("cuda", interpret=True, ep_size=2, plugins=plugins, options={"mxfp4_path": "upcast"})
    assert "all_to_all_single" in runtime.ops.registration("dispatch").note  # auto: symmetric memory cannot run here
    assert runtime.ops.kernel("linear", "mxfp4").__qualname__ == "linear_mxfp4_upcast"
    assert runtime.ops.kernel("linear", "fp8_block") is runtime.ops.kernel("linear", "dense")  # the other formats: unchanged
    assert runtime.graph_capture is None and runtime.memory_info is None and plugins.backend("cuda").graph_capture is not None
    auto = open_runtime("cuda", interpret=True, plugins=plugins)
    assert auto.ops.kernel("linear", "mxfp4") is auto.ops.kernel("linear", "dense")  # auto: the default kernel, the machine's path
    monkeypatch.setenv("DEEPINFER_CUDA_MXFP4_PATH", "fast")
    with pytest.raises(BackendOptionError, match=r"mxfp4_path='fast' \(from DEEPINFER_CUDA_MXFP4_PATH\)"):
        open_runtime("cuda", interpret=True, plugins=plugins)
