"""Expert-parallel scaling benchmark: decode tokens/s of a random DeepSeek-V3-shaped model over N ranks.

A DeepSeek-V3-shaped model (hidden 7168, MLA with q_lora 1536 / kv_lora 512 / rope 64 / nope 128 /
v 128, 128 heads, 256 routed experts top-8 in 8 groups of which 4 are kept, noaux_tc sigmoid
routing with e_score_correction_bias, 1 shared expert, moe_intermediate 2048), cut to a few layers
(default 4: 1 dense + 3 MoE), is built by deepinfer's own model classes with random weights drawn on
the device (no transformers, no disk). Each tensor is drawn from a generator seeded by its name, so
every rank and every copy of an expert holds the same values, and a rank holds only the experts its
placement gives it.

One process per device (torchrun; `deepinfer bench e2e-ep --ep N` starts it). Attention runs data
parallel: every rank decodes its own `batch` requests; the routed experts of every MoE layer are
sharded over all ranks (docs/distributed.md). For each variant (number of redundant experts R) and
batch size per rank it measures the decode step time like `deepinfer bench e2e` (generation of
n + 1 tokens minus generation of 1 token, over n, each the fastest of `repeat` runs; both calls run
once untimed first, so compilation and graph capture never land in a timing; ranks start each timed
call together after a barrier; the step time is the slowest rank's) and the routing load of the timed decode:

- skew: the gate's correction bias adds `skew * exp(-j / skew_experts)` to the j-th expert of a
  fixed random order per MoE layer (seeded), so a few experts get a large share of the tokens;
- R = 0: the default placement (rank r holds experts [r * E/N, (r + 1) * E/N)); R > 0: E + R
  physical experts placed by EPLB (`distributed.eplb_schedule.rebalance_experts`) from the load counted during a
  warm-up generation over other prompts;
- `expert_max_mean`: tokens of the busiest logical expert over the mean; `rank_max_mean`: rows
  of the busiest rank over the mean (EPLB's measure, copies sharing their expert's tokens evenly);
  both per MoE layer, averaged over the layers, counted over the timed (n + 1)-token runs.

Where the backend captures device graphs (BackendSpec.graph_capture: CUDA graphs on the cuda
backend) the engine replays decode steps as graphs; with ep > 1 only where the backend's dispatch
can run without a host synchronisation given a token bound (the cuda backend's symmetric-memory
path), in steps where every rank decodes (a prefill anywhere makes the step eager), every rank
replaying the graph of the largest batch among them; each row says whether graphs were on (the
JSON field keeps its name, `cuda_graphs`, so runs stay comparable). Every device call goes
through torch's device-generic API (deepinfer.bench.device_api).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer.bench.device_api import device_name, empty_cache, synchronize
from deepinfer.bench.e2e import _timed
from deepinfer.model.linear import LinearWeight
from deepinfer.model.weights import FLOAT32, PARAM, TensorSpec, WeightStore

# DeepSeek-V3's config.json (the fields the model reads); MTP layers are left out.
V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, first_k_dense_replace=3, moe_layer_freq=1, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
)  # fmt: skip

INIT_STD = 0.02  # DeepSeek-V3's initializer_range, as transformers draws random weights
GRAPHS_NOTE = ("device graphs (CUDA graphs on cuda): with ep > 1 (where the EP exchange needs no host sync: symmetric memory) a decode step "
               "replays on every rank the graph of the largest batch among them, captured by all ranks together; a step with a prefill on any "
               "rank runs eagerly on all")


@dataclass
class EPResult:
    ep: int
    num_redundant_experts: int
    placement: str  # "default" (rank r holds experts [r*E/N, (r+1)*E/N)) | "eplb" (from a warm-up's load)
    batch_per_rank: int
    total_batch: int
    prompt_len: int
    new_tokens: int
    step_ms: float  # the slowest rank's decode step
    tok_s: float  # decode tokens/s over all ranks: total_batch / step
    tok_s_per_rank: float
    expert_max_mean: float
    rank_max_mean: float
    cuda_graphs: bool  # decode steps replayed as the backend's device graphs (the name kept: comparable JSON)
    ep_path: str = "-"  # how rows crossed ranks: the backend's transport ("symm") or all_to_all_single over the group ("nccl", "gloo")
    step_ms_per_rank: list[float] = field(default_factory=list)
    eplb_rank_max_mean_before: float | None = None  # on the warm-up's load, default placement -> EPLB's
    eplb_rank_max_mean_after: float | None = None


def model_config(layers: int = 4, dense_layers: int = 1, overrides: dict | None = None) -> dict:
    """V3's config cut to `layers` layers, the first `dense_layers` of them dense."""
    if not 0 <= dense_layers <= layers:
        raise ValueError(f"dense_layers must lie in [0, layers={layers}], got {dense_layers}")
    return {**V3, "num_hidden_layers": layers, "first_k_dense_replace": dense_layers, **(overrides or {})}


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def skew_bias(num_experts: int, layer: int, skew: float, skew_experts: float, seed: int = 0) -> torch.Tensor:
    """The correction bias of one MoE layer: `skew * exp(-j / skew_experts)` for the j-th expert of a
    random order fixed by (seed, layer); all zeros for skew 0. float32 [num_experts]."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(_seed_of(seed, f"skew order {layer}")))
    bias = torch.zeros(num_experts, dtype=torch.float32)
    if skew:
        bias[order] = skew * torch.exp(-torch.arange(num_experts, dtype=torch.float32) / skew_experts)
    return bias


class RandomWeights(WeightStore):
    """A WeightStore that draws each tensor when the model takes it: norms are ones, the correction
    bias is `skew_bias`, everything else N(0, 0.02) from a generator seeded by (seed, name), drawn
    on the device in its kept dtype. Experts other ranks hold are never drawn. Also an
    `ExpertSource` (for EPLB re-placement): it draws an expert again, identically."""

    def __init__(self, specs: dict[str, TensorSpec], device: torch.device, dtype: torch.dtype, *, seed: int = 0, skew: float = 0.0, skew_experts: float = 16.0):
        super().__init__({})
        self.specs, self._left = dict(specs), set(specs)
        self.device, self.dtype, self.seed, self.skew, self.skew_experts = torch.device(device), dtype, seed, skew, skew_experts

    def draw(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        if name.endswith("e_score_correction_bias"):
            layer = int(name.split(".")[2])
            return skew_bias(spec.shape[0], layer, self.skew, self.skew_experts, self.seed).to(self.device)
        dtype = torch.float32 if spec.kind == FLOAT32 else self.dtype
        if spec.kind == PARAM and len(spec.shape) == 1:  # RMSNorm weights
            return torch.ones(spec.shape, dtype=dtype, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(_seed_of(self.seed, name))
        return torch.empty(spec.shape, dtype=dtype, device=self.device).normal_(0.0, INIT_STD, generator=generator)

    def tensor(self, name: str) -> torch.Tensor:
        self._left.discard(name)
        return self.draw(name)

    def linear(self, prefix: str) -> LinearWeight:
        return LinearWeight(self.tensor(f"{prefix}.weight"))

    def take_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        return {}  # no MTP layers

    def remaining(self) -> list[str]:
        return sorted(self._left)

    def __call__(self, layer_prefix: str, expert: int) -> tuple[LinearWeight, ...]:
        from deepinfer.model.moe import EXPERT_PROJECTIONS, expert_tensor_prefix

        return tuple(LinearWeight(self.draw(f"{expert_tensor_prefix(layer_prefix, expert, p)}.weight")) for p in EXPERT_PROJECTIONS)


def build_model(runtime, cfg: dict, dtype: torch.dtype, dist, num_redundant_experts: int = 0, *, seed: int = 0, skew: float = 0.0, skew_experts: float = 16.0):
    """A LoadedModel over random weights. One rank without redundant experts: no placement (every
    expert local, as `LLM(ep=1)` builds it); otherwise the experts sharded over `dist`'s ranks,
    physical expert p holding logical expert p mod E until EPLB re-places them."""
    from deepinfer.engine.llm import num_nodes
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.deepseek import DeepseekForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.model.moe import ExpertSharding

    config = ModelConfig.from_dict(cfg, source="random DeepSeek-V3-shaped model")
    placement = None
    if dist is not None or num_redundant_experts:
        placement = ExpertSharding(dist, num_redundant_experts, num_nodes(dist)).placement(config)
    model = DeepseekForCausalLM(config, runtime.ops, runtime.device, dtype, placement=placement)
    weights = RandomWeights(model.tensor_specs(), model.device, dtype, seed=seed, skew=skew, skew_experts=skew_experts)
    model.load_weights(weights)
    if placement is not None:
        model.expert_source = weights
    layers = config.num_hidden_layers
    path = f"random DeepSeek-V3-shaped model, {layers} layers ({config.first_k_dense_replace} dense)"
    return LoadedModel(model=model, config=config, tokenizer=None, path=path, dummy_weights=True)


def _all_reduce_load(load: torch.Tensor, dist) -> torch.Tensor:
    if dist is None:
        return load.cpu()
    import torch.distributed as tdist

    wire = load.cpu() if dist.backend == "gloo" else load
    tdist.all_reduce(wire, group=dist.group)
    return wire.cpu()


def expert_max_mean(load: torch.Tensor) -> float:
    """max / mean tokens per logical expert, per layer, averaged over the layers."""
    load = load.double()
    return float((load.amax(-1) / load.mean(-1).clamp_min(1e-12)).mean())


def _barrier(dist, device: torch.device) -> None:
    synchronize(device)
    if dist is not None:
        import torch.distributed as tdist

        tdist.barrier(group=dist.group)


def run(
    backend: str = "auto",
    batches=(64, 256),
    prompt_len: int = 128,
    new_tokens: int = 32,
    layers: int = 4,
    dense_layers: int = 1,
    redundant=(0,),
    skew: float = 0.5,
    skew_experts: float = 16.0,
    dtype: torch.dtype = torch.bfloat16,
    enforce_eager: bool = False,
    interpret: bool = False,
    config_overrides: dict | None = None,
    max_num_batched_tokens: int = 16384,
    warmup_tokens: int = 8,
    repeat: int = 2,
    seed: int = 0,
    dist_timeout: float = 300.0,
    json_path: Path | None = None,
    progress=None,
) -> list[EPResult]:
    """Every rank (torchrun's WORLD_SIZE of them, or one) runs this with the same arguments; all
    ranks return the same rows, rank 0 writes `json_path`. `redundant`: one variant per value."""
    from deepinfer.distributed.eplb import default_phy2log, imbalance
    from deepinfer.engine.llm import LLM, join_expert_parallel
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.plugins import load_plugins
    from deepinfer.runtime import open_runtime

    batches = tuple(batches)
    cfg = model_config(layers, dense_layers, config_overrides)
    plugins = load_plugins()

    def device_type() -> str:
        spec = plugins.auto()[0] if backend == "auto" else plugins.backend(backend)
        return spec.device(interpret)

    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the backend decorates its kernels
    dist = join_expert_parallel(None, dist_timeout, device_type)
    ep = dist.world_size if dist is not None else 1
    rank = dist.rank if dist is not None else 0
    say = progress if (progress is not None and rank == 0) else (lambda line: None)
    runtime = open_runtime(backend, dtype=dtype, ep_size=ep, interpret=interpret, plugins=plugins)
    device = runtime.device
    num_moe = sum(1 for i in range(cfg["num_hidden_layers"]) if i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0)
    if not num_moe:
        raise ValueError("the cut model has no MoE layer: raise --layers or lower --dense-layers")
    num_experts = int(cfg["n_routed_experts"])
    for r in redundant:
        if r < 0 or (num_experts + r) % ep:
            raise ValueError(f"{num_experts} experts + {r} redundant do not divide over {ep} ranks")
    max_batch = max(batches)
    max_len = prompt_len + new_tokens + 1
    block = int(runtime.backend.kv_block_size)
    engine_config = EngineConfig(
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(min(max_batch * prompt_len, max_num_batched_tokens), prompt_len),
        num_kv_blocks=kv_cache_blocks(max_batch, prompt_len, new_tokens, block),
        max_model_len=max_len,
        enforce_eager=enforce_eager,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = {b: torch.randint(0, cfg["vocab_size"], (b * ep, prompt_len), generator=gen).tolist() for b in batches}
    warmup_prompts = torch.randint(0, cfg["vocab_size"], (max_batch * ep, prompt_len), generator=gen).tolist()
    results: list[EPResult] = []

    def bench_variant(r: int) -> None:
        """One redundant-expert count: build, (rebalance,) time every batch, append the rows to `results`."""
        start = time.perf_counter()
        loaded = build_model(runtime, cfg, dtype, dist, r, seed=seed, skew=skew, skew_experts=skew_experts)
        model = loaded.model
        engine = LLMEngine(loaded, runtime, dtype, engine_config, dist=dist)
        llm = LLM.from_engine(engine)
        graphs = engine.runner.graphs is not None
        # Count the routing load (logical ids, on the device) the way --eplb does.
        from deepinfer.distributed.eplb import ExpertLoadCounter
        from deepinfer.distributed.eplb_schedule import rebalance_experts

        counter = ExpertLoadCounter(num_moe, num_experts, device)
        model.count_expert_load(counter.counts)
        say(f"ep {ep}, {r} redundant experts: model built in {time.perf_counter() - start:.1f} s (device graphs {'on' if graphs else 'off'})")

        def generate(requests, n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            return llm.generate([{"prompt_token_ids": p} for p in requests], params, use_tqdm=False)

        before = after = None
        placement = "default"
        if r:
            generate(warmup_prompts, warmup_tokens)
            load = _all_reduce_load(counter.counts.clone(), dist)  # what rebalance_experts will see
            phy2log = model.placement.phy2log
            before = imbalance(load, phy2log, ep)
            rebalance_experts(model, counter.take(), dist)  # sums the counted load over the ranks, applies EPLB
            after = imbalance(load, model.placement.phy2log, ep)
            placement = "eplb"
            say(f"  EPLB from the warm-up's load: max/mean load per rank {before:.2f} -> {after:.2f}")
        for b in batches:
            requests = prompts[b]

            def timed(n):
                _barrier(dist, device)  # every rank starts the clock together
                return _timed(lambda: generate(requests, n), device)

            # Warm-up runs both timed calls once: the first prefill over a cached prefix compiles its
            # own kernel variant and each batch size captures its own graphs.
            generate(requests, 1), generate(requests, 1 + new_tokens)
            t1 = min(timed(1) for _ in range(repeat))
            counter.take()
            tn = min(timed(1 + new_tokens) for _ in range(repeat))
            load = _all_reduce_load(counter.take(), dist)
            step = (tn - t1) / new_tokens
            steps = _gather(dist, step)
            if min(steps) <= 0:
                raise RuntimeError(
                    f"batch {b}: generating {1 + new_tokens} tokens took {tn * 1e3:.1f} ms, not more than 1 token's {t1 * 1e3:.1f} ms; the timing is void"
                )
            slowest = max(steps)
            phy2log = model.placement.phy2log if model.placement is not None else default_phy2log(num_moe, num_experts, num_experts)
            results.append(
                EPResult(
                    ep, r, placement, b, b * ep, prompt_len, new_tokens, slowest * 1e3, b * ep / slowest, b / slowest,
                    expert_max_mean(load), imbalance(load, phy2log, ep), graphs, ep_path(model, dist), [s * 1e3 for s in steps], before, after,
                )
            )  # fmt: skip
            say(format_results(results[-1:], header=False))

    for r in redundant:
        bench_variant(r)  # its model, engine and graphs go with its return
        gc.collect()
        empty_cache(device)
    if rank == 0 and json_path is not None:
        machine = machine_info(runtime, ep, cfg, dtype, skew, skew_experts, enforce_eager)
        json_path.write_text(json.dumps({"machine": machine, "results": [asdict(x) for x in results]}, indent=1))
    return results


def ep_path(model, dist) -> str:
    """The exchange the MoE layers used: a backend transport that took over (the cuda backend's
    "symm" on one host), else all_to_all_single over the process group's library; "-" alone."""
    if dist is None:
        return "-"
    group = model.placement.ep_group if model.placement is not None else None
    transports = sorted(getattr(group, "transports", None) or {})
    return ",".join(transports) or dist.backend


def _gather(dist, value: float) -> list[float]:
    if dist is None:
        return [value]
    import torch.distributed as tdist

    out: list = [None] * dist.world_size
    tdist.all_gather_object(out, value, group=dist.group)
    return [float(v) for v in out]


def machine_info(runtime, ep: int, cfg: dict, dtype: torch.dtype, skew: float, skew_experts: float, enforce_eager: bool) -> dict:
    device = runtime.device
    info = {
        "device": device_name(device),
        "torch": torch.__version__,
        "backend": runtime.backend.name,
        "ep": ep,
        "date": time.strftime("%Y-%m-%d"),
        "dtype": str(dtype).removeprefix("torch."),
        "layers": cfg["num_hidden_layers"],
        "dense_layers": cfg["first_k_dense_replace"],
        "config": {k: v for k, v in cfg.items() if k != "rope_scaling"},
        "skew": skew,
        "skew_experts": skew_experts,
        "enforce_eager": enforce_eager,
        "backend_options": dict(runtime.options),  # as resolved: e.g. the cuda backend's ep_path (default from DEEPINFER_EP_PATH)
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None  # not installed (the reference backend needs none)
    if runtime.graph_capture is not None:  # the backend's device graphs (none under the interpreter)
        info["note"] = GRAPHS_NOTE
    return info


HEADER = "  ep  redundant  placement  batch/rank   ms/step  decode tok/s  tok/s/rank  expert max/mean  rank max/mean  graphs  exchange"


def format_results(results: list[EPResult], header: bool = True) -> str:
    lines = [HEADER] if header else []
    for x in results:
        lines.append(
            f"{x.ep:4d}  {x.num_redundant_experts:9d}  {x.placement:>9}  {x.batch_per_rank:10d}  {x.step_ms:8.2f}  {x.tok_s:12.0f}  "
            f"{x.tok_s_per_rank:10.0f}  {x.expert_max_mean:15.2f}  {x.rank_max_mean:13.2f}  {'on' if x.cuda_graphs else 'off':>6}  {x.ep_path:>8}"
        )
    return "\n".join(lines)


def kv_cache_blocks(max_batch: int, prompt_len: int, new_tokens: int, block: int) -> int:
    """KV pages the engine of `run` gets: room for the prefix cache of one batch beside the next."""
    from deepinfer.engine.block_manager import blocks_for

    return 2 * max_batch * blocks_for(prompt_len + new_tokens + 1, block)


def rank_memory_bytes(cfg: dict, ep: int, num_redundant_experts: int, dtype: torch.dtype, max_batch: int, prompt_len: int, new_tokens: int, block: int) -> int:
    """Bytes one rank of `run` takes for a variant, from the config `build_model` builds: the model
    (deepinfer.model.memory's estimate: weights of the experts this rank holds, RoPE table, routing,
    loading bookkeeping) plus the KV cache. A floor: activations are left out."""
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.memory import estimate_model_memory

    config = ModelConfig.from_dict(cfg, source="random DeepSeek-V3-shaped model (--override)")
    physical = config.n_routed_experts + num_redundant_experts
    held = math.ceil(physical / ep)
    model = estimate_model_memory(config, dtype, config.max_position_embeddings, held, physical)
    item = torch.empty((), dtype=dtype).element_size()
    kv = kv_cache_blocks(max_batch, prompt_len, new_tokens, block) * block * config.kv_cache_width * config.num_hidden_layers * item
    return model.device + model.host + kv


def expert_memory_gib(cfg: dict, ep: int, num_redundant_experts: int = 0, dtype_bytes: int = 2) -> float:
    """Routed-expert weights one rank holds (all MoE layers), GiB: what must fit beside the rest."""
    num_moe = sum(1 for i in range(cfg["num_hidden_layers"]) if i >= cfg["first_k_dense_replace"])
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * dtype_bytes
    local = math.ceil((cfg["n_routed_experts"] + num_redundant_experts) / ep)
    return num_moe * local * per_expert / 2**30
