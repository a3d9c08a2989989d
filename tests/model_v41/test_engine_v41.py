"""DeepSeek-V4.1 through the engine on the reference backend, float32, every layer on every token
(swa_bounded_replay=False): greedy generation (prefill then decode steps over the per-owner state) gives the
tokens of one-shot full forwards and NeMo Automodel's (the oracle fixture); chunked prefill and a batch of
requests give the same. The bounded replay, on by default, is tested in test_bounded_replay_v41.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams

from model_v41.make_oracle_fixtures import FIXTURE, PROMPTS
from model_v41.test_oracle_v41 import full_forward
from model_v41.tiny_v41 import write_oracle_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle")


@pytest.fixture(scope="module")
def oracle():
    return load_file(str(FIXTURE))


def _prompts(oracle):
    """(prompt ids, NeMo's greedy continuation) per fixture prompt."""
    out = []
    for p in range(PROMPTS):
        ids = oracle[f"p{p}.ids"].tolist()
        new = oracle[f"p{p}.step_logits"].shape[0]
        out.append((ids[:-new], ids[-new:]))
    return out


def _generate(folder, prompts, **engine):
    llm = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, swa_bounded_replay=False, announce=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=len(prompts[0][1]), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 1}, {"max_num_seqs": 1}],
                         ids=["batched", "chunked_prefill_9_chunks_of_16_one_at_a_time", "one_at_a_time"])  # fmt: skip
def test_engine_greedy_tokens_equal_nemos_and_a_full_forwards(folder, oracle, engine):
    prompts = _prompts(oracle)
    assert _generate(folder, prompts, **engine) == [nemo for _, nemo in prompts]


def test_a_full_forwards_greedy_continuation_is_nemos(folder, oracle):
    """The reference one-shot path the engine is compared with: each token a full forward of everything before it."""
    from deepinfer.model.deepseek_v41.config import V41Config
    from deepinfer.model.deepseek_v41.load import load_v41
    from deepinfer.runtime import open_runtime

    from model_v41.tiny_v41 import ORACLE_V41

    model = load_v41(folder, V41Config.from_dict(ORACLE_V41), open_runtime("reference", dtype=torch.float32).ops, torch.device("cpu"), torch.float32, 256, None)
    prompt, nemo = _prompts(oracle)[0]
    ids = list(prompt)
    for _ in nemo:
        ids.append(int(full_forward(model, ids)[-1].argmax()))
    assert ids[len(prompt) :] == nemo

