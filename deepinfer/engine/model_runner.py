"""Turns a scheduled batch into a ForwardBatch, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from deepinfer.device_graphs import GraphCapture
from deepinfer.engine.scheduler import ScheduledBatch
from deepinfer.engine.sequence import Sequence
from deepinfer.model.forward_batch import ForwardBatch, HostBatch

log = logging.getLogger(__name__)

GiB = 1 << 30
# Default KV budget on the CPU (capped by a quarter of the free RAM): zeroing the cache is a
# start-up cost, and the CPU runs small models; raise it with kv_cache_memory_gib / num_kv_blocks.
CPU_KV_CACHE_BYTES = GiB // 4


def kv_block_bytes(model, block_size: int, dtype: torch.dtype, draft_layers: int = 0) -> int:
    """Bytes one block takes over all layers in a cache of `dtype` (the model's own layout when it
    has one: DeepSeek-V4), and over `draft_layers` more (speculative decoding's MTP layers)."""
    if hasattr(model, "kv_block_bytes"):
        return model.kv_block_bytes(block_size, dtype, draft_layers)
    per_layer = 1
    for dim in model.kv_cache_shape(1, block_size, dtype):
        per_layer *= dim
    return per_layer * torch.empty((), dtype=dtype).element_size() * (model.num_layers + draft_layers)


def kv_cache_budget(device: torch.device, memory_info: Callable[[torch.device], tuple[int, int]] | None, memory_utilization: float) -> int:
    """Bytes the KV cache may take when the user gave no size: on an accelerator, what is free of
    the `memory_utilization` share of its memory that the engine may use (vLLM's
    gpu_memory_utilization: weights are loaded by now, so what they and anything else on the device
    hold is already taken; `memory_info`, the backend's, gives (free, total) bytes); a modest
    share of the host's RAM when the backend reports no device memory (the CPU)."""
    if memory_info is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 4 * CPU_KV_CACHE_BYTES
        return min(CPU_KV_CACHE_BYTES, available // 4)
    free, total = memory_info(device)
    return max(0, int(free - (1 - memory_utilization) * total))


class ModelRunner:
    def __init__(
        self,
        model,
        ops,
        device: torch.device,
        dtype: torch.dtype,  # the caches' (the model's, or float8_e4m3fn for an FP8 cache)
        block_size: int,
        num_blocks: int,
        *,
        graph_capture: GraphCapture | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        num_state_slots: int = 0,
        num_draft_layers: int = 0,
        max_tokens_per_seq: int = 1,
    ):
        """graph_capture: the backend's device graphs, to replay decode steps (None: every step eager).
        num_state_slots: per-sequence state the model keeps beside the paged cache (DeepSeek-V4's
        compressor windows), one slot per running sequence. max_tokens_per_seq: the most rows a
        sequence brings to a decode step (speculative verification: 1 + k)."""
        self.model = model
        self.ops = ops
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        if hasattr(model, "new_caches"):  # a model with its own cache layout (DeepSeek-V4)
            self.kv_caches = model.new_caches(num_blocks, block_size, num_state_slots, dtype, lookahead=max_tokens_per_seq - 1)
        else:
            shape = model.kv_cache_shape(num_blocks, block_size, dtype)
            self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        # the draft model's layers (speculative decoding: MTP), paged like the target's, same block tables
        if hasattr(model, "new_draft_caches"):  # laid out as the model's own layers (DeepSeek-V4)
            self.draft_kv_caches = model.new_draft_caches(num_draft_layers, num_blocks, block_size, num_state_slots, dtype, lookahead=max_tokens_per_seq - 1)
        else:
            self.draft_kv_caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size, dtype), dtype=dtype, device=device)
                                    for _ in range(num_draft_layers)]  # fmt: skip
        self.graphs = None
        if graph_capture is not None and getattr(model, "supports_device_graphs", True):
            from deepinfer.engine.decode_graphs import DecodeGraphs

            # a verification's padding rows may reach max_tokens_per_seq - 1 positions past the model's length
            max_blocks = -(-(max_model_len + max_tokens_per_seq - 1) // block_size)
            self.graphs = DecodeGraphs(model, ops, self.kv_caches, device, max_num_seqs, max_blocks, graph_capture, max_tokens_per_seq)

    def tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the device (copied without waiting)."""
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Sequence]]:
        """The ForwardBatch for this step, and the sequences that sample a token (in logits order)."""
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        tokens = [seq.token_ids[start : start + n] for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens)]
        logits_rows, samplers, end = [], [], 0
        for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens):
            end += n
            if start + n == seq.num_tokens:  # its last token is computed: it samples the next one
                logits_rows.append(end - 1)
                samplers.append(seq)
        return self._forward_batch(batch.seqs, starts, tokens, batch.is_prefill, logits_rows), samplers

    def rows_batch(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]], *, last_only: bool = False) -> ForwardBatch:
        """A decode-path ForwardBatch over given tokens (speculative steps: drafts are not in
        seq.token_ids): sequence b's tokens[b] at positions starts[b], starts[b] + 1, ...; its cache
        then holds starts[b] + len(tokens[b]) tokens. Logits of every row, or of each sequence's
        last row (last_only)."""
        logits_rows, end = [], 0
        for ids in tokens:
            logits_rows.extend([end + len(ids) - 1] if last_only else range(end, end + len(ids)))
            end += len(ids)
        return self._forward_batch(seqs, starts, tokens, False, logits_rows)

    def forward_rows(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's float32 logits and final hidden states at every row of `tokens` (sequence b's
        tokens[b] at positions starts[b], ...: a speculative verification), in their order. By a
        device graph of the step's padded shape (every sequence padded to the longest one's rows)
        when the backend has graphs, else eagerly."""
        per_seq = max(len(ids) for ids in tokens)
        graphs = self.graphs
        if graphs is None or not graphs.rows_replayable(len(seqs), per_seq):
            return self.model.forward(self.rows_batch(seqs, starts, tokens), self.kv_caches, hidden_states=True)
        padded = self._forward_batch(seqs, starts, tokens, False, [], pad_to=per_seq)
        logits, hidden = graphs.run_rows(padded, per_seq)
        if all(len(ids) == per_seq for ids in tokens):
            return logits, hidden
        real = self.tensor([b * per_seq + i for b, ids in enumerate(tokens) for i in range(len(ids))], torch.int64)
        return logits[real], hidden[real]

    def _forward_batch(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]], is_prefill: bool, logits_rows: list[int],
                       pad_to: int | None = None) -> ForwardBatch:  # fmt: skip
        """Sequence b's tokens[b] at positions starts[b], ..., written to their cache slots; logits of `logits_rows`.
        pad_to: every sequence brings this many rows, its own then padding ones (token 0 at its last
        position, written nowhere; the causal mask hides them from its own rows), and every row's logits."""
        bs = self.block_size
        positions, slots, cu_seqlens, seq_lens = [], [], [0], []
        for seq, start, ids in zip(seqs, starts, tokens):
            end = start + len(ids)
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if pad_to is not None:
                padding = pad_to - len(ids)
                positions.extend([end - 1] * padding)
                slots.extend([-1] * padding)
                end = start + pad_to
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            seq_lens.append(end)
        if pad_to is not None:
            tokens = [ids + [0] * (pad_to - len(ids)) for ids in tokens]
            logits_rows = list(range(len(seqs) * pad_to))
        lengths = [len(ids) for ids in tokens]
        host = HostBatch(
            starts=list(starts),
            lengths=lengths,
            cached=[seq.num_cached_kv for seq in seqs],
            slots=[seq.state_slot for seq in seqs],
            pages=[seq.block_table for seq in seqs],
        )
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        return ForwardBatch(
            is_prefill=is_prefill,
            input_ids=self.tensor([t for ids in tokens for t in ids], torch.int64),
            positions=self.tensor(positions, torch.int64),
            slot_mapping=self.tensor(slots, torch.int64),
            cu_seqlens_q=self.tensor(cu_seqlens, torch.int32),
            seq_lens=self.tensor(seq_lens, torch.int32),
            block_tables=self.tensor(tables, torch.int32),
            logits_indices=self.tensor(logits_rows, torch.int64),
            max_query_len=max(lengths),
            max_seq_len=max(seq_lens),
            host=host,
        )

    def replayable(self, batch: ScheduledBatch) -> bool:
        """Whether this step would replay a captured device graph: a decode step (one new token per
        sequence) of a batch size some graph covers."""
        return (self.graphs is not None and not batch.is_prefill and all(n == 1 for n in batch.num_new_tokens)
                and self.graphs.bucket(len(batch.seqs)) is not None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, use_graphs: bool = True, graph_size: int | None = None) -> tuple[list[Sequence], list[int]]:
        """One forward step; returns the sequences that sampled and their new tokens. use_graphs=False
        runs a replayable step eagerly (expert parallelism: another rank's step is not replayable);
        graph_size: the graph to replay (expert parallelism: the step's, on every rank)."""
        samplers, tokens = self.launch(batch, use_graphs, graph_size)
        return samplers, tokens.tolist()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, use_graphs: bool = True, graph_size: int | None = None,
               inputs_from: tuple[list[int], list[int], torch.Tensor] | None = None) -> tuple[list[Sequence], torch.Tensor]:  # fmt: skip
        """`run` without waiting: the new tokens stay a device tensor, queued behind the step.
        inputs_from (rows, sources, tokens): input rows taken from a device tensor, input_ids[rows[i]] =
        tokens[sources[i]] (overlap scheduling: the step before's tokens, not on the host yet)."""
        forward_batch, samplers = self.prepare(batch)
        if inputs_from is not None:
            rows, sources, tokens = inputs_from
            forward_batch.input_ids.index_copy_(0, self.tensor(rows, torch.int64), tokens.index_select(0, self.tensor(sources, torch.int64)))
        graphs = self.graphs
        if use_graphs and self.replayable(batch) and len(samplers) == forward_batch.num_seqs == forward_batch.input_ids.shape[0]:
            return samplers, graphs.run(forward_batch, self.sampling_tensors(samplers), graph_size)
        logits = self.model.forward(forward_batch, self.kv_caches)
        if not samplers:
            return [], torch.empty(0, dtype=torch.int64, device=self.device)
        return samplers, self.ops.sample(logits=logits.float(), **self.sampling_tensors(samplers))

    @torch.inference_mode()
    def run_idle(self) -> None:
        """A step with no tokens on this rank: the MoE layers still join their collectives."""
        self.model.forward_idle()

    def sampling_tensors(self, samplers: list[Sequence]) -> dict[str, torch.Tensor]:
        """`sample`'s per-row arguments for these sequences' next tokens."""
        params = [seq.params for seq in samplers]
        return dict(
            temperature=self.tensor([p.temperature for p in params], torch.float32),
            top_k=self.tensor([max(p.top_k, 0) for p in params], torch.int32),
            top_p=self.tensor([p.top_p for p in params], torch.float32),
            min_p=self.tensor([p.min_p for p in params], torch.float32),
            seeds=self.tensor([seq.seed for seq in samplers], torch.int64),
            positions=self.tensor([seq.num_tokens for seq in samplers], torch.int64),  # where the new token goes
        )
