"""DeepSeek-V4.1's forward on the reference backend against NVIDIA NeMo Automodel 0.7.0's V4.1 code (the oracle).

The fixture (make_oracle_fixtures.py, run by hand where NeMo is installed) holds NeMo's float32 eager logits on
the tiny oracle checkpoint (tiny_v41.ORACLE_V41: every layer role, candidate blocks that bind, Engram, 8 index
heads) for prompts robust to float noise, with their greedy continuations. The checkpoint is rebuilt here from the
same seed, in the released storage (FP8 32x32, packed FP4 experts, FP8 Engram rows)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.engram_tokens import compressed_token_map
from deepinfer.model.deepseek_v41.load import load_v41
from deepinfer.model.forward_batch import ForwardBatch, HostBatch
from deepinfer.runtime import open_runtime

from model_v41.make_oracle_fixtures import FIXTURE, PROMPTS, SEED
from model_v41.tiny_v41 import ORACLE_COMPRESSED_VOCAB, ORACLE_V41, tiny_tokenizer_json, write_oracle_checkpoint

TOLERANCE = 1e-2  # v41.md section 12: float noise can cross an FP8/FP4 boundary; greedy tokens must agree exactly


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle", seed=SEED)
    ops = open_runtime("reference", dtype=torch.float32).ops
    return load_v41(folder, V41Config.from_dict(ORACLE_V41), ops, torch.device("cpu"), torch.float32, 256, None)


@pytest.fixture(scope="module")
def oracle():
    return load_file(str(FIXTURE))


BLOCK, BLOCKS = 16, 16  # one sequence's caches (`one_sequence_caches`): blocks 0 .. 15 in order, 256 positions


def one_sequence_caches(model, dtype: torch.dtype = torch.float32):
    """Caches for one sequence in state slot 0, its history in blocks 0, 1, ... (`prefill_batch`'s block table)."""
    return model.new_caches(BLOCKS, BLOCK, 1, dtype)


def prefill_batch(ids: list[int]) -> ForwardBatch:
    """One sequence's whole prompt in one step, state slot 0, blocks 0, 1, ..., every row's logits."""
    n = len(ids)
    host = HostBatch(starts=[0], lengths=[n], cached=[0], slots=[0], pages=[list(range(BLOCKS))])
    return ForwardBatch(
        is_prefill=True, input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.zeros(n, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(BLOCKS, dtype=torch.int32)[None], logits_indices=torch.arange(n), max_query_len=n, max_seq_len=n,
        host=host, state_slots=torch.zeros(1, dtype=torch.int32),
    )  # fmt: skip


def full_forward(model, ids: list[int]) -> torch.Tensor:
    return model.forward(prefill_batch(ids), one_sequence_caches(model))


def test_the_tiny_tokenizer_compresses_to_the_configured_engram_vocabulary():
    _, count = compressed_token_map(Tokenizer.from_str(tiny_tokenizer_json()), 256)
    assert count == ORACLE_COMPRESSED_VOCAB == ORACLE_V41["text_config"]["engram_compressed_vocab_size"]


@pytest.mark.parametrize("prompt", range(PROMPTS))
def test_full_forward_logits_and_greedy_tokens_equal_nemos(model, oracle, prompt):
    ids = oracle[f"p{prompt}.ids"].tolist()
    steps = oracle[f"p{prompt}.step_logits"]
    start = len(ids) - steps.shape[0]  # the prompt's length: NeMo's greedy tokens follow
    logits = full_forward(model, ids)
    expected = oracle[f"p{prompt}.full_logits"]
    assert (logits[-expected.shape[0] :] - expected).abs().max() < TOLERANCE
    assert torch.equal(logits[-expected.shape[0] :].argmax(-1), expected.argmax(-1))
    # each greedy step, as NeMo took it: a full forward of the prompt and the tokens so far
    for k in range(steps.shape[0]):
        last = full_forward(model, ids[: start + k])[-1]
        assert (last - steps[k]).abs().max() < TOLERANCE
        assert int(last.argmax()) == ids[start + k]
