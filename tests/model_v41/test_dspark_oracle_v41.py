"""DeepSeek-V4.1's DSpark drafter on the reference backend against NVIDIA NeMo Automodel 0.7.0's `dspark.py` (the
oracle, make_dspark_fixtures.py): on the tiny oracle checkpoint's three draft blocks, from deepinfer's own target
features, each drafted slot's logits (head + Markov bias) within 1e-2 of NeMo's, the same greedy drafts, and
the confidence head's output on NeMo's input (the normed state) and on the release's (the pre-norm state)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.model.deepseek_v41.dspark import NORMED, RESIDUAL

from model_v41.make_dspark_fixtures import ANCHORS, FIXTURE
from model_v41.test_oracle_v41 import model, one_sequence_caches, prefill_batch  # noqa: F401  (the module's fixture)

TOLERANCE = 1e-2  # as the target's oracle test: float noise can cross an FP8/FP4 rounding boundary


@pytest.fixture(scope="module")
def oracle():
    return load_file(str(FIXTURE))


def draft_at(model, ids: list[int], confidence_input: str):  # noqa: F811
    """deepinfer's block at anchor len(ids) - 1: target features of the context, then the drafter."""
    anchor = len(ids) - 1
    ops = model.ops
    _, features = model.forward(prefill_batch(ids[:anchor]), one_sequence_caches(model), hidden_states=True)
    dspark = model.build_dspark(confidence_input)
    window = dspark.window
    positions = torch.arange(anchor - window, anchor)
    visible = positions >= 0
    keys = torch.zeros(len(dspark.stages), window, model.config.head_dim)
    keys[:, visible] = dspark.context_kv(ops, features[positions[visible]], positions[visible])
    anchors = torch.tensor([ids[anchor]])
    h = dspark.hidden(ops, anchors, torch.tensor([anchor]), keys[:, None], visible[None])
    tokens, confidences, logits = dspark.draft(ops, h, anchors)
    return tokens[0], confidences[0], logits[0]


@pytest.mark.parametrize("i", range(len(ANCHORS)))
def test_draft_logits_and_tokens_equal_nemos(model, oracle, i):  # noqa: F811
    ids = oracle[f"a{i}.ids"].tolist()
    tokens, confidences, logits = draft_at(model, ids, NORMED)
    assert (logits - oracle[f"a{i}.logits"]).abs().max() < TOLERANCE
    assert tokens.tolist() == oracle[f"a{i}.tokens"].tolist()
    assert (confidences - torch.sigmoid(oracle[f"a{i}.confidence_normed"])).abs().max() < TOLERANCE


@pytest.mark.parametrize("i", range(len(ANCHORS)))
def test_the_release_confidence_reads_the_pre_norm_state(model, oracle, i):  # noqa: F811
    ids = oracle[f"a{i}.ids"].tolist()
    tokens, confidences, _ = draft_at(model, ids, RESIDUAL)
    assert tokens.tolist() == oracle[f"a{i}.tokens"].tolist()
    assert (confidences - torch.sigmoid(oracle[f"a{i}.confidence_residual"])).abs().max() < TOLERANCE
