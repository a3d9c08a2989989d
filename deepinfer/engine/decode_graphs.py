"""Device graphs for decode steps: one graph per padded batch size, replayed instead of launching.

A decode step of a MoE model launches hundreds of small kernels; replaying a captured graph removes
the launch gaps. Every decode-path op runs without host synchronisation, so the whole step (model
forward and sampling) is captured. Inputs live in static buffers of the largest batch; a batch of
n sequences runs the graph of the smallest bucket >= n, with padding rows that write no KV
(slot -1), own no state slot (-1) and read one cached token.

A decode step whose logits are processed (penalties, logit bias, grammar masks, ...) or whose
logprobs are gathered cannot sample inside a graph (the graphs hold no buffers for those inputs):
it replays the forward-only graph of its bucket (`run_rows` with one row per sequence) and samples
eagerly from the graph's logits, so that only the sampling, not the whole model, leaves the graph.

Speculative verification steps (every sequence brings 1 + k tokens: its last token and k drafts)
replay such forward-only graphs too, one per (padded batch size, tokens per sequence S): a sequence that
verifies fewer drafts than the step's S is padded with rows that write no KV; causal attention
keeps its real rows' outputs from seeing them. These graphs return the logits and final hidden
states of every row (verification samples outside the graph, over the real rows only). A model may
capture fewer rows per sequence than the engine's steps bring (`device_graph_tokens_per_seq`:
DeepSeek-V4 plans only decode steps on the device); larger steps then run eagerly.

The graphs are the backend's (BackendSpec.graph_capture: CUDA graphs on the cuda backend); this
runner names no device API, and the engine builds it only for a backend that declares one.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.device_graphs import Graph, GraphCapture
from deepinfer.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


WARMUPS = 2  # eager forwards before a capture


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(
        self, model, ops, kv_caches: list[torch.Tensor], device: torch.device, max_batch: int, max_blocks_per_seq: int, capture: GraphCapture,
        max_tokens_per_seq: int = 1,
    ):  # fmt: skip
        """max_tokens_per_seq: the most rows a sequence brings to a step (speculative decoding: 1 + k)."""
        self.model, self.ops, self.kv_caches, self.device = model, ops, kv_caches, device
        self.api = capture
        self.buckets = batch_buckets(max_batch)
        self.max_tokens_per_seq = max_tokens_per_seq
        n, w, rows = max_batch, max_blocks_per_seq, max_batch * max_tokens_per_seq

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(rows, dtype=torch.int64)
        self.positions = zeros(rows, dtype=torch.int64)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.int32, device=device)  # the models that keep per-sequence state read them
        self.block_tables = zeros(n, w, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.temperature = zeros(n, dtype=torch.float32)
        self.top_k = zeros(n, dtype=torch.int32)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.min_p = zeros(n, dtype=torch.float32)
        self.seeds = zeros(n, dtype=torch.int64)
        self.sample_positions = zeros(n, dtype=torch.int64)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.row_graphs: dict[tuple[int, int], tuple[Graph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = capture.new_pool(device)
        self.collective = False  # expert parallelism: no capture on demand (only all ranks together)

    def capture(self, size: int) -> None:
        """Capture the graph of `size` now (WARMUPS eager forwards, then the captured one). With
        expert parallelism every rank captures the same size in the same step (the warm-up forwards
        run the MoE collectives), so every rank holds the same graphs, whose exchanges use the
        same symmetric buffers."""
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _batch(self, size: int, per_seq: int) -> ForwardBatch:
        rows = size * per_seq
        return ForwardBatch(
            is_prefill=False,
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1] * per_seq if per_seq > 1 else self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            logits_indices=self.logits_indices[:rows],
            max_query_len=per_seq,
            state_slots=self.state_slots[:size],
        )

    def _step(self, size: int) -> torch.Tensor:
        logits = self.model.forward(self._batch(size, 1), self.kv_caches)
        return self.ops.sample(
            logits=logits.float(),
            temperature=self.temperature[:size],
            top_k=self.top_k[:size],
            top_p=self.top_p[:size],
            min_p=self.min_p[:size],
            seeds=self.seeds[:size],
            positions=self.sample_positions[:size],
        )

    def _capture(self, size: int) -> tuple[Graph, torch.Tensor]:
        # WARMUPS eager steps first (Triton compiles, allocators settle), then the captured one.
        graph, tokens = self.api.capture(lambda: self._step(size), device=self.device, pool=self.pool, warmups=WARMUPS)
        log.info("captured a device graph for decode batches of %d", size)
        return graph, tokens

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, sampling: dict[str, torch.Tensor], size: int | None = None) -> torch.Tensor:
        """Tokens for a decode batch of n sequences with one new token each (n <= max_batch), by the
        graph of `size` rows (default: the smallest bucket that holds n; expert parallelism: the
        step's, the same on every rank), the rest padding."""
        n = fb.num_seqs
        size = size or self.bucket(n)
        self._load(fb, n)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds"):
            getattr(self, name)[:n].copy_(sampling[name])
        self.sample_positions[:n].copy_(sampling["positions"])
        return self._replay(n, size)[:n]

    def _load(self, fb: ForwardBatch, n: int) -> None:
        """fb's rows and its n sequences into the static buffers' first rows."""
        rows, w = fb.input_ids.shape[0], fb.block_tables.shape[1]
        self.input_ids[:rows].copy_(fb.input_ids)
        self.positions[:rows].copy_(fb.positions)
        self.slot_mapping[:rows].copy_(fb.slot_mapping)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.block_tables[:n, :w].copy_(fb.block_tables)
        self.block_tables[:n, w:].zero_()
        if fb.state_slots is not None:
            self.state_slots[:n].copy_(fb.state_slots)
        else:
            self.state_slots[:n].fill_(-1)

    def rows_replayable(self, n: int, per_seq: int) -> bool:
        """Whether a step of n sequences with per_seq rows each has a graph (captured or to capture)."""
        return self.bucket(n) is not None and per_seq <= self.max_tokens_per_seq and not self.collective

    @torch.inference_mode()
    def run_rows(self, fb: ForwardBatch, per_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits and final hidden states of every row of a step whose n sequences bring
        per_seq rows each (fb: padded so by `ModelRunner.forward_rows`), by the graph of
        (the smallest bucket that holds n, per_seq): [n * per_seq, vocab], [n * per_seq, hidden]."""
        n = fb.num_seqs
        size, rows = self.bucket(n), n * per_seq
        self._load(fb, n)
        self.slot_mapping[rows : size * per_seq].fill_(-1)  # padding sequences write nothing
        self.seq_lens[n:size].fill_(per_seq)  # and each of their rows reads at least one (harmless) cached token
        self.block_tables[n:size].zero_()
        self.state_slots[n:size].fill_(-1)  # and own no per-sequence state
        self.capture_rows(size, per_seq)
        graph, (logits, hidden) = self.row_graphs[(size, per_seq)]
        graph.replay()
        return logits[:rows], hidden[:rows]

    def capture_rows(self, size: int, per_seq: int) -> None:
        """Capture the forward-only graph of `size` sequences x `per_seq` rows now, unless it is."""
        if (size, per_seq) not in self.row_graphs:
            self.row_graphs[(size, per_seq)] = self.api.capture(
                lambda: self.model.forward(self._batch(size, per_seq), self.kv_caches, hidden_states=True), device=self.device, pool=self.pool,
                warmups=WARMUPS,
            )  # fmt: skip
            log.info("captured a device graph for steps of %d sequences x %d rows", size, per_seq)

    @torch.inference_mode()
    def run_padding(self, size: int) -> None:
        """Replay the graph of `size` with padding rows only (expert parallelism: a rank without
        work in a graph step joins the MoE collectives of the others' graphs)."""
        self._replay(0, size)

    def _replay(self, n: int, size: int) -> torch.Tensor:
        self.slot_mapping[n:size].fill_(-1)  # padding rows write nothing
        self.seq_lens[n:size].fill_(1)  # and read one (harmless) cached token
        self.block_tables[n:size].zero_()
        self.state_slots[n:size].fill_(-1)  # and own no per-sequence state
        self.temperature[n:size].zero_()  # padding rows sample greedily
        if size not in self.graphs:
            if self.collective:
                raise RuntimeError(
                    f"no device graph for decode batches of {size}: "
                    "with expert parallelism every rank captures it in the same step (distributed.lockstep.LockstepRunner.run)"
                )
            self.graphs[size] = self._capture(size)
        graph, tokens = self.graphs[size]
        graph.replay()
        return tokens
