"""Loading DeepSeek-V4.1 checkpoints: a tiny random one in the released layout validates and reads in its
stored formats (FP8 32x32 blocks, packed FP4 experts, FP8 Engram rows, e8m0 scales kept as bytes); each
broken tensor is one line; the loader builds the V4.1 model (never V4's), whose Engram needs the checkpoint's
tokenizer.json; `deepinfer run` generates on the reference backend."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.model.checkpoint import find_tensors
from deepinfer.model.deepseek_v41.checkpoint import QuantizedTensor, read_v41_tensors
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.load import validate_v41_folder
from deepinfer.model.errors import CheckpointError
from deepinfer.model.loader import load_model

from cli_helpers import run_cli, run_main
from model_v41.tiny_v41 import TINY_V41, VISION, random_v41_tensors, write_oracle_checkpoint, write_v41


@pytest.fixture(scope="module")
def tensors():
    return random_v41_tensors(seed=1)


@pytest.fixture(scope="module")
def release(tmp_path_factory, tensors):
    """The tiny checkpoint in two shards with an index, as the release ships it. Read-only."""
    return write_v41(tmp_path_factory.mktemp("v41") / "release", tensors)


def test_the_release_layout_validates_and_reads_in_its_stored_formats(release, tensors, caplog):
    config = V41Config.from_dict(TINY_V41)
    with caplog.at_level(logging.WARNING):
        specs, scales = validate_v41_folder(release, config)
    skipped = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(skipped) == 1 and f"skipped the vision tower's {len(VISION)} tensors" in skipped[0]  # one line for all of them
    weights = read_v41_tensors(find_tensors(release), specs, scales, torch.device("cpu"), torch.bfloat16)
    assert set(weights) == set(specs) and not any(name.startswith(("vision.", "aligner.", "image_")) for name in weights)
    wq_a = weights["layers.2.attn.wq_a.weight"]  # [48, 64]: the 48 rows end in a partial 32-row block
    assert isinstance(wq_a, QuantizedTensor) and wq_a.fmt == "fp8_block" and wq_a.block == (32, 32)
    assert wq_a.data.dtype == torch.float8_e4m3fn and wq_a.scale.dtype == torch.uint8 and tuple(wq_a.scale.shape) == (2, 2)
    stored = tensors["layers.2.attn.wq_a.weight"], tensors["layers.2.attn.wq_a.scale"]
    assert torch.equal(wq_a.data.view(torch.uint8), stored[0].view(torch.uint8)) and torch.equal(wq_a.scale, stored[1].view(torch.uint8))  # bytes as stored
    expert = weights["mtp.1.ffn.experts.3.w2.weight"]  # [64, 64] logical: packed [64, 32], e8m0 per 32
    assert expert.fmt == "fp4_expert" and expert.data.dtype == torch.uint8 and tuple(expert.data.shape) == (64, 32) and tuple(expert.scale.shape) == (64, 2)
    table = weights["layers.2.engram.embed.weight"]
    assert table.fmt == "fp8_rows" and tuple(table.data.shape) == (48, 32) and tuple(table.scale.shape) == (48, 1) and table.block == (1, 32)
    assert weights["layers.4.ffn.gate.bias"].dtype == torch.float32 and weights["layers.4.attn_norm.weight"].dtype == torch.bfloat16
    for s in range(3):  # the DSpark blocks are loaded, their heads on the first and last
        assert f"mtp.{s}.attn.wq_a.weight" in weights
    assert "mtp.0.main_proj.weight" in weights and weights["mtp.2.confidence_head.proj.weight"].shape == (1, 64 + 16)
    assert "layers.2.attn.compressor.wgate.weight" in weights and "layers.4.attn.compressor.wgate.weight" not in weights  # ratio 1: no gate


def test_load_model_builds_the_v41_model_and_needs_the_checkpoints_tokenizer_for_engram(release, tmp_path):
    from deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM

    missing = "has no tokenizer.json: DeepSeek-V4.1's Engram hashes token ids through the checkpoint's own tokenizer"
    with pytest.raises(CheckpointError, match=missing) as caught:
        load_model(str(release), None, "cpu", torch.float32)
    assert "\n" not in str(caught.value)
    loaded = load_model(str(write_oracle_checkpoint(tmp_path / "oracle")), None, "cpu", torch.float32, max_model_len=256)
    assert isinstance(loaded.model, DeepseekV41ForCausalLM) and loaded.tokenizer is not None  # never V4's model


def _held_bytes(obj, seen=None, storages=None) -> dict[int, tuple[int, torch.dtype]]:
    """Every tensor storage reachable from the model's attributes (deepinfer objects, lists, tuples, dicts), once."""
    seen = set() if seen is None else seen
    storages = {} if storages is None else storages
    if id(obj) in seen:
        return storages
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storages.setdefault(obj.untyped_storage().data_ptr(), (obj.untyped_storage().nbytes(), obj.dtype))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _held_bytes(v, seen, storages)
    elif isinstance(obj, dict):
        for v in obj.values():
            _held_bytes(v, seen, storages)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepinfer") and not isinstance(obj, type):
        for name, v in vars(obj).items():
            if name not in ("ops", "config"):
                _held_bytes(v, seen, storages)
    return storages


def test_the_fp8_projections_stay_fp8_and_the_memory_estimate_counts_their_bytes(tmp_path):
    """Every FP8 32x32-block projection the model runs is kept as stored ("fp8_block32": 1 byte a weight, an e8m0 byte
    a block), wo_a's groups as grouped-GEMM experts; the loader's memory estimate counts those bytes, not floats."""
    from deepinfer.model.deepseek_v41.load import estimate_v41_memory
    from deepinfer.model.deepseek_v41.tensors import FP8_BLOCK

    from model_v41.tiny_v41 import ORACLE_V41

    folder = write_oracle_checkpoint(tmp_path / "oracle")
    model = load_model(str(folder), None, "cpu", torch.bfloat16, max_model_len=256).model
    config = V41Config.from_dict(ORACLE_V41)
    layer = model.layers[2]  # a Full layer with Engram: every kind of FP8 projection
    attn, ffn = layer.attn, layer.ffn
    kept = [attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b, attn.indexer.wq_b, ffn.shared[0].parts[0], ffn.shared[1], layer.engram.wkv]
    assert all(w.fmt == "fp8_block32" and w.weight.dtype == torch.float8_e4m3fn and w.scale.dtype == torch.uint8 for w in kept)
    assert len(ffn.shared[0].parts) == 1  # w1 and w3 fused: whole 32-row blocks
    groups, rank = config.o_groups, config.o_lora_rank
    assert attn.wo_a.fmt == "fp8_block32" and tuple(attn.wo_a.weight.shape) == (groups, rank, attn.wo_a.weight.shape[-1])
    assert tuple(attn.wo_a.scale.shape) == (groups, rank // 32, -(-attn.wo_a.weight.shape[-1] // 32))

    held = _held_bytes(model)
    rope = sum(t.untyped_storage().nbytes() for pair in model.ropes.values() for t in pair)
    held_total = sum(n for n, _ in held.values()) - rope
    specs, scales = validate_v41_folder(folder, config)
    # every tensor, the DSpark blocks' included: the model keeps them for its drafter (dspark.py)
    fp8_weights = sum(s.shape[0] * s.shape[1] for s in specs.values() if s.kind == FP8_BLOCK)
    assert sum(n for n, dtype in held.values() if dtype == torch.float8_e4m3fn) == fp8_weights
    estimate = estimate_v41_memory(specs, find_tensors(folder), scales, torch.bfloat16, 256, config.qk_rope_head_dim)
    assert estimate.rope_table == rope
    # a floor: what it leaves out is the Engram token map (int64 per vocabulary id) and a few small tensors
    assert estimate.weights <= held_total <= estimate.weights + 8 * config.vocab_size + 64 * 1024


def test_an_fp8_grouped_weight_whose_groups_split_a_scale_block_is_decoded():
    from deepinfer.model.deepseek_v41.checkpoint import QuantizedTensor
    from deepinfer.model.deepseek_v41.weights import V41Weights
    from deepinfer.ops import quant

    w = torch.randn(96, 64)
    for rows, fmt in ((48, "dense"), (32, "fp8_block32")):  # 2 x 48 rows: a 32-row block straddles the groups
        q, scale = quant.quantize_weight_fp8_block32(w[: 2 * rows])
        weights = V41Weights({"wo_a.weight": QuantizedTensor(q, scale, "fp8_block", (32, 32))}, torch.float32)
        grouped = weights.grouped("wo_a", 2)
        assert grouped.fmt == fmt and tuple(grouped.weight.shape) == (2, rows, 64)
        decoded = quant.dequantize_weight_fp8_block32(q, scale, torch.float32).view(2, rows, 64)
        kept = grouped.weight.float() if fmt == "dense" else quant.dequantize_weight_fp8_block32(grouped.weight, grouped.scale, torch.float32)
        assert torch.equal(kept, decoded)


def _scale(tensors, name):
    return tensors[name.removesuffix(".weight") + ".scale"]


def _drop(*names):
    return lambda t: {n: v for n, v in t.items() if n not in names}


def _put(name, value):
    return lambda t: {**t, name: value(t) if callable(value) else value}


def _fill(name, byte):
    """`name` with every byte set to `byte` (0xFF: e8m0's NaN; 0x7F: e4m3's NaN), its dtype kept."""
    return _put(name, lambda t: t[name].view(torch.uint8).clone().fill_(byte).view(t[name].dtype))


BROKEN = [
    ("missing", _drop("layers.6.attn.indexer.wq_b.weight"), r"tensor layers.6.attn.indexer.wq_b.weight \(shape \[64, 48\]\) is missing"),
    ("missing DSpark head", _drop("mtp.2.markov_head.head.weight"), r"tensor mtp.2.markov_head.head.weight \(shape \[256, 16\]\) is missing"),
    ("missing scale", _drop("layers.0.attn.wo_b.scale"), r"layers.0.attn.wo_b.scale \(shape \[2, 2\]\) is missing for the quantised weight layers.0.attn.wo_b"),
    ("unexpected", _put("layers.0.attn.extra.weight", torch.zeros(2)), "unexpected tensor layers.0.attn.extra.weight"),
    ("compressor on a Reuse layer", _put("layers.3.attn.compressor.wkv.weight", torch.zeros(64, 64)), "unexpected tensor layers.3.attn.compressor.wkv"),
    ("gate on a ratio-1 compressor", _put("layers.4.attn.compressor.wgate.weight", torch.zeros(64, 64)), "unexpected tensor layers.4.attn.compressor.wgate"),
    ("engram off its layers", _put("layers.5.engram.q_weight", torch.zeros(4, 64)), "unexpected tensor layers.5.engram.q_weight"),
    ("shape", _put("layers.1.attn.kv_norm.weight", torch.zeros(63)), r"tensor layers.1.attn.kv_norm.weight has shape \[63\], config.json implies \[64\]"),
    ("engram rows", _put("layers.1.engram.embed.weight", lambda t: t["layers.1.engram.embed.weight"][:39]),
     r"tensor layers.1.engram.embed.weight has shape \[39, 32\], config.json implies \[40, 32\]"),
    ("packed expert shape", _put("layers.2.ffn.experts.0.w1.weight", torch.zeros(64, 64, dtype=torch.int8)),
     r"tensor layers.2.ffn.experts.0.w1.weight has shape \[64, 64\], config.json implies \[64, 32\]"),
    ("dtype", _put("layers.0.attn.q_norm.weight", torch.zeros(48, dtype=torch.int32)), "layers.0.attn.q_norm.weight has dtype I32, expected BF16/F16/F32"),
    ("expert as FP8", _put("layers.2.ffn.experts.1.w3.weight", torch.zeros(64, 64).to(torch.float8_e4m3fn)),
     r"tensor layers.2.ffn.experts.1.w3.weight has dtype F8_E4M3, expected packed FP4 in I8/U8 \(with an e8m0 .scale per 32 columns\) or BF16/F16/F32"),
    ("scale shape", _put("layers.0.attn.wq_a.scale", torch.zeros(1, 2, dtype=torch.uint8)),
     r"tensor layers.0.attn.wq_a.scale is U8 \[1, 2\], expected an e8m0 \(F8_E8M0 or U8\) scale of shape \[2, 2\]"),
    ("scale dtype", _put("layers.0.ffn.experts.2.w2.scale", torch.ones(64, 2)),
     r"tensor layers.0.ffn.experts.2.w2.scale is F32 \[64, 2\], expected an e8m0 \(F8_E8M0 or U8\) scale of shape \[64, 2\]"),
    ("e8m0 NaN", _fill("layers.7.attn.wo_a.scale", 0xFF), r"tensor layers.7.attn.wo_a.scale holds NaN or Inf values \(e8m0 scale bytes 0xFF\)"),
    ("FP8 NaN", _fill("layers.7.attn.wkv.weight", 0x7F), "tensor layers.7.attn.wkv.weight holds NaN or Inf values"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_a_broken_tensor_is_one_line_naming_it(tmp_path, tensors, change, message):
    folder = write_v41(tmp_path / "broken", change(tensors), shards=1)
    config = V41Config.from_dict(TINY_V41)
    with pytest.raises(CheckpointError, match=message) as caught:
        specs, scales = validate_v41_folder(folder, config)
        read_v41_tensors(find_tensors(folder), specs, scales, torch.device("cpu"), torch.float32)  # values: NaN / Inf
    assert "\n" not in str(caught.value)
    if "NaN" not in message:  # through the loader too: the header problem ends the load before the model is built
        with pytest.raises(CheckpointError, match=message):
            load_model(str(folder), None, "cpu", torch.float32)


def test_deepinfer_run_on_a_v41_folder_generates_and_refuses_expert_parallelism_in_one_line(tmp_path):
    folder = write_oracle_checkpoint(tmp_path / "oracle")
    done = run_cli("run", "--model", str(folder), "--backend", "reference", "--max-tokens", "3", "--max-model-len", "256", "--prompt", "a b c",
                   "--temperature", "0", "--no-swa-bounded-replay")  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused = run_main("run", "--model", str(folder), "--backend", "reference", "--ep", "2")
    assert refused.returncode == 2 and "expert parallelism (--ep, redundant experts) is not implemented for DeepSeek-V4.1 yet" in refused.stderr
    assert "Traceback" not in refused.stderr
