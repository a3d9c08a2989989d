"""End-to-end benchmark of a random DeepSeek-V4-Flash-shaped model (`deepinfer bench e2e --model-shape v4-flash`):
decode steps against their memory floor, and chunked prefills against their compute floor.

The model is deepinfer's own `DeepseekV4ForCausalLM`, filled through the V4 loader's store
(`V4Weights`) with random weights drawn on the device in DeepSeek's release formats: dense
projections fp8_block, routed experts mxfp4 (deepinfer/bench/v4_weights.py says which and how).
V4-Flash: hidden 4096, 64 heads of 512 (rope 64) over one shared KV head, window 128, CSA ratio 4
with a top-512 indexer (64 heads of 128), HCA ratio 128, hc_mult 4, 256 experts top-6 of width
2048 plus one shared expert, vocabulary 129280, 43 layers (2 sliding-only, then CSA / HCA
alternating, the last CSA). No transformers peer: the model is too large for it.

Layers: before anything is built the memory the run needs (weights, the transient copies of one
layer's experts while they are stacked, the bandwidth and matmul tests, activation headroom, and
the larger of the two engines the run builds one after the other: the decode rows' KV cache for the
largest batch x context and its state slots, or the prefill rows' KV cache, state slots and the
activations of their largest step, `prefill_activation_bytes`) is checked against the device's
free memory; the model keeps its first N layers, N the most that fit (or --layers, refused in one
line when it does not fit). Every figure, the floors included, is for those N layers.

Decode contexts: prefilling batch x context tokens (256 x 32k) would take far longer than the decode it
measures, and V4's paged caches keep every token's window row; so each request starts at its
cache length instead: its prompt of `context` random tokens is admitted with the first context - 1
counted as computed (what a prefix-cache hit does, minus the hit: `admit_at_cache_length`), the
caches hold random values, and one step computes the last prompt token. The decode steps that
follow read as much cache as a real run at that length. `warmup` decode steps run untimed, then
`steps` decode steps are timed one after the other by stepping the engine (scheduling, the step's
plan, the forward and sampling: the whole step), replaying device graphs where the backend has them
(`enforce_eager`: every step eagerly).

Floor (`floor_parts`): the bytes one decode step must read, over the copy bandwidth measured in the
same run: every weight the step touches once (the dense weights; the routed experts hit at that
batch, E(1 - (1 - k/E)^batch) expected distinct experts of E for batch x k random picks; the
embedding rows and hash-table rows of the batch's tokens) plus each sequence's cache reads at the
timed steps' middle position p: the window's min(128, p+1) rows in every layer; in CSA layers the
indexer's keys of every complete window ((p+1)//4) and the min(512, (p+1)//4) selected entries; in
HCA layers every complete entry ((p+1)//128). A cache row counts its bytes in the cache's format
(fp8: W values and the row's 16-byte tail, its scale and padding; bf16: 2W). Left out (a lower bound): writes,
activations, the compressors' per-sequence window state and the host work.

Prefill rows (`prefills`: (prompts, tokens) pairs, default 8 x 8192 and 1 x 65536): on an engine of
their own, built once the decode rows' engine is dropped (its max_model_len the longest prompt's,
so the decode rows keep theirs; max_num_batched_tokens `prefill_chunk`, default the engine's on the device (16384 on
an accelerator with at least 70 GiB, else 8192: deepinfer/engine/step_budget.py); prefix caching
off; no device graphs, as no decode step runs), each row's random prompts are prefilled from position
0 as a user's would be: the scheduler splits them into steps of at most max_num_batched_tokens tokens
(chunked prefill through the same ops the engine always runs; nothing starts at a cache length), and
each samples one token, which finishes it. One untimed pass of the row first (compiles, autotunes),
then PREFILL_PASSES timed passes, their median: seconds from the first step to the last, prompt tokens per second, and the
compute floor: the FLOPs of the row by part (deepinfer/bench/v4_prefill_floor.py: projections,
experts hit, compressor pooling, indexer scoring, attention over the rows and entries read) each over
the matmul rate of its format, bf16 or fp8, measured in the same run (`e2e.matmul_rates`; the routed
experts, mxfp4 with bf16 activations, at the bf16 rate; v4_prefill_floor.py says which part takes
which and why).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from deepinfer.bench.device_api import device_name, synchronize
from deepinfer.bench.e2e import MATMUL_HOW, GiB, copy_bandwidth, free_memory
from deepinfer.errors import UserError

V4_FLASH = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "num_hash_layers": 3,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
FULL_LAYERS = V4_FLASH["num_hidden_layers"]
WARMUP_STEPS = 2  # untimed decode steps before the timed ones
PREFILL_PASSES = 3  # timed passes of a prefill row (their median is its figure)
ACTIVATIONS_GIB = 2.0  # headroom for a decode step's activations, logits and the allocator's slack
ACTIVATIONS_SLACK = 1.5  # a prefill step's estimated activations times this: the allocator's fragmentation
DEFAULT_PREFILLS = ((8, 8192), (1, 65536))  # (prompts, tokens each) of the prefill rows
SEED = 0


def flash_config(layers: int | None = None, overrides: dict | None = None):
    """The V4Config of the V4-Flash shape (with `overrides`), cut to its first `layers` layers."""
    from deepinfer.model.deepseek_v4.config import V4Config

    raw = {**V4_FLASH, **(overrides or {})}
    if layers is not None:
        raw["num_hidden_layers"] = layers
    return V4Config.from_dict(raw, source="the V4-Flash shape")


def model_len(contexts, steps: int, warmup: int = WARMUP_STEPS) -> int:
    """Positions the run needs: the longest context, the step of its last prompt token, the decode
    steps and one spare token (its KV blocks count `model_len - 1` tokens per sequence)."""
    return max(contexts) + warmup + steps + 3


def distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts among `batch` tokens, each picking top_k distinct experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


# ---------------------------------------------------------------------------------------------
# Floor and memory


def floor_parts(config, batch: int, position: int, kv_dtype: torch.dtype, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes one decode step at `position` must read (module docstring): "dense weights" (every weight
    but the routed experts, the embedding rows of the batch and the hash table rows it looks up),
    "routed experts" (the expected distinct experts per MoE layer) and "KV" (every sequence's cache
    reads, rows in the format of a `kv_dtype` cache: W + 16 bytes in fp8, 2W in bf16)."""
    from deepinfer.bench.v4_weights import kept_bytes
    from deepinfer.model.deepseek_v4.config import CSA, HCA
    from deepinfer.model.deepseek_v4.model import model_tensor_specs
    from deepinfer.model.deepseek_v4.moe import EXPERT, INDEX
    from deepinfer.ops.kv_cache_format import row_width

    c = config
    dense = routed = 0.0
    touched = distinct_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
    for name, spec in model_tensor_specs(c).items():
        if name == "embed.weight":
            dense += batch * c.hidden_size * dtype_bytes
        elif spec.kind == INDEX:
            dense += batch * c.num_experts_per_tok * 8
        elif spec.kind == EXPERT:
            routed += kept_bytes(name, spec, dtype_bytes) * touched / c.n_routed_experts
        else:
            dense += kept_bytes(name, spec, dtype_bytes)
    size = torch.empty((), dtype=kv_dtype).element_size()
    row, key = row_width(c.head_dim, kv_dtype) * size, row_width(c.index_head_dim, kv_dtype) * size  # bytes of a KV row, an indexer key
    per_seq = 0
    for layer in range(c.num_hidden_layers):
        kind, ratio = c.layer_types[layer], c.compress_ratio(layer)
        per_seq += min(c.sliding_window, position + 1) * row
        visible = (position + 1) // ratio if ratio else 0
        if kind == CSA:
            per_seq += visible * key + min(c.index_topk, visible) * row
        elif kind == HCA:
            per_seq += visible * row
    return {"dense weights": dense, "routed experts": routed, "KV": float(batch * per_seq)}


def kv_blocks(batches, contexts, tokens_after: int, block_size: int) -> int:
    """KV blocks the largest (batch, context) pair holds at its last step (context + tokens_after tokens each)."""
    return max(b * -(-(ctx + tokens_after) // block_size) for b in batches for ctx in contexts)


def prefill_blocks(prefills, block_size: int) -> int:
    """KV blocks the largest prefill row holds: each of its prompts' tokens and the one token it samples."""
    return max(b * -(-(length + 1) // block_size) for b, length in prefills)


def prefill_activation_bytes(config, tokens: int, longest: int, dtype_bytes: int = 2) -> float:
    """Bytes a prefill step of `tokens` tokens holds at its peak beside the caches: an estimate from the
    model's widths, times ACTIVATIONS_SLACK (the allocator's). Per token: the residual streams (the
    layer's input, hc_post's output and the block's mix: 3 x hc_mult x hidden) beside the larger of the
    attention block's temporaries and the MoE's. Attention: up to 4 tensors of heads x head_dim live
    at once (q projected, normed, rotated; the output, rotated back, regrouped); each compressor's
    float32 projections and their reordered sources (4 x 2 widths of float32); the indexer's queries
    (3 copies) and its float32 scores over every entry of the `longest` prompt (twice: top-k's
    threshold pass); the window's row ids and an HCA layer's visible entries (int32). MoE: each
    token's top-k rows dispatched, through gate/up, the activation and down, and the shared expert's.
    A device backend's kernels need nothing per token beyond these (the reference backend's gathers
    do: its [T, rows, D] copies are the CPU's)."""
    from deepinfer.model.deepseek_v4.config import CSA

    c = config
    ratios = c.ratios
    streams = 3 * c.hc_mult * c.hidden_size * dtype_bytes
    attention = 4 * c.num_attention_heads * c.head_dim * dtype_bytes + 4 * 4 * (c.head_dim + c.index_head_dim) * 4
    if CSA in c.layer_types:
        csa_ratio = min(c.compress_ratio(i) for i in range(c.num_hidden_layers) if c.layer_types[i] == CSA)
        attention += 3 * c.index_n_heads * c.index_head_dim * dtype_bytes + 2 * (longest // csa_ratio) * 4
    attention += (c.sliding_window + (longest // max(ratios) if ratios else 0)) * 4
    shared = c.hidden_size + 3 * c.moe_intermediate_size * c.n_shared_experts
    moe = (c.num_experts_per_tok * (2 * c.hidden_size + 3 * c.moe_intermediate_size) + shared) * dtype_bytes
    return float(tokens * (streams + max(attention, moe)) * ACTIVATIONS_SLACK)


@dataclass(frozen=True)
class EnginePlan:
    """What one engine of a run holds beside the model, for the memory check."""

    num_blocks: int  # KV blocks
    max_seqs: int  # state slots
    prefill_tokens: int = 0  # the largest prefill step's tokens (0: decode steps only, which ACTIVATIONS_GIB covers)
    longest: int = 0  # the longest prompt: the indexer scores every one of its entries


def memory_parts(config, engines: list[EnginePlan], block_size: int, kv_dtype: torch.dtype, dtype: torch.dtype, copy_gib: float = 0.0,
                 matmul_n: int = 0) -> dict[str, float]:  # fmt: skip
    """Bytes the run holds at once on the device, by part: the weights as kept; one MoE layer's routed
    experts twice more while the model stacks them (the drawn experts, then gate and up stacked
    before they are fused); of the `engines`, which run one after the other (each dropped before the
    next is built), the one that holds most: its KV cache blocks and state slots ("KV cache") and its
    prefill step's activations ("prefill activations", `prefill_activation_bytes`); the bandwidth
    test's two buffers; the matmul test's bf16 and fp8 operands and output (`matmul_rates`, side
    `matmul_n`); ACTIVATIONS_GIB of headroom. Parts of 0 bytes are left out."""
    from deepinfer.bench.v4_weights import kept_bytes
    from deepinfer.model.deepseek_v4 import caches
    from deepinfer.model.deepseek_v4.model import model_tensor_specs
    from deepinfer.model.deepseek_v4.moe import EXPERT

    size = torch.empty((), dtype=dtype).element_size()
    weights = experts = 0
    for name, spec in model_tensor_specs(config).items():
        kept = kept_bytes(name, spec, size)
        weights += kept
        if spec.kind == EXPERT and name.startswith("layers.0."):
            experts += kept
    block, slot = caches.block_bytes(config, block_size, kv_dtype), caches.slot_bytes(config)

    def held(engine: EnginePlan) -> tuple[float, float]:
        activations = prefill_activation_bytes(config, engine.prefill_tokens, engine.longest, size) if engine.prefill_tokens else 0.0
        return float(engine.num_blocks * block + engine.max_seqs * slot), activations

    kv, activations = max((held(e) for e in engines), key=sum, default=(0.0, 0.0))
    parts = {
        "weights": float(weights),
        "expert stacking": 2.0 * experts,
        "KV cache": kv,
        "prefill activations": activations,
        "bandwidth test": 2 * copy_gib * GiB,
        "matmul test": float(10 * matmul_n**2),  # bf16 a, b and out (2 bytes each); a and b in fp8; the fp8 product's bf16 output
        "activations": ACTIVATIONS_GIB * GiB,
    }
    return {name: value for name, value in parts.items() if value}


def choose_layers(plan: Callable[[int], dict[str, float]], free: int | None, layers: int | None, device: torch.device, most: int = FULL_LAYERS,
                  command: str = "bench e2e --model-shape v4-flash", lower: str = "--batch / --context / --prefill") -> int:  # fmt: skip
    """`layers` when given and it fits, else the most layers (<= `most`) whose `plan(n)` fits `free`
    bytes (all of them when free memory cannot be told). One UserError line when none fits, naming
    `command` and the flags that `lower` the need."""
    if layers is not None:
        _check(plan(layers), free, device, command, f"the {layers}-layer model; cut it further with --layers, or lower {lower}")
        return layers
    if free is None:
        return most
    low, high = 0, most  # plan(n) grows with n: the largest n that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if sum(plan(mid).values()) <= free:
            low = mid
        else:
            high = mid - 1
    if low == 0:
        _check(plan(1), free, device, command, f"even one layer; lower {lower}, or run on a device with more memory")
    return low


def _check(parts: dict[str, float], free: int | None, device: torch.device, command: str, what: str) -> None:
    need = sum(parts.values())
    if free is None or need <= free:
        return
    detail = ", ".join(f"{name} {value / GiB:.1f}" for name, value in parts.items())
    raise UserError(f"{command} needs at least {need / GiB:.1f} GiB on {device} ({detail}) and {free / GiB:.1f} GiB is free for {what}")


# ---------------------------------------------------------------------------------------------
# Starting at a cache length


def admit_at_cache_length(engine, prompt: list[int], params):
    """Queue a request and admit it at once with its first len(prompt) - 1 tokens counted as computed:
    pages for all its tokens and a state slot, as the scheduler admits a prefix-cache hit of that
    length (minus the replay), so the next step computes only its last prompt token. The cache
    rows of the skipped tokens hold whatever the cache holds. Prefix caching must be off (the
    skipped blocks were never computed and must never be registered)."""
    from deepinfer.engine.sequence import SequenceStatus

    if engine.block_manager.enable_prefix_caching:
        raise ValueError("admit_at_cache_length needs an engine without prefix caching")
    seq = engine.add_request(prompt, params)
    scheduler = engine.scheduler
    if not engine.block_manager.can_allocate(seq) or len(scheduler.running) >= scheduler.max_num_seqs:
        raise RuntimeError(f"no room to admit a request of {len(prompt)} tokens (KV blocks or sequences)")
    scheduler.waiting.remove(seq)
    engine.block_manager.allocate(seq)
    seq.num_computed_tokens = seq.num_cached_kv = seq.num_cached_tokens = len(prompt) - 1
    seq.prefill_target = seq.num_tokens
    seq.status = SequenceStatus.RUNNING
    bisect.insort(scheduler.running, seq, key=lambda s: s.seq_id)
    return seq


def fill_random(obj, generator: torch.Generator, chunk: int = 1 << 26) -> None:
    """Fill every floating tensor in `obj` (a tensor, or dataclasses / lists / tuples / dicts of them:
    the model's caches) with N(0, 1) values; an FP8 cache's rows get N(0, 1) values quantised with
    their scales (deepinfer.ops.kv_cache_format), `chunk` elements at a time. Integer tensors are
    left as they are."""
    from deepinfer.ops import kv_cache_format

    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return
        if not kv_cache_format.is_fp8(obj):
            obj.normal_(generator=generator)
            return
        rows = obj.view(-1, obj.shape[-1])
        width = kv_cache_format.value_width(obj)
        step = max(1, chunk // obj.shape[-1])
        for lo in range(0, rows.shape[0], step):
            hi = min(lo + step, rows.shape[0])
            rows[lo:hi] = kv_cache_format.quantize_rows(torch.randn(hi - lo, width, generator=generator, device=obj.device))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            fill_random(item, generator, chunk)
    elif isinstance(obj, dict):
        for item in obj.values():
            fill_random(item, generator, chunk)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            fill_random(getattr(obj, f.name), generator, chunk)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class V4Result:
    batch: int
    context: int
    steps: int
    step_ms: float
    floor_ms: float
    floor_bytes: float
    tok_s: float
    plan_ms: float  # of step_ms: the plan of one such decode step as the model builds it (decode_plan, on the device), timed apart
    floor_parts: dict[str, float] = field(default_factory=dict)
    profile: dict | None = None  # `--profile`: time per decode step by kernel (deepinfer/bench/step_profile.py)


def plan_ms(engine, device: torch.device) -> float:
    """Milliseconds of the plan of a decode step of the running sequences as the model builds it (decode_plan: tensor
    arithmetic on the device, inside the step's graph when graphs replay), from the step's inputs on the device."""
    runner, seqs = engine.runner, list(engine.scheduler.running)
    batch = runner.rows_batch(seqs, [s.num_computed_tokens for s in seqs], [[s.token_ids[-1]] for s in seqs], last_only=True)
    synchronize(device)
    start = time.perf_counter()
    runner.model.step_plan(runner.model.config, batch, runner.kv_caches)
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


@dataclass
class V4PrefillResult:
    batch: int  # prompts
    prompt_len: int  # tokens each
    chunk_tokens: int  # the engine's max_num_batched_tokens
    steps: int  # engine steps of the timed pass
    seconds: float
    tok_s: float  # prompt tokens per second
    floor_s: float  # compute floor: each part's FLOPs over its format's matmul rate (v4_prefill_floor.py)
    of_floor: float  # floor_s / seconds
    floor_flops: float
    flops: dict[str, float] = field(default_factory=dict)  # by part
    rates: dict[str, str] = field(default_factory=dict)  # part -> the rate it is divided by ("fp8" / "bf16")
    profile: dict | None = None  # `--profile`: one more pass of the row by kernel (deepinfer/bench/step_profile.py)
    pass_seconds: list[float] = field(default_factory=list)  # every timed pass; `seconds` is their median


def build_model(config, runtime, dtype: torch.dtype, max_positions: int):
    """The random V4-Flash-shaped model of `config` on the runtime's device (v4_weights.RandomV4Weights, seed SEED), as a LoadedModel."""
    from deepinfer.bench.v4_weights import RandomV4Weights
    from deepinfer.model.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.model.loader import LoadedModel

    model = DeepseekV4ForCausalLM(config, runtime.ops, runtime.device, dtype, max_positions=max_positions)
    model.load_weights(RandomV4Weights(config, runtime.device, dtype, seed=SEED))
    path = f"in-memory DeepSeek-V4-Flash-shaped model ({config.num_hidden_layers} layers)"
    return LoadedModel(model=model, config=config, tokenizer=None, path=path, dummy_weights=True)


def layer_kinds(config) -> dict[str, int]:
    """Layers by type, short names in layer order: {"sliding": 2, "CSA": 3, ...}."""
    from deepinfer.model.deepseek_v4.config import CSA, HCA, SLIDING

    short = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}
    return {short[kind]: config.layer_types.count(kind) for kind in dict.fromkeys(config.layer_types)}


def prefill_pass(engine, batch: int, prompt_len: int, tokens: torch.Generator, device: torch.device) -> tuple[float, int, int]:
    """Prefill `batch` random prompts of `prompt_len` tokens from position 0, one token sampled each (then
    they finish), by stepping the engine until they have: (seconds, engine steps, prompt tokens computed)."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=tokens).tolist(), params)
    steps, computed = engine.num_steps, engine.num_prompt_tokens_computed
    synchronize(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    synchronize(device)
    return time.perf_counter() - start, engine.num_steps - steps, engine.num_prompt_tokens_computed - computed


def run(
    backend: str = "auto",
    batches=(1, 64, 256),
    contexts=(4096, 32768),
    steps: int = 16,
    warmup: int = WARMUP_STEPS,
    layers: int | None = None,
    kv_cache_dtype: str = "fp8",
    json_path: Path | None = None,
    copy_gib: float = 2.0,
    backend_options: dict[str, str] | None = None,
    config_overrides: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
    profile_rows: int = 0,
    enforce_eager: bool = False,
    prefills=DEFAULT_PREFILLS,
    prefill_chunk: int | None = None,
    matmul_n: int | None = None,
) -> tuple[list[V4Result], list[V4PrefillResult], dict]:
    """Build the model (cut to fit), then time `steps` decode steps per (batch, context) pair (none when
    `batches` is empty), then each (prompts, tokens) prefill row of `prefills` (none when empty).
    Returns the decode results, the prefill results and the run's facts (layers, formats, bandwidth,
    matmul rates...). `kv_cache_dtype`: EngineConfig's ("auto": the model dtype; "fp8": e4m3 rows with a
    per-token scale). profile_rows > 0: then `steps` more decode steps under the profiler, and one more pass of
    each prefill row, keeping that many kernels (step_profile.py). enforce_eager: no device graphs for the decode rows (EngineConfig's).
    prefill_chunk: the prefill engine's max_num_batched_tokens (None: the engine's default on the device, step_budget.py). matmul_n: the matmul test's side
    (e2e.matmul_rates; default by device)."""
    from deepinfer.bench.e2e import matmul_rates, matmul_side
    from deepinfer.model.facts import model_facts
    from deepinfer.ops import kv_cache_format
    from deepinfer.runtime import open_runtime

    say = progress or (lambda line: print(f"deepinfer: {line}", file=sys.stderr, flush=True))
    kv_dtype = kv_cache_format.cache_dtype(kv_cache_dtype, dtype)
    full = flash_config(overrides=config_overrides)
    runtime = open_runtime(backend, dtype=dtype, options=backend_options, model=model_facts(full))
    device = runtime.device
    block_size = int(runtime.backend.kv_block_size)
    if prefill_chunk is None:
        from deepinfer.engine.step_budget import default_max_num_batched_tokens

        prefill_chunk = default_max_num_batched_tokens(device)
    engines, max_len = [], 0
    if batches:
        max_len = model_len(contexts, steps * (2 if profile_rows > 0 else 1), warmup)  # the profiled steps run past the timed ones
        tokens_after = max_len - 1 - max(contexts)  # tokens each request gets past its context (a spare one included)
        engines.append(EnginePlan(kv_blocks(batches, contexts, tokens_after, block_size), max(batches)))
    if prefills:
        prefill_max_len = max(length for _, length in prefills) + 1  # the longest prompt and its sampled token
        tokens = min(prefill_chunk, max(b * length for b, length in prefills))
        engines.append(EnginePlan(prefill_blocks(prefills, block_size), max(b for b, _ in prefills), tokens, prefill_max_len - 1))
        matmul_n = matmul_side(device, matmul_n)
    size = torch.empty((), dtype=dtype).element_size()

    def plan(n: int) -> dict[str, float]:
        return memory_parts(flash_config(n, config_overrides), engines, block_size, kv_dtype, dtype, copy_gib if batches else 0.0,
                            matmul_n if prefills else 0)  # fmt: skip

    n_layers = choose_layers(plan, free_memory(device, runtime.memory_info), layers, device, full.num_hidden_layers)
    config = flash_config(n_layers, config_overrides)
    kinds = layer_kinds(config)
    say(f"V4-Flash shape cut to {n_layers} of {full.num_hidden_layers} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}); "
        f"{sum(plan(n_layers).values()) / GiB:.1f} GiB planned on {device}")  # fmt: skip
    bandwidth = copy_bandwidth(device, copy_gib) if batches else None
    rates = matmul_rates(device, matmul_n) if prefills else None
    loaded = build_model(config, runtime, dtype, max(max_len, prefill_max_len if prefills else 0))
    info = {
        "gpu": device_name(device), "torch": torch.__version__, "backend": runtime.backend.name, "backend_options": dict(runtime.options),
        "layers": n_layers, "of_layers": full.num_hidden_layers, "layer_types": kinds,
        "kv_cache_dtype": kv_cache_dtype, "dtype": str(dtype).removeprefix("torch."), "kv_block_size": block_size,
        "weights": "dense projections fp8_block (e4m3, 128x128 scales), routed experts mxfp4 (e2m1 + e8m0 per 32); see deepinfer/bench/v4_weights.py",
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    results, prefill_results = [], []

    def save() -> None:  # after each kind of rows: a failure in the prefill rows keeps the decode rows' figures
        if json_path is not None:
            data = {"machine": info, "results": [asdict(r) for r in results], "prefill": [asdict(r) for r in prefill_results]}
            json_path.write_text(json.dumps(data, indent=1))

    if batches:
        info["copy_bandwidth_tb_s"] = bandwidth / 1e12
        info["start"] = "each request admitted at its cache length (random cache contents), then one step for its last prompt token"
        results = _decode_rows(loaded, runtime, dtype, config, batches, contexts, steps, warmup, max_len, engines[0].num_blocks, kv_cache_dtype,
                               kv_dtype, size, bandwidth, enforce_eager, profile_rows, say, info)  # fmt: skip
        save()
    if prefills:
        info["matmul_tflops"] = {"bf16": rates.bf16 / 1e12, "fp8": None if rates.fp8 is None else rates.fp8 / 1e12}
        info["matmul_how"] = f"{MATMUL_HOW}; n = {rates.n}"
        if rates.fp8_missing:
            info["fp8_rate_missing"] = f"{rates.fp8_missing}: the fp8 parts of the prefill floor are divided by the bf16 rate"
        info["prefill_chunk_tokens"] = prefill_chunk
        info["prefill_start"] = ("each prompt prefilled from position 0 (nothing cached, prefix caching off) in steps of at most "
                                 "max_num_batched_tokens, one token sampled; after one untimed pass of the same row")  # fmt: skip
        prefill_results = _prefill_rows(loaded, runtime, dtype, config, prefills, prefill_chunk, prefill_max_len, engines[-1].num_blocks, kv_cache_dtype,
                                        rates, profile_rows, say)  # fmt: skip
        save()
    return results, prefill_results, info


def timed_decode_steps(engine, device, warmup: int, steps: int) -> float:
    """Seconds per decode step of the admitted batch: its last prompt token and `warmup` untimed steps first."""
    for _ in range(1 + warmup):
        engine.step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def _decode_rows(loaded, runtime, dtype, config, batches, contexts, steps, warmup, max_len, num_blocks, kv_cache_dtype, kv_dtype, size, bandwidth,
                 enforce_eager, profile_rows, say, info) -> list[V4Result]:  # fmt: skip
    """The decode rows on an engine of their own, dropped (its caches and graphs freed) when they are done."""
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams

    device = runtime.device
    tokens_after = max_len - 1 - max(contexts)
    engine_config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches), num_kv_blocks=num_blocks,
                                 enable_prefix_caching=False, max_model_len=max_len, kv_cache_dtype=kv_cache_dtype,
                                 enforce_eager=enforce_eager)  # fmt: skip
    engine = LLMEngine(loaded, runtime, dtype, engine_config)
    info["device_graphs"], info["overlap"] = engine.runner.graphs is not None, engine.overlap is not None
    generator = torch.Generator(device=device).manual_seed(SEED + 1)
    fill_random(engine.runner.kv_caches, generator)
    say(f"model built, caches filled ({num_blocks} blocks of {engine.block_size} tokens); timing")
    params = SamplingParams(temperature=0.0, max_tokens=tokens_after, ignore_eos=True)
    tokens = torch.Generator().manual_seed(SEED + 2)
    results = []
    for context in contexts:
        base = torch.randint(0, config.vocab_size, (context - 1,), generator=tokens).tolist()
        for batch in batches:
            last = torch.randint(0, config.vocab_size, (batch,), generator=tokens).tolist()
            for token in last:
                admit_at_cache_length(engine, base + [token], params)
            step = timed_decode_steps(engine, device, warmup, steps)
            plan = plan_ms(engine, device)
            profile = None
            if profile_rows > 0:
                from deepinfer.bench import step_profile

                def decode_steps():
                    for _ in range(steps):
                        engine.step()

                profile = step_profile.of_steps(decode_steps, steps, device, runtime.profiler_activity).to_json(profile_rows)
            engine.abort_all()
            parts = floor_parts(config, batch, context + warmup + steps // 2, kv_dtype, size)
            floor = sum(parts.values())
            results.append(V4Result(batch, context, steps, step * 1e3, floor / bandwidth * 1e3, floor, batch / step, plan, parts, profile))
            say(f"batch {batch} context {context}: {step * 1e3:.2f} ms per step (plan {plan:.2f} ms)")
    return results


def _prefill_rows(loaded, runtime, dtype, config, prefills, chunk, max_len, num_blocks, kv_cache_dtype, rates, profile_rows, say) -> list[V4PrefillResult]:
    """The prefill rows on an engine of their own (built once the decode rows' engine is gone): each row one
    untimed pass (compiles, autotunes), then PREFILL_PASSES timed passes, their median against its compute floor (one
    pass of about a second varied by up to 8% between runs on an H100); profile_rows > 0: then one more pass under the
    profiler, keeping that many kernels."""
    import gc

    from deepinfer.bench.device_api import empty_cache
    from deepinfer.bench.v4_prefill_floor import RATE_OF_PART, floor_seconds, prefill_flops
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    device = runtime.device
    gc.collect()  # the decode rows' engine (its caches, graphs) in reference cycles: freed before this one is built
    empty_cache(device)
    # enforce_eager: no decode step runs here, so no graph is worth its memory
    engine_config = EngineConfig(max_num_seqs=max(b for b, _ in prefills), max_num_batched_tokens=chunk, num_kv_blocks=num_blocks,
                                 enable_prefix_caching=False, max_model_len=max_len, kv_cache_dtype=kv_cache_dtype, enforce_eager=True)  # fmt: skip
    engine = LLMEngine(loaded, runtime, dtype, engine_config)
    tokens = torch.Generator().manual_seed(SEED + 3)
    results = []
    for batch, prompt_len in prefills:
        prefill_pass(engine, batch, prompt_len, tokens, device)  # untimed
        passes = []
        for _ in range(PREFILL_PASSES):
            seconds, steps, computed = prefill_pass(engine, batch, prompt_len, tokens, device)
            if computed != batch * prompt_len:
                raise RuntimeError(f"prefill {batch} x {prompt_len}: the engine computed {computed} prompt tokens, not {batch * prompt_len}; timing void")
            passes.append(seconds)
        seconds = statistics.median(passes)
        flops = prefill_flops(config, batch, prompt_len)
        floor = floor_seconds(flops, rates.for_floor())
        total = sum(flops.values())
        profile = None
        if profile_rows > 0:
            from deepinfer.bench import step_profile

            def one_pass(batch=batch, prompt_len=prompt_len):
                prefill_pass(engine, batch, prompt_len, tokens, device)

            profile = step_profile.of_steps(one_pass, 1, device, runtime.profiler_activity).to_json(profile_rows)
        results.append(V4PrefillResult(batch, prompt_len, chunk, steps, seconds, batch * prompt_len / seconds, floor, floor / seconds, total, flops,
                                       dict(RATE_OF_PART), profile, passes))  # fmt: skip
        say(f"prefill {batch} x {prompt_len}: {seconds:.3f} s in {steps} steps ({batch * prompt_len / seconds:.0f} tokens/s, floor {floor:.3f} s)")
    return results


def format_results(results: list[V4Result], info: dict, prefill: list[V4PrefillResult] = ()) -> str:
    kinds = ", ".join(f"{n} {k}" for k, n in info["layer_types"].items())
    lines = [f"{info['layers']} of {info['of_layers']} layers ({kinds}); KV cache {info['kv_cache_dtype']}"]
    if results:
        lines += [
            f"decode: copy bandwidth {info['copy_bandwidth_tb_s']:.3f} TB/s; floor = bytes read / copy bandwidth, for these layers; "
            f"device graphs {'on' if info.get('device_graphs') else 'off'}",
            "batch  context  ms/step  step plan ms  floor ms  of floor    tok/s  floor GB: dense  experts     KV",
        ]
    for r in results:
        p = {k: v / 1e9 for k, v in r.floor_parts.items()}
        lines.append(
            f"{r.batch:5d}  {r.context:7d}  {r.step_ms:7.2f}  {r.plan_ms:12.2f}  {r.floor_ms:8.2f}  {r.floor_ms / r.step_ms:8.0%}  {r.tok_s:7.0f}"
            f"  {p['dense weights']:15.2f}  {p['routed experts']:7.2f}  {p['KV']:6.2f}"
        )
    if prefill:
        rates = info["matmul_tflops"]
        fp8 = f"{rates['fp8']:.1f}" if rates["fp8"] is not None else "not measured (the bf16 rate stands in)"
        lines += [
            f"prefill: matmul bf16 {rates['bf16']:.1f} TFLOP/s, fp8 {fp8}; floor = each part's FLOPs / its format's rate "
            f"(deepinfer/bench/v4_prefill_floor.py), for these layers; chunks of {info['prefill_chunk_tokens']} tokens",
            "prompts x tokens  steps  seconds     tok/s  floor s  of floor  TFLOP: fp8    bf16",
        ]
    for r in prefill:
        by_rate = {rate: sum(v for part, v in r.flops.items() if r.rates[part] == rate) / 1e12 for rate in ("fp8", "bf16")}
        lines.append(
            f"{f'{r.batch} x {r.prompt_len}':>16}  {r.steps:5d}  {r.seconds:7.3f}  {r.tok_s:8.0f}  {r.floor_s:7.3f}  {r.of_floor:8.0%}"
            f"  {by_rate['fp8']:10.2f}  {by_rate['bf16']:6.2f}"
        )
    if any(r.profile for r in [*results, *prefill]):
        from deepinfer.bench.step_profile import format_profile

        lines += [format_profile(f"batch {r.batch} context {r.context}", r.profile, r.step_ms) for r in results if r.profile]
        lines += [format_profile(f"prefill {r.batch} x {r.prompt_len}", r.profile, r.seconds * 1e3, "prefill pass") for r in prefill if r.profile]
    return "\n".join(lines)
