"""The embedded tiny DeepSeek-V4.1 (`--model tiny-v41`): generated deterministically, small, every layer role of the
release, Engram and one DSpark block, stored as the release stores its tensors; it loads and generates on the
reference backend with the bounded replay on (the default), from the API and the command line."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors import safe_open

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.model import embedded
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.engram import hash_constants
from deepinfer.model.embedded_names import NAMES, check_model_path
from deepinfer.model.embedded_v41 import V41_CONFIG
from deepinfer.model.errors import LoadError

from cli_helpers import run_cli

CONFIG = V41Config.from_dict(V41_CONFIG)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(root))
        embedded.ensure_embedded(alias="tiny-v41")
        yield root


@pytest.fixture(scope="module")
def llm(cache):
    return LLM(model="tiny-v41", backend="reference", dtype="float32", max_num_seqs=4, announce=False)


def _digests(folder) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in embedded.FILES}


def test_generated_deterministically_small_and_in_the_released_storage(cache, tmp_path):
    first = embedded.embedded_folder(cache, "tiny-v41")
    again = embedded.ensure_embedded(tmp_path, alias="tiny-v41")
    assert _digests(again) == _digests(first)
    assert (first / "model.safetensors").stat().st_size < 80 * 2**20  # the embedded models' bound (tiny-v3's test)
    with safe_open(str(first / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.2.attn.wq_a.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.2.ffn.experts.0.w1.weight").dtype == torch.int8  # FP4 packed two per byte
        assert f.get_tensor("layers.1.engram.embed.weight").dtype == torch.float8_e4m3fn
    assert {"mtp.0.main_proj.weight", "mtp.0.markov_head.embed.weight", "mtp.0.confidence_head.proj.weight"} <= names
    assert not any(n.startswith("mtp.1.") for n in names)


def test_every_layer_role_engram_and_one_dspark_block():
    roles = [(r.kind, r.ratio, r.kv_source, r.topk_owner, r.candidate_filtered, r.engram) for r in CONFIG.roles]
    assert roles == [
        ("swa", 0, None, None, False, None), ("swa", 0, None, None, False, 0),
        ("full", 2, 2, 2, False, None), ("reuse", 2, 2, 2, False, None), ("full", 2, 4, 4, False, 1),
        ("full", 1, 5, 5, False, None), ("reuse", 1, 5, 5, False, None), ("reindex", 1, 5, 7, True, None),
        ("reuse", 1, 5, 7, False, None), ("reuse", 1, 5, 7, False, None),
    ]  # fmt: skip
    assert CONFIG.candidate_source_layer_id == 5 and CONFIG.num_nextn_predict_layers == 1
    # each Engram table holds exactly the rows its hash primes address
    assert [int(primes.sum()) for _, primes, _ in hash_constants(CONFIG, CONFIG.engram_compressed_vocab_size)] == list(CONFIG.engram_num_embeddings)


def test_it_is_listed_with_the_embedded_models():
    assert "tiny-v41" in NAMES and "tiny-v41" in embedded.EMBEDDED
    with pytest.raises(LoadError, match=r"an embedded model: tiny-v3, tiny-v4, tiny-v41"):
        check_model_path("tiny-v2")


def test_loads_and_generates_with_the_bounded_replay_on(llm):
    assert llm.dummy_weights and llm.engine.loaded.config.model_type == "deepseek_v41"
    model = llm.engine.loaded.model
    assert model.swa_bounded_replay and model.decoder_start == 6 and model.decoder_replay_start(300) == 300 - 133
    prompts = [{"prompt_token_ids": torch.randint(3, 129000, (n,), generator=torch.Generator().manual_seed(n)).tolist()} for n in (300, 40)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 4 for t in first)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == first


def test_run_on_the_command_line(cache):
    done = run_cli("run", "--model", "tiny-v41", "--backend", "reference", "--prompt", "Hello world", "--max-tokens", "3", "--temperature", "0",
                   env={**os.environ, "DEEPINFER_CACHE": str(cache)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "completion" in done.stdout and "dummy weights" in done.stdout + done.stderr
