"""Turns a scheduled batch into a ForwardBatch, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.device_graphs import GraphCapture
from deepinfer.engine.host_staging import flat_ints, padded_rows, to_device, token_slots
from deepinfer.engine.logits_processing import LogitsProcessing, needs_processing
from deepinfer.engine.logprobs import LogprobRows, TokenLogprobs
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


def samples_eagerly(seq: Sequence) -> bool:
    """Whether seq's next token is sampled outside the whole-step device graph: its logits are
    processed (deepinfer.engine.logits_processing) or its logprobs gathered."""
    return seq.params.logprobs is not None or needs_processing(seq)


@dataclass
class StepRows:
    """A step's ForwardBatch and what its logits rows are for: the samplers' rows, and rows whose
    logits give prompt logprobs (position p predicts prompt token p + 1)."""

    forward_batch: ForwardBatch
    samplers: list[Sequence]
    input_rows: list[int]  # per sampler, its last input row (its newest token)
    sample_select: list[int] | None = None  # the samplers' positions among the logits rows (None: all of them, in order)
    prompt_select: list[int] = field(default_factory=list)  # positions among the logits rows of prompt-logprob rows
    prompt_targets: list[int] = field(default_factory=list)  # the prompt token each of them predicts
    prompt_owners: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, the target's index in its prompt)


@dataclass
class LaunchedStep:
    """A launched step's results, on the device: the samplers' new tokens and, for the rows that
    asked, their logprobs (owners: sampler indices) and prompt logprobs (owners: StepRows.prompt_owners)."""

    samplers: list[Sequence]
    tokens: torch.Tensor
    logprobs: LogprobRows | None = None
    prompt_logprobs: LogprobRows | None = None


@dataclass
class PendingSample:
    """A launched step's forward whose sampling is still to come (`ModelRunner.launch_forward`):
    its rows and the model's float32 logits at its logits rows, on the device."""

    rows: StepRows
    logits: torch.Tensor


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
        vocab_size: int | None = None,
        processed_logprobs: bool = False,
        pin_host_buffers: bool = False,
    ):
        """graph_capture: the backend's device graphs, to replay decode steps (None: every step eager).
        num_state_slots: per-sequence state the model keeps beside the paged cache (DeepSeek-V4's
        compressor windows), one slot per running sequence. max_tokens_per_seq: the most rows a
        sequence brings to a decode step (speculative verification: 1 + k). vocab_size: the logits'
        width (the penalty history's; default: the model's vocab_size). processed_logprobs: logprobs
        of the processed rows over temperature (logprobs_mode "processed_logprobs"), else of the raw rows.
        pin_host_buffers: the device runs behind the host, so host tensors it reads (step inputs, grammar masks) are pinned."""
        self.model = model
        # DeepSeek-V4.1's bounded replay: a sequence's first decoder position, from its prompt's length
        self.decoder_replay_start = getattr(model, "decoder_replay_start", None)
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
        self.pin_host_buffers = pin_host_buffers
        self.processing = LogitsProcessing(ops, device, vocab_size or model.vocab_size, max_num_seqs, pin_host_buffers)
        self.processed_logprobs = processed_logprobs
        self.graphs = None
        if graph_capture is not None and getattr(model, "supports_device_graphs", True):
            from deepinfer.engine.decode_graphs import DecodeGraphs

            # a verification's padding rows may reach max_tokens_per_seq - 1 positions past the model's length
            max_blocks = -(-(max_model_len + max_tokens_per_seq - 1) // block_size)
            # the model may capture fewer rows per sequence (DeepSeek-V4: decode steps only); larger steps run eagerly
            graph_tokens = min(max_tokens_per_seq, getattr(model, "device_graph_tokens_per_seq", None) or max_tokens_per_seq)
            self.graphs = DecodeGraphs(model, ops, self.kv_caches, device, max_num_seqs, max_blocks, graph_capture, graph_tokens)

    def tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the device (copied without waiting)."""
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def tensors(self, *fields: tuple[list, torch.dtype]) -> list[torch.Tensor]:
        """Host lists (values, dtype) as device tensors through one copy (engine/host_staging.py)."""
        return to_device(list(fields), self.device, self.pin_host_buffers)

    def step_rows(self, batch: ScheduledBatch) -> StepRows:
        """The step's ForwardBatch, its samplers (in logits order) and its prompt-logprob rows."""
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        tokens = [seq.token_ids[start : start + n] for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens)]
        logits_rows, samplers, input_rows, sample_select = [], [], [], []
        prompt_select, prompt_targets, prompt_owners = [], [], []
        end = 0
        for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens):
            first, end = end, end + n
            if batch.is_prefill and seq.prompt_logprobs is not None:
                # position p's logits predict prompt token p + 1; targets already gathered are skipped
                for p in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_select.append(len(logits_rows))
                    logits_rows.append(first + p - start)
                    prompt_targets.append(seq.token_ids[p + 1])
                    prompt_owners.append((seq, p + 1))
            if start + n == seq.num_tokens:  # its last token is computed: it samples the next one
                sample_select.append(len(logits_rows))
                logits_rows.append(end - 1)
                samplers.append(seq)
                input_rows.append(end - 1)
        forward_batch = self._forward_batch(batch.seqs, starts, tokens, batch.is_prefill, logits_rows)
        if not prompt_select:
            return StepRows(forward_batch, samplers, input_rows)
        return StepRows(forward_batch, samplers, input_rows, sample_select, prompt_select, prompt_targets, prompt_owners)

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
        tables = padded_rows([seq.block_table for seq in seqs])
        if pad_to is None:
            lengths = [len(ids) for ids in tokens]
            positions, slots = token_slots(starts, lengths, [seq.block_table for seq in seqs], tables, bs)
        else:  # (speculative steps' padded graphs: a few rows each)
            positions, slots = [], []
            for seq, start, ids in zip(seqs, starts, tokens):
                end = start + len(ids)
                positions.extend(range(start, end))
                slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
                positions.extend([end - 1] * (pad_to - len(ids)))
                slots.extend([-1] * (pad_to - len(ids)))
            tokens = [ids + [0] * (pad_to - len(ids)) for ids in tokens]
            logits_rows = list(range(len(seqs) * pad_to))
            lengths = [pad_to] * len(seqs)
        seq_lens = [start + n for start, n in zip(starts, lengths)]
        cu_seqlens = [0]
        for n in lengths:
            cu_seqlens.append(cu_seqlens[-1] + n)
        host = HostBatch(
            starts=list(starts),
            lengths=lengths,
            cached=[seq.num_cached_kv for seq in seqs],
            slots=[seq.state_slot for seq in seqs],
            pages=[seq.block_table for seq in seqs],
            decoder_from=self._decoder_from(seqs),
            upload=lambda fields: to_device(fields, self.device, self.pin_host_buffers),
        )
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens_t, block_tables, logits_indices, state_slots = self.tensors(
            (flat_ints(tokens), torch.int64), (positions, torch.int64), (slots, torch.int64), (cu_seqlens, torch.int32),
            (seq_lens, torch.int32), (tables, torch.int32), (logits_rows, torch.int64), (host.slots, torch.int32),
        )  # fmt: skip
        return ForwardBatch(
            is_prefill=is_prefill,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens_t,
            block_tables=block_tables,
            logits_indices=logits_indices,
            max_query_len=max(lengths),
            max_seq_len=max(seq_lens),
            host=host,
            state_slots=state_slots,
        )

    def _decoder_from(self, seqs: list[Sequence]) -> list[int] | None:
        """Each sequence's first position the model's decoder layers compute (DeepSeek-V4.1's bounded replay), fixed
        by its prompt's length so that chunks, preemption and prefix hits compute the rows one prefill would; 0
        for a request that wants its prompt's logprobs (they need every position's logits). None: no such model."""
        if self.decoder_replay_start is None:
            return None
        return [0 if seq.prompt_logprobs is not None else self.decoder_replay_start(seq.num_prompt_tokens) for seq in seqs]

    def replayable(self, batch: ScheduledBatch) -> bool:
        """Whether this step would replay a captured device graph: a decode step (one new token per
        sequence) of a batch size some graph covers, in which no sequence processes its logits or
        gathers logprobs (the graphs hold no buffers for their inputs: `forward_replayable`)."""
        return (self.graphs is not None and not batch.is_prefill and all(n == 1 for n in batch.num_new_tokens)
                and self.graphs.bucket(len(batch.seqs)) is not None and not any(samples_eagerly(seq) for seq in batch.seqs))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, use_graphs: bool = True, graph_size: int | None = None
            ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:  # fmt: skip
        """One forward step; returns the sequences that sampled, their new tokens and, per sampler,
        the new token's TokenLogprobs record (None unless it asked for logprobs). Prompt logprobs
        gathered in the step go straight into their sequences. use_graphs=False runs a replayable
        step eagerly (expert parallelism: another rank's step is not replayable); graph_size: the
        graph to replay (expert parallelism: the step's, on every rank)."""
        return self.collect(self.launch(batch, use_graphs, graph_size))

    def collect(self, step: LaunchedStep) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """A launched step's results on the host: its prompt logprobs filed into their sequences; its
        samplers, the tokens of its rows and, per row, the TokenLogprobs record (None unless asked)."""
        if step.prompt_logprobs is not None:
            for (seq, index), record in step.prompt_logprobs.to_host().records():
                assert index == len(seq.prompt_logprobs), f"{seq}: prompt logprob {index} arrives after {len(seq.prompt_logprobs)}"
                seq.prompt_logprobs.append(record)
        records: list[TokenLogprobs | None] = [None] * step.tokens.shape[0]
        if step.logprobs is not None:
            for row, record in step.logprobs.to_host().records():
                records[row] = record
        return step.samplers, step.tokens.tolist(), records

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, use_graphs: bool = True, graph_size: int | None = None,
               inputs_from: tuple[list[int], list[int], torch.Tensor] | None = None) -> LaunchedStep:  # fmt: skip
        """`run` without waiting: the new tokens (and logprobs) stay device tensors, queued behind the
        step. inputs_from (rows, sources, tokens): input rows taken from a device tensor,
        input_ids[rows[i]] = tokens[sources[i]] (overlap scheduling: the step before's tokens, not
        on the host yet)."""
        rows = self._step_inputs(batch, inputs_from)
        if use_graphs and self.replayable(batch) and self._one_row_each(rows):
            return LaunchedStep(rows.samplers, self.graphs.run(rows.forward_batch, self.sampling_tensors(rows.samplers), graph_size))
        return self.sample_step(rows, self._logits(batch, rows, use_graphs))

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch, inputs_from: tuple[list[int], list[int], torch.Tensor] | None = None) -> PendingSample:
        """The first half of `launch`: the step's forward only (the forward-only graph where it
        replays, else eager), its logits left on the device unsampled; `sample_pending` finishes
        it. Overlap scheduling of grammar steps: the masks are filled once the step before's
        tokens have advanced the matchers, while the device runs this forward."""
        rows = self._step_inputs(batch, inputs_from)
        return PendingSample(rows, self._logits(batch, rows, True))

    @torch.inference_mode()
    def sample_pending(self, pending: PendingSample) -> LaunchedStep:
        """The second half of `launch_forward`: the step's logits processed and sampled (`sample_step`)."""
        return self.sample_step(pending.rows, pending.logits)

    def _step_inputs(self, batch: ScheduledBatch, inputs_from: tuple[list[int], list[int], torch.Tensor] | None) -> StepRows:
        """The step's rows (`step_rows`), the inputs taken from a device tensor copied in (`launch`'s inputs_from)."""
        rows = self.step_rows(batch)
        if inputs_from is not None:
            into, sources, tokens = inputs_from
            rows.forward_batch.input_ids.index_copy_(0, self.tensor(into, torch.int64), tokens.index_select(0, self.tensor(sources, torch.int64)))
        return rows

    @staticmethod
    def _one_row_each(rows: StepRows) -> bool:
        forward_batch = rows.forward_batch
        return len(rows.samplers) == forward_batch.num_seqs == forward_batch.input_ids.shape[0]

    def _logits(self, batch: ScheduledBatch, rows: StepRows, use_graphs: bool) -> torch.Tensor:
        """The model's float32 logits at the step's logits rows: by the forward-only graph where it
        replays (only the sampling then runs eagerly), else eagerly."""
        if use_graphs and self._one_row_each(rows) and self.forward_replayable(batch):
            return self.graphs.run_rows(rows.forward_batch, 1)[0]
        return self.model.forward(rows.forward_batch, self.kv_caches).float()

    def forward_replayable(self, batch: ScheduledBatch) -> bool:
        """Whether this decode step's forward would replay a forward-only graph (a step whose logits
        are processed or whose logprobs are gathered: it samples eagerly from the graph's logits).
        Not under expert parallelism, whose ranks capture and replay only whole-step graphs together."""
        return (self.graphs is not None and not batch.is_prefill and all(n == 1 for n in batch.num_new_tokens)
                and self.graphs.rows_replayable(len(batch.seqs), 1))

    def sample_step(self, rows: StepRows, logits: torch.Tensor) -> LaunchedStep:
        """An eager step's results from the model's float32 logits at its logits rows: the prompt
        logprobs, then the samplers' tokens (`sample_rows`)."""
        samplers = rows.samplers
        prompt_logprobs = None
        if rows.prompt_select:
            prompt_logprobs = LogprobRows.gather(
                self.ops, logits.index_select(0, self.tensor(rows.prompt_select, torch.int64)), self.tensor(rows.prompt_targets, torch.int64),
                rows.prompt_owners, [seq.params.prompt_logprobs for seq, _ in rows.prompt_owners],
            )  # fmt: skip
        if not samplers:
            return LaunchedStep([], torch.empty(0, dtype=torch.int64, device=self.device), prompt_logprobs=prompt_logprobs)
        if rows.sample_select is not None:
            logits = logits.index_select(0, self.tensor(rows.sample_select, torch.int64))
        sampling = self.sampling_tensors(samplers)
        all_greedy = all(seq.params.temperature == 0 for seq in samplers)  # known here: the backend skips the filters' passes
        tokens, logprobs = self.sample_rows(logits, samplers, rows.input_rows, rows.forward_batch.input_ids,
                                            lambda x: self.ops.sample(logits=x, **sampling, all_greedy=all_greedy))  # fmt: skip
        return LaunchedStep(samplers, tokens, logprobs, prompt_logprobs)

    def sample_rows(self, logits: torch.Tensor, samplers: list[Sequence], input_rows: list[int], input_ids: torch.Tensor,
                    draw: Callable[[torch.Tensor], torch.Tensor], drafts: list[list[int]] | None = None
                    ) -> tuple[torch.Tensor, LogprobRows | None]:  # fmt: skip
        """The samplers' tokens from their float32 logits rows [R, V]: processed in place
        (deepinfer.engine.logits_processing; input_rows, input_ids: as LogitsProcessing.plan and
        apply take them), drawn by draw(logits) -> [R] int64, counted into the penalty history; and
        for the samplers that ask, the logprobs of their raw rows (owners: row indices). One row per
        sampler, or with drafts (a speculative verification) sampler b's 1 + len(drafts[b])
        consecutive rows, row i's history being b's tokens then drafts[b][:i]; draw may then leave a
        row without a token (-1, after a rejected draft): nothing is counted for it, and its logprobs
        (gathered for token 0) are for the caller to drop."""
        per_seq = [1] * len(samplers) if drafts is None else [1 + len(d) for d in drafts]
        processing = self.processing.plan(samplers, input_rows, drafts)
        first = 0
        wanted, num_top = [], []
        for seq, n in zip(samplers, per_seq):
            if seq.params.logprobs is not None:
                wanted.extend(range(first, first + n))
                num_top.extend([seq.params.logprobs] * n)
            first += n
        everything = len(wanted) == logits.shape[0]
        source = None
        if wanted and not self.processed_logprobs:  # the model's own logits: copied before the processing changes them in place
            source = logits if processing is None and everything else logits.index_select(0, self.tensor(wanted, torch.int64))
        if processing is not None:
            self.processing.apply(logits, processing, input_ids)
        if wanted and self.processed_logprobs:  # the distribution sampled from: processed, over temperature (greedy: 1)
            rows = logits if everything else logits.index_select(0, self.tensor(wanted, torch.int64))
            temperature = [t if t > 0 else 1.0 for t in self._row_temperatures(samplers, per_seq, wanted)]
            source = rows / self.tensor(temperature, torch.float32)[:, None]
        tokens = draw(logits)
        if processing is not None:
            self.processing.after_sampling(processing, tokens)
        logprobs = None
        if wanted:
            chosen = tokens if everything else tokens.index_select(0, self.tensor(wanted, torch.int64))
            logprobs = LogprobRows.gather(self.ops, source, chosen.clamp(min=0), wanted, num_top)
        return tokens, logprobs

    @staticmethod
    def _row_temperatures(samplers: list[Sequence], per_seq: list[int], rows: list[int]) -> list[float]:
        """The temperature of each of `rows` (rows of the samplers' per_seq consecutive rows each)."""
        by_row = [seq.params.temperature for seq, n in zip(samplers, per_seq) for _ in range(n)]
        return [by_row[r] for r in rows]

    @torch.inference_mode()
    def run_idle(self) -> None:
        """A step with no tokens on this rank: the MoE layers still join their collectives."""
        self.model.forward_idle()

    def sampling_tensors(self, samplers: list[Sequence]) -> dict[str, torch.Tensor]:
        """`sample`'s per-row arguments for these sequences' next tokens."""
        params = [seq.params for seq in samplers]
        names = ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")
        return dict(zip(names, self.tensors(
            ([p.temperature for p in params], torch.float32),
            ([max(p.top_k, 0) for p in params], torch.int32),
            ([p.top_p for p in params], torch.float32),
            ([p.min_p for p in params], torch.float32),
            ([seq.seed for seq in samplers], torch.int64),
            ([seq.num_tokens for seq in samplers], torch.int64),  # where the new token goes
        )))  # fmt: skip
