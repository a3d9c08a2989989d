"""The compute floor of a DeepSeek-V4 prefill: the FLOPs it must do, each part over the matmul rate of its format.

`prefill_flops` counts, 2 FLOPs per multiply-add, what prefilling `batch` prompts of `prompt_len`
tokens each (from position 0, nothing cached) must compute, by part. Chunking does not change the
count: a chunk's queries read the rows and entries earlier chunks wrote, as one whole-prompt step's
would. The parts and the rate each is divided by (`RATE_OF_PART`; the rates are measured in the same
run, `deepinfer.bench.e2e.matmul_rates`):

- fp8 rate: "attention projections" (every token through wq_a, wq_b, wkv, wo_a's groups and wo_b: 2 x
  rows x cols each), "indexer q projection" (every token of a CSA layer through the indexer's wq_b),
  "shared expert" (every token through w1, w3 and w2);
- bf16 rate: "compressor projections" (every token through wkv and wgate of each compressor: a CSA
  layer's entries' and indexer's, an HCA layer's one), "indexer weights projection" (weights_proj),
  "routed experts" (every token through its top-k experts' w1, w3 and w2, hash-routed layers too),
  "compressor pooling" (every entry a prompt closes, prompt_len // ratio per compressor: 2 x slots x
  width, slots = ratio, or 2 x ratio for overlapping windows), "indexer scoring" (each query of a
  CSA layer against every entry complete at its position p, (p + 1) // ratio of them, with every
  indexer head: 2 x index_n_heads x index_head_dim per entry), "attention" (each query against the
  rows it reads, causal: the window's min(sliding_window, p + 1) rows, plus in CSA layers
  min(index_topk, (p + 1) // ratio) selected entries, in HCA layers (p + 1) // ratio entries; QK and
  PV over the one shared head_dim-wide row: 4 x heads x head_dim per row).

Why those rates: the bench's weights (deepinfer/bench/v4_weights.py) keep the attention projections,
the indexer's wq_b and the shared expert in fp8_block, which the cuda kernels run as fp8 x fp8 MMAs
(the activation quantised per 128 columns); the compressors' projections and weights_proj stay bf16
as in the release; the routed experts are mxfp4 with bf16 activations (W4A16: Hopper has no fp4
MMA, its kernels upcast the weights to bf16); on a chip with native fp4 products (SM100) the
experts could run faster than this rate, so there the floor is too long and a run's fraction of it
flatters the run. Attention and indexer scoring are bf16 MMAs (FP8 KV
rows convert to bf16 exactly). The pooling is vector work, divided by the matmul rate anyway (a
lower bound). Where the device has no fp8 product to measure, the fp8 parts are divided by the bf16
rate, and the run says so (always on the host, the CPU, whose fp8 product is an emulation). The rates
are square n x n x n products (n = 8192 on a device): the model's GEMMs, narrower (K = 1024 for
wq_b, N = 512 for wkv) or grouped (the experts), may top out lower, which this floor does not model.

Left out (a lower bound): the router's and the hyper-connections' float32 products (about 0.5% of a
token's FLOPs at V4-Flash widths), norms, rope, the activations, the head (one row per prompt), the
top-k selections, the fp8 activation quantisation, and every byte moved.
"""

from __future__ import annotations

from deepinfer.model.deepseek_v4.config import CSA, HCA, V4Config

FP8, BF16 = "fp8", "bf16"
RATE_OF_PART = {
    "attention projections": FP8,
    "indexer q projection": FP8,
    "shared expert": FP8,
    "compressor projections": BF16,
    "indexer weights projection": BF16,
    "routed experts": BF16,
    "compressor pooling": BF16,
    "indexer scoring": BF16,
    "attention": BF16,
}
_ATTENTION_PROJECTIONS = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.")


def projection_part(name: str) -> str:
    """The part a projection weight's FLOPs count in (`layers.N.attn.wq_a.weight` -> "attention projections")."""
    if ".compressor." in name:
        return "compressor projections"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared expert"
    if ".attn.indexer.wq_b." in name:
        return "indexer q projection"
    if ".attn.indexer.weights_proj." in name:
        return "indexer weights projection"
    if any(f".{part}" in name for part in _ATTENTION_PROJECTIONS):
        return "attention projections"
    raise ValueError(f"the prefill floor does not know the projection {name}: count its FLOPs in deepinfer/bench/v4_prefill_floor.py")


def prefill_flops(config: V4Config, batch: int, prompt_len: int) -> dict[str, float]:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens each, by part (the module docstring
    says what each counts). Every part is present, 0 where the layers have none of it."""
    from deepinfer.model.deepseek_v4.model import model_tensor_specs
    from deepinfer.model.deepseek_v4.moe import EXPERT
    from deepinfer.model.weights import LINEAR

    c = config
    tokens = batch * prompt_len
    parts = dict.fromkeys(RATE_OF_PART, 0.0)
    kinds = {i: c.layer_types[i] for i in range(c.num_hidden_layers)}
    for name, spec in model_tensor_specs(c).items():
        if spec.kind not in (LINEAR, EXPERT):
            continue
        rows, cols = spec.shape
        through = tokens  # tokens through the weight
        if spec.kind == EXPERT:  # tokens x top_k rows over n_routed_experts equal experts
            through = tokens * c.num_experts_per_tok / c.n_routed_experts
        parts[projection_part(name)] += 2.0 * rows * cols * through
    window = _sum_min(prompt_len, c.sliding_window)  # rows of the window read, over the prompt's queries
    per_row = 4.0 * c.num_attention_heads * c.head_dim
    for layer, kind in kinds.items():
        ratio = c.compress_ratio(layer)
        read = window
        if kind == CSA:
            visible = _sum_floor_div(prompt_len, ratio)
            parts["indexer scoring"] += batch * 2.0 * c.index_n_heads * c.index_head_dim * visible
            read += _sum_min_floor_div(prompt_len, ratio, c.index_topk)
            entries = prompt_len // ratio
            parts["compressor pooling"] += batch * entries * 2.0 * 2 * ratio * (c.head_dim + c.index_head_dim)  # two overlapping compressors
        elif kind == HCA:
            read += _sum_floor_div(prompt_len, ratio)
            parts["compressor pooling"] += batch * (prompt_len // ratio) * 2.0 * ratio * c.head_dim
        parts["attention"] += batch * per_row * read
    return parts


def floor_seconds(flops: dict[str, float], rates: dict[str, float]) -> float:
    """Seconds of the parts at their rates: sum of flops[part] / rates[RATE_OF_PART[part]] (FLOP/s)."""
    return sum(value / rates[RATE_OF_PART[part]] for part, value in flops.items())


# Sums over a prompt's queries at positions p = 0 .. n - 1, of functions of p + 1 (causal counts).


def _sum_min(n: int, cap: int) -> int:
    """sum over q = 1..n of min(cap, q)."""
    full = min(n, cap)
    return full * (full + 1) // 2 + max(0, n - cap) * cap


def _sum_floor_div(n: int, ratio: int) -> int:
    """sum over q = 1..n of q // ratio: value k for the `ratio` values k*ratio .. k*ratio + ratio - 1, and
    n // ratio for the last n % ratio + 1 of them."""
    whole, rest = divmod(n, ratio)
    return ratio * (whole - 1) * whole // 2 + whole * (rest + 1) if whole else 0


def _sum_min_floor_div(n: int, ratio: int, cap: int) -> int:
    """sum over q = 1..n of min(cap, q // ratio): q // ratio reaches cap at q = cap * ratio."""
    if n < cap * ratio:
        return _sum_floor_div(n, ratio)
    return _sum_floor_div(cap * ratio - 1, ratio) + (n - cap * ratio + 1) * cap
