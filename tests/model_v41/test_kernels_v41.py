"""DeepSeek-V4.1 through the cuda and ascend backends' Triton kernels (the Triton interpreter on the CPU, the
Ascend backend on a simulated 910B): the tiny oracle checkpoint's logits and greedy tokens equal NVIDIA NeMo
Automodel's (the oracle fixture), as test_oracle_v41.py and test_engine_v41.py check for the reference backend.
One prompt each, to stay fast: a full forward (every row's logits; the last 8 rows are NeMo's greedy steps,
teacher-forced), and the engine's prefill and first decode step; and on cuda one prefix hit (paged history and a
state snapshot reused) against the reference backend's tokens without the prefix cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from model_v41.make_oracle_fixtures import FIXTURE, SEED
from model_v41.test_oracle_v41 import TOLERANCE, full_forward
from model_v41.tiny_v41 import ORACLE_V41, write_oracle_checkpoint
from triton_mode import require_interpreter

BACKENDS = ("cuda", "ascend")
SIM_CHIP = "910B"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle", seed=SEED)


@pytest.fixture(scope="module")
def oracle():
    return load_file(str(FIXTURE))


@pytest.fixture
def simulated_910b(monkeypatch):
    """The ascend backend's simulated chip for this test, whatever an earlier test in the process simulated."""
    from deepinfer_ascend import device

    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", SIM_CHIP)
    monkeypatch.setattr(device, "_simulated", None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_forward_through_the_kernels_equals_nemos_logits_and_greedy_tokens(backend, folder, oracle, simulated_910b):
    from deepinfer.model.deepseek_v41.config import V41Config
    from deepinfer.model.deepseek_v41.load import load_v41
    from deepinfer.runtime import open_runtime

    require_interpreter()
    runtime = open_runtime(backend, interpret=True, dtype=torch.float32, options={"sim_chip": SIM_CHIP} if backend == "ascend" else None)
    model = load_v41(folder, V41Config.from_dict(ORACLE_V41), runtime.ops, torch.device("cpu"), torch.float32, 256, None)
    expected = oracle["p0.full_logits"]
    logits = full_forward(model, oracle["p0.ids"].tolist())[-expected.shape[0] :]
    assert (logits - expected).abs().max() < TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_prefill_and_decode_through_the_kernels_give_nemos_tokens(backend, folder, oracle, simulated_910b):
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    require_interpreter()
    ids = oracle["p0.ids"].tolist()
    new = oracle["p0.step_logits"].shape[0]
    prompt, nemo = ids[:-new], ids[-new:]
    llm = LLM(model=str(folder), backend=backend, interpret=True, dtype="float32", max_model_len=256, swa_bounded_replay=False, announce=False)
    assert llm.backend == backend
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # a prefill step and a decode step
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == nemo[:2]


def test_a_prefix_hit_through_the_cuda_kernels_gives_the_reference_tokens(folder):
    """A 64-token prompt files the state snapshot at its end (the cuda backend's first block boundary); a 68-token
    prompt extending it reuses that block's paged history and the snapshot, computes 4 tokens and decodes one, and
    gives the reference backend's tokens without prefix caching (every layer on every token; cuda under the interpreter)."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    require_interpreter()
    gen = torch.Generator().manual_seed(64)
    first = torch.randint(3, 256, (64,), generator=gen).tolist()
    extended = first + torch.randint(3, 256, (4,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    common = dict(model=str(folder), dtype="float32", max_model_len=128, swa_bounded_replay=False, announce=False)
    llm = LLM(backend="cuda", interpret=True, **common)
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": extended}], params, use_tqdm=False)[0]
    plain = LLM(backend="reference", enable_prefix_caching=False, **common).generate([{"prompt_token_ids": extended}], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64 and llm.engine.num_prompt_tokens_computed == 64 + 4
    assert list(hit.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
