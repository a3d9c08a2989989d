"""What a model takes in memory, from its checked config alone, and a refusal when the device lacks it.

Runs before anything is allocated, so that a config with absurd sizes (2**24 experts, 10**10
positions) fails at once with the estimate in its message instead of eating memory for minutes.
Sizes are counted arithmetically (never by building per-tensor tables, which alone would not fit):

- weights: every tensor in the dtype it is kept in (FP8 projections 1 byte plus their float32
  block scales when config.json declares fp8; else the model dtype; the router float32), the
  experts this rank holds only, plus one MoE layer's experts again (stacking copies them);
- the RoPE cos/sin table: [positions, qk_rope_head_dim] float32, and about 5 times that in
  float64 temporaries on the host while it is computed;
- routing tables and per-tensor bookkeeping (headers, specs: ~1 KiB per checkpoint tensor).

MTP layers and the KV cache are left out (the engine sizes the cache from what is left): the
estimate is a floor, so a refusal is never a false alarm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.model.config import ModelConfig, ceil_div
from deepinfer.model.errors import LoadError

FP8_BLOCK = 128
TENSOR_BOOKKEEPING = 1024  # host bytes per checkpoint tensor: its header entry, its spec, names
ROPE_BUILD_FACTOR = 5  # float64 angles, cos, sin and their concatenation vs the float32 table


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # bytes kept on the device, the stacking copy of one MoE layer included
    rope_table: int  # the cos/sin table, on the device
    routing: int  # expert routing tables, on the device
    rope_build: int  # host bytes while the RoPE table is computed (float64 temporaries)
    bookkeeping: int  # host bytes of per-tensor Python objects
    rope_positions: int
    num_tensors: int

    @property
    def device(self) -> int:
        return self.weights + self.rope_table + self.routing

    @property
    def host(self) -> int:
        return self.rope_build + self.bookkeeping

    def parts(self, with_host: bool) -> dict[str, int]:
        """What the device (and the host, `with_host`) holds, by name."""
        parts = {"weights": self.weights, f"RoPE table for {self.rope_positions} positions": self.rope_table, "expert routing tables": self.routing}
        if with_host:
            parts[f"RoPE table for {self.rope_positions} positions"] += self.rope_build
            parts[f"bookkeeping of {self.num_tensors} checkpoint tensors"] = self.bookkeeping
        return parts


def num_moe_layers(config: ModelConfig) -> int:
    """How many layers `config.is_moe_layer` calls MoE, without walking the layers."""
    if not config.n_routed_experts:
        return 0
    freq = config.moe_layer_freq
    first = ceil_div(config.first_k_dense_replace, freq) * freq
    return 0 if first >= config.num_hidden_layers else (config.num_hidden_layers - 1 - first) // freq + 1


def estimate_model_memory(
    config: ModelConfig, dtype: torch.dtype, rope_positions: int, physical_experts_held: int | None = None, physical_experts: int | None = None
) -> MemoryEstimate:
    """Bytes the model needs. `physical_experts_held`: experts per MoE layer on this rank (default:
    every logical expert); `physical_experts`: per layer over all ranks (routing tables)."""
    c = config
    item = torch.empty((), dtype=dtype).element_size()
    quantized = c.quantization is not None

    def linear(out_features: int, in_features: int) -> int:
        if not quantized:
            return out_features * in_features * item
        return out_features * in_features + ceil_div(out_features, FP8_BLOCK) * ceil_div(in_features, FP8_BLOCK) * 4

    def mlp(hidden: int, inter: int) -> int:
        return 2 * linear(inter, hidden) + linear(hidden, inter)

    h, heads = c.hidden_size, c.num_attention_heads
    weights = (1 if c.tie_word_embeddings else 2) * c.vocab_size * h * item + h * item
    tensors = 3
    if c.q_lora_rank is None:
        attention = linear(heads * c.qk_head_dim, h)
    else:
        attention = linear(c.q_lora_rank, h) + c.q_lora_rank * item + linear(heads * c.qk_head_dim, c.q_lora_rank)
    attention += linear(c.kv_cache_width, h) + c.kv_lora_rank * item
    attention += linear(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank) + linear(h, heads * c.v_head_dim)
    weights += c.num_hidden_layers * (attention + 2 * h * item)
    tensors += c.num_hidden_layers * 8
    moe_layers = num_moe_layers(c)
    weights += (c.num_hidden_layers - moe_layers) * mlp(h, c.intermediate_size)
    routing = 0
    if moe_layers:
        experts = c.n_routed_experts
        held = experts if physical_experts_held is None else physical_experts_held
        physical = experts if physical_experts is None else physical_experts
        router = experts * h * 4 + (experts * 4 if c.uses_correction_bias else 0)
        shared = mlp(h, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else 0
        layer_experts = held * mlp(h, c.moe_intermediate_size)
        weights += moe_layers * (router + shared + layer_experts) + layer_experts  # + one layer while stacked
        routing = moe_layers * experts * (physical - experts + 2) * 4  # log2phy and logcnt, int32
        tensors += moe_layers * 3 * experts * (2 if quantized else 1)
    table = rope_positions * c.qk_rope_head_dim * 4
    return MemoryEstimate(
        weights=weights,
        rope_table=table,
        routing=routing,
        rope_build=ROPE_BUILD_FACTOR * table,
        bookkeeping=tensors * TENSOR_BOOKKEEPING,
        rope_positions=rope_positions,
        num_tensors=tensors,
    )


def host_available() -> int | None:
    """Bytes of RAM this process can still take: MemAvailable, capped by a cgroup limit; None if unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = int(Path("/sys/fs/cgroup", limit_file).read_text())  # "max" (no limit) fails int()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text())
        except (OSError, ValueError):
            continue
        available = min(available, max(0, limit - usage))
    return available


def _mem_get_info(device: torch.device):
    """The accelerator module's mem_get_info (torch.cuda, torch.npu, ...); None for host memory."""
    return getattr(getattr(torch, device.type, None), "mem_get_info", None)


def device_total(device: torch.device) -> int | None:
    """The accelerator's memory in bytes (its module's mem_get_info); None for host memory."""
    mem_get_info = _mem_get_info(device)
    return None if mem_get_info is None else int(mem_get_info(device)[1])


def device_available(device: torch.device) -> tuple[int | None, str]:
    """Free bytes on `device` and how they were measured: the accelerator module's mem_get_info
    when it has one, else the host's available RAM."""
    mem_get_info = _mem_get_info(device)
    if mem_get_info is not None:
        free, _ = mem_get_info(device)
        return int(free), f"free on {device}"
    return host_available(), "available RAM"


def check_fits(estimate: MemoryEstimate, device: torch.device, config: ModelConfig, source: str) -> None:
    """LoadError (with the estimate) when the model cannot fit on `device`, or its loading on the host."""
    free, measured = device_available(device)
    on_host = _mem_get_info(device) is None
    checks = [(device, free, measured, estimate.parts(with_host=on_host))]
    if not on_host:
        host_parts = {"RoPE table temporaries": estimate.rope_build, "checkpoint bookkeeping": estimate.bookkeeping}
        checks.append(("the host", host_available(), "available RAM", host_parts))
    for where, free, measured, parts in checks:
        need = sum(parts.values())
        if free is None or need <= free:
            continue
        shown = ", ".join(f"{name} {gib(n)}" for name, n in sorted(parts.items(), key=lambda p: -p[1]) if n >= need // 100)
        biggest = max(parts, key=parts.get)
        if biggest.startswith("RoPE"):
            fix = f"max_position_embeddings={config.max_position_embeddings} in config.json is implausible; lower it (or pass a smaller max_model_len)"
        else:
            fix = "check config.json's sizes, or use a device with more memory or more expert-parallel ranks (--ep)"
        raise LoadError(f"{source}: loading this model needs at least {gib(need)} on {where} ({shown}), but {gib(free)} is {measured}", fix)


def gib(n: int) -> str:
    """Bytes as GiB (or MiB / TiB when that reads better)."""
    if n >= 1 << 40:
        return f"{n / (1 << 40):.1f} TiB"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"
