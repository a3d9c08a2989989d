"""LLMEngine: requests in, one scheduler step at a time, finished requests out.

With expert parallelism (a DistContext) the engine runs this rank's requests, and its steps are
driven in lockstep with the other ranks by deepinfer.distributed (step_agreement: what the ranks
agree on; lockstep: one rank's part of the agreed step, through `schedule`, `before_step` and
`execute`). EPLB during the run is deepinfer.distributed.eplb_schedule, called from `before_step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.block_manager import BlockManager, blocks_for
from deepinfer.engine.grammar_wait import GrammarWait
from deepinfer.engine.logprobs import position_logprobs
from deepinfer.engine.memory_check import EngineSizes, check_engine_memory, seq_device_bytes
from deepinfer.engine.model_runner import GiB, ModelRunner, kv_block_bytes, kv_cache_budget
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.parallel_samples import add_samples, finished_requests, release_held_back
from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.engine.state_snapshots import SNAPSHOT_SHARE, StateSnapshots, snapshot_capacity
from deepinfer.engine.token_constraints import check_token_options, token_constraints
from deepinfer.ops import kv_cache_format

log = logging.getLogger(__name__)


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    # per-step token budget: longer prompts prefill in chunks; None: from the device (engine/step_budget.py: vLLM's offline rule)
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None  # None: as many as kv_cache_memory_gib (or the default budget) holds
    kv_cache_memory_gib: float | None = None
    # The share of the accelerator's memory the engine may use (vLLM's gpu_memory_utilization): the
    # KV cache gets what of it is still free once the weights are loaded. Unused when
    # num_kv_blocks or kv_cache_memory_gib sizes the cache, and on the CPU (a share of the free RAM).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # requests without a seed get one derived from this and their request index
    enforce_eager: bool = False  # True: no device graphs for decode steps (on backends that have them: cuda)
    # EPLB: every this many steps, re-place the experts from the load counted since the last time
    # (all ranks together); None: the placement chosen at load time stays.
    eplb_interval: int | None = None
    # "auto": the cache in the model dtype; "fp8" (or "fp8_e4m3"): e4m3 rows with a per-token scale,
    # about half the bytes per token (deepinfer.ops.kv_cache_format)
    kv_cache_dtype: str = "auto"
    # Batch-invariant kernels only (the runtime must be opened with the same flag: LLM does it).
    deterministic: bool = False
    # Speculative decoding (deepinfer.engine.speculative): None, or what SpeculativeConfig.parse takes.
    speculative: Any = None
    # Overlap scheduling (deepinfer.engine.overlap): None: on where the backend runs asynchronously
    # (cuda, ascend) and the steps allow it (no speculation, no expert parallelism); False: off; True: on,
    # on any backend (the CPU gains nothing: tests), an error where the steps do not allow it.
    overlap: bool | None = None
    # Mixed steps: a prefill step also decodes a token of every running request (Scheduler's
    # mixed_steps). None: on unless deterministic mode or speculative decoding (a decode token on the
    # prefill path has other kernels, so its logits would depend on the step; verification steps
    # decode only); True: on, an error with those; False: off.
    mixed_steps: bool | None = None
    # What `logprobs` reports (vLLM's logprobs_mode): "raw_logprobs", the model's log-softmax before
    # any processing (vLLM's default); "processed_logprobs", the distribution sampled from: after
    # penalties, logit_bias, bans, min_tokens and temperature (not top-k/top-p/min_p truncation).
    logprobs_mode: str = "raw_logprobs"
    # Structured output: a request whose grammar has not compiled this many seconds after it was
    # added fails alone (finish_reason "error"); the compilation runs on in its thread.
    grammar_compile_timeout_s: float = 30.0
    # Structured output: compiled grammars kept for reuse by later requests (least recently used dropped).
    grammar_cache_size: int = 256
    # Structured output: the largest spec a request may give (StructuredOutputsParams.size: a schema's,
    # regex's, choice list's or grammar's bytes); larger ones are refused up front. 256 KiB holds about
    # 11k short choices; the grammars of a hostile client's 100k-string lists took llguidance most of
    # a minute to compile and then panicked it (docs/performance.md).
    max_grammar_bytes: int = 256 << 10
    # KV tiers behind the prefix cache (deepinfer.kv_tiers): blocks leaving the device pool are kept in pinned host
    # memory (GiB), in a directory (readable after a restart and by other processes; bounded by kv_offload_disk_gib,
    # default half the free space, entries expiring after kv_offload_ttl_s), and in a shared store by URL (redis://...).
    kv_offload_cpu_gib: float | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_gib: float | None = None
    kv_offload_ttl_s: float | None = None
    kv_store_url: str | None = None

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "eplb_interval", "grammar_cache_size", "max_grammar_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.deterministic, bool):
            raise InvalidRequestError(f"deterministic must be True or False, got {self.deterministic!r}")
        for name in ("overlap", "mixed_steps"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be None (auto), True or False, got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0 < utilization <= 1:
            raise InvalidRequestError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}")
        timeout = self.grammar_compile_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise InvalidRequestError(f"grammar_compile_timeout_s must be a number of seconds > 0, got {timeout!r}")
        for name in ("kv_offload_cpu_gib", "kv_offload_disk_gib", "kv_offload_ttl_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
                raise InvalidRequestError(f"{name} must be a number > 0, got {value!r}")
        for name in ("kv_offload_dir", "kv_store_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise InvalidRequestError(f"{name} must be a non-empty path or URL, got {value!r}")
        if self.kv_offload_disk_gib is not None and self.kv_offload_dir is None:
            raise InvalidRequestError("kv_offload_disk_gib sizes the disk tier: give kv_offload_dir too")
        if self.kv_offload_ttl_s is not None and self.kv_offload_dir is None and self.kv_store_url is None:
            raise InvalidRequestError("kv_offload_ttl_s is the disk tier's and shared store's entry lifetime: give kv_offload_dir or kv_store_url too")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise InvalidRequestError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        from deepinfer.engine.speculative.config import SpeculativeConfig

        self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.kv_cache_dtype not in kv_cache_format.KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(kv_cache_format.KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


def derive_seed(base_seed: int, index: int) -> int:
    """A request's sampling seed from the engine seed and its request index (fixed hash: runs repeat)."""
    digest = hashlib.blake2b(f"deepinfer-seed:{base_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _eos_ids(*values) -> frozenset[int]:
    ids = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


class LLMEngine:
    """Owns the scheduler, the block manager and the model runner for one loaded model."""

    def __init__(self, loaded, runtime, dtype: torch.dtype, config: EngineConfig | None = None, dist=None, draft_source=None, announce: bool = False):
        """dist: the run's DistContext when the experts span several ranks (attention data
        parallel: this engine runs this rank's requests; see engine/data_parallel.py).
        draft_source: with config.speculative, drafts from this instead of the checkpoint's MTP
        layer (ControlledDraft: benchmarks and tests of the verification policy).
        announce: tell the user on stderr about long start-up work (measuring speculation's step costs)."""
        self.draft_source = draft_source
        self.announce = announce
        self.config = config = config or EngineConfig()
        config.validate()
        if config.max_num_batched_tokens is None:
            from deepinfer.engine.step_budget import default_max_num_batched_tokens

            config = self.config = dataclasses.replace(config, max_num_batched_tokens=default_max_num_batched_tokens(runtime.device))
        self.dist = dist
        self.loaded = loaded
        self.runtime = runtime
        if config.deterministic != runtime.ops.deterministic:
            raise InvalidRequestError(
                f"EngineConfig(deterministic={config.deterministic}) needs a runtime opened with open_runtime(..., deterministic={config.deterministic})"
            )
        self.tokenizer = loaded.tokenizer
        self.dtype = dtype
        self.cache_dtype = kv_cache_format.cache_dtype(config.kv_cache_dtype, dtype)
        model_config = loaded.config
        self.vocab_size = int(model_config.vocab_size)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
        self.block_size = int(runtime.backend.kv_block_size)
        self.eos_token_ids = _eos_ids(
            getattr(model_config, "eos_token_ids", None),
            getattr(model_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_ids", None),
            getattr(self.tokenizer, "eos_token_id", None),
        )
        model = loaded.model
        if config.speculative is not None and config.speculative.method == "dspark" and draft_source is None:
            config = self.config = dataclasses.replace(config, speculative=config.speculative.with_block_size(self._dspark_block_size(model)))
        # Per-sequence model state beside the paged cache (DeepSeek-V4's compressor windows): one
        # slot per running sequence; a prefix hit recomputes the tokens that rebuild it (V4), or
        # restores a snapshot of the slot taken at the hit's last block (V4.1: `prefix_state_tensors`).
        self.num_state_slots = config.max_num_seqs if hasattr(model, "state_slot_bytes") else 0
        self.snapshots_wanted = config.enable_prefix_caching and hasattr(model, "prefix_state_tensors")
        self.num_draft_layers = self._draft_layers(model, dist)
        graph_capture = self._graph_capture(runtime, loaded.model, dist)
        self._check_memory(model, runtime, graph_capture is not None)  # before anything is allocated by these sizes
        num_blocks = config.num_kv_blocks or self._num_blocks_from_memory(model, runtime.device)
        self.num_state_snapshots = self._snapshot_capacity(model, num_blocks)
        self.block_manager = BlockManager(
            num_blocks, self.block_size, config.enable_prefix_caching,
            num_state_slots=self.num_state_slots, prefix_replay_tokens=getattr(model, "prefix_replay_tokens", 0),
        )  # fmt: skip
        self.runner = ModelRunner(
            loaded.model,
            runtime.ops,
            runtime.device,
            self.cache_dtype,
            self.block_size,
            num_blocks,
            graph_capture=graph_capture,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            num_state_slots=self.num_state_slots,
            num_draft_layers=self.num_draft_layers,
            max_tokens_per_seq=1 + self._draft_lookahead,
            vocab_size=self.vocab_size,
            processed_logprobs=config.logprobs_mode == "processed_logprobs",
            pin_host_buffers=runtime.async_execution,
        )
        if self.num_state_snapshots:
            tensors = model.prefix_state_tensors(self.runner.kv_caches, self.runner.draft_kv_caches)
            hit_limit = getattr(model, "prefix_hit_limit", None)
            self.block_manager.keep_snapshots(StateSnapshots(tensors, self.num_state_snapshots),
                                              (lambda seq: hit_limit(seq.num_prompt_tokens)) if hit_limit is not None else None)  # fmt: skip
        self.speculative = self._speculative_decoder(model, runtime)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   final_length=self._final_length if config.deterministic else None,
                                   lookahead=self.speculative.lookahead if self.speculative is not None else None,
                                   mixed_steps=self._mixed_steps())  # fmt: skip
        self.overlap = self._overlap_scheduler(runtime, dist)
        from deepinfer.kv_tiers.open_tiers import open_tiers

        self.tiers = self.scheduler.tiers = open_tiers(self)
        self.grammars = None  # its GrammarCompiler, made for the first request with structured_outputs
        self.grammar_wait = GrammarWait(config.grammar_compile_timeout_s)
        self._next_request_index = 0
        self._next_sample_id = -1  # seq ids of parallel samples 1..n-1 count down (request indices are >= 0)
        self.num_prompt_tokens_computed = 0  # prefill work done, recompute after preemption included
        self.num_generated_tokens = 0
        self.num_steps = 0  # forward steps run (idle ones included: equal on every rank)
        self.eplb = self._eplb_schedule(loaded.model, runtime.device, dist)  # None: the load-time placement stays
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens), %s",
            num_blocks, self.block_size, num_blocks * self.block_size, str(self.cache_dtype).removeprefix("torch."),
        )  # fmt: skip

    @property
    def _draft_lookahead(self) -> int:
        """The most positions a step writes past a sequence's last accepted token (speculation's k)."""
        return self.config.speculative.num_drafts if self.config.speculative is not None else 0

    def _mixed_steps(self) -> bool:
        """Whether prefill steps take the running requests' decode tokens too (config.mixed_steps)."""
        wanted = self.config.mixed_steps
        blocker = "deterministic mode" if self.config.deterministic else "speculative decoding" if self.speculative is not None else None
        if wanted and blocker:
            raise InvalidRequestError(
                f"mixed steps do not combine with {blocker} (a decode token on the prefill path, or a verification step, has other kernels); "
                "leave mixed_steps unset or False"
            )
        return bool(wanted or (wanted is None and not blocker))

    def _overlap_scheduler(self, runtime, dist):
        """Overlap scheduling as config.overlap asks (None: where the backend runs asynchronously)."""
        wanted = self.config.overlap
        blocker = "speculative decoding" if self.speculative is not None else "expert parallelism" if dist is not None else None
        if wanted is False or (wanted is None and (blocker or not runtime.async_execution)):
            return None
        if blocker:
            raise InvalidRequestError(f"overlap scheduling does not combine with {blocker} (its steps wait for their own tokens); leave overlap unset or False")
        from deepinfer.engine.overlap import OverlapScheduler

        return OverlapScheduler(self, async_copies=runtime.async_execution)

    @staticmethod
    def _dspark_block_size(model) -> int:
        """The tokens a DSpark block drafts; a one-line error for a model without DSpark blocks."""
        config = getattr(model, "config", None)
        if not hasattr(model, "build_dspark"):
            raise InvalidRequestError(f"speculative 'dspark' drafts with DeepSeek-V4.1's DSpark blocks; {type(model).__name__} has none "
                                      "(DeepSeek V2/V3/V4 draft with mtp:K:fixed|confidence)")  # fmt: skip
        if not config.num_nextn_predict_layers:
            raise InvalidRequestError("speculative 'dspark': this DeepSeek-V4.1 checkpoint has no DSpark blocks (text_config.num_nextn_predict_layers is 0)")
        return config.dspark_block_size

    def _draft_layers(self, model, dist) -> int:
        """The draft model's cache layers (speculative decoding with MTP: one; with DSpark: one, its context keys), checked up front."""
        if self.config.speculative is None or self.draft_source is not None:
            return 0
        if dist is not None:
            raise InvalidRequestError("speculative decoding does not run with expert parallelism (ep > 1) yet; drop one of them")
        if self.config.speculative.method == "dspark":
            model.build_dspark()
            return 1
        if not hasattr(model, "build_mtp_layers"):
            hint = " (DeepSeek-V4.1 drafts with its DSpark blocks: --speculative dspark)" if hasattr(model, "build_dspark") else ""
            raise InvalidRequestError(
                f"speculative decoding with MTP runs DeepSeek V2/V3/V4 checkpoints; {type(model).__name__} has no MTP layers to draft with{hint}"
            )
        model.build_mtp_layers()
        return 1

    def _speculative_decoder(self, model, runtime):
        spec = self.config.speculative
        if spec is None:
            return None
        from deepinfer.engine.speculative.decoder import SpeculativeDecoder
        from deepinfer.engine.speculative.dspark_drafter import DSparkDrafter
        from deepinfer.engine.speculative.mtp_drafter import MTPDrafter

        drafter = self.draft_source or (DSparkDrafter if spec.method == "dspark" else MTPDrafter)(model, self.runner)
        cost = self._cost_model(spec) if spec.policy in ("confidence", "head") else None
        return SpeculativeDecoder(spec, model, self.runner, runtime.ops, self._final_length, drafter, cost)

    def _cost_model(self, spec):
        """The confidence policy's step times: given, or this machine's fit for the model's shape
        (measured on the device the first time, then kept: deepinfer.engine.speculative.cost_cache)."""
        from deepinfer.engine.speculative.cost_model import StepCostModel

        if spec.cost_model is not None and not spec.remeasure:
            return StepCostModel.from_table(*spec.step_costs())
        from deepinfer.engine.speculative.cost_cache import cost_key, step_cost_model
        from deepinfer.engine.speculative.cost_probe import CostProbe

        probe = CostProbe(self.runner, self.loaded.model, self.block_manager, dspark=spec.method == "dspark" and self.draft_source is None)
        most = min(self.config.max_num_seqs * (spec.num_drafts + 1), self.config.max_num_batched_tokens)
        drafts = self.draft_source is None  # a draft source that runs no model costs nothing
        # first-use work per shape (kernel compiles, graph captures) needs an untimed run before every size
        warm_each_shape = self.runtime.compiles_on_first_use or self.runner.graphs is not None
        return step_cost_model(probe, cost_key(self, most, drafts), spec.remeasure, self.announce, warm_each_shape)

    def _num_blocks_from_memory(self, model, device: torch.device) -> int:
        per_block = kv_block_bytes(model, self.block_size, self.cache_dtype, self.num_draft_layers)
        if self.config.kv_cache_memory_gib is not None:
            budget = int(self.config.kv_cache_memory_gib * GiB)
        else:
            budget = kv_cache_budget(device, self.runtime.memory_info, self.config.gpu_memory_utilization)
        slots = self.num_state_slots * model.state_slot_bytes(self.num_draft_layers, self._draft_lookahead) if self.num_state_slots else 0
        enough = self.config.max_num_seqs * blocks_for(self.max_model_len, self.block_size)  # more is never used
        num_blocks = min((budget - slots) // per_block, enough)
        if self.snapshots_wanted:  # the snapshot pool's share first (`_snapshot_capacity`), then blocks in what is left
            share = min(max(0, budget - slots) * SNAPSHOT_SHARE // ((SNAPSHOT_SHARE + 1) * per_block), enough)
            snapshots = self._snapshot_capacity(model, max(1, share)) * self._snapshot_bytes(model)
            num_blocks = min((budget - slots - snapshots) // per_block, enough)
        if num_blocks < 1:
            share = self.config.kv_cache_memory_gib is None and self.runtime.memory_info is not None  # the budget came from it
            fix = f"raise gpu_memory_utilization ({self.config.gpu_memory_utilization}) or set" if share else "set"
            if slots:  # the model's per-sequence state came first
                fix = f"lower max_num_seqs ({self.config.max_num_seqs} state slots take {slots} bytes of it), or {fix}"
            raise InvalidRequestError(
                f"no memory for the KV cache: one block of {self.block_size} tokens takes {per_block} bytes, the budget is {budget}; "
                f"{fix} num_kv_blocks / kv_cache_memory_gib"
            )
        return num_blocks

    def _snapshot_bytes(self, model) -> int:
        """Bytes of one state snapshot: a copy of a state slot."""
        return model.state_slot_bytes(self.num_draft_layers, self._draft_lookahead)

    def _snapshot_capacity(self, model, num_blocks: int) -> int:
        """State snapshots kept for prefix hits (0: none, the model has nothing to snapshot or prefix caching is off):
        about a tenth of the blocks' bytes, at least one per running sequence, at most one per block
        (`state_snapshots.snapshot_capacity`); the memory budget reserves them before it sizes the blocks."""
        if not self.snapshots_wanted:
            return 0
        per_block = kv_block_bytes(model, self.block_size, self.cache_dtype, self.num_draft_layers)
        return snapshot_capacity(num_blocks, per_block, self._snapshot_bytes(model), self.config.max_num_seqs)

    def _check_memory(self, model, runtime, graphs: bool) -> None:
        """The KV cache (when num_kv_blocks sizes it; else the budget does, and it fits) and the
        per-sequence buffers against free memory (memory_check)."""
        state = model.state_slot_bytes(self.num_draft_layers, self._draft_lookahead) if self.num_state_slots else 0
        graph_row = blocks_for(self.max_model_len + self._draft_lookahead, self.block_size) if graphs else 0
        # the state snapshots, when num_kv_blocks sizes them (else the budget reserves them)
        explicit = self.config.num_kv_blocks and self.snapshots_wanted
        snapshots = self._snapshot_capacity(model, self.config.num_kv_blocks) * self._snapshot_bytes(model) if explicit else 0
        sizes = EngineSizes(
            num_kv_blocks=self.config.num_kv_blocks or 0,
            block_bytes=kv_block_bytes(model, self.block_size, self.cache_dtype, self.num_draft_layers),
            max_num_seqs=self.config.max_num_seqs,
            seq_bytes=seq_device_bytes(self.vocab_size, state, graph_row),
            snapshot_bytes=snapshots,
        )
        device_free = None
        if runtime.memory_info is not None:
            device_free = (runtime.memory_info(runtime.device)[0], f"free on {runtime.device}")
        check_engine_memory(sizes, device_free, str(runtime.device))

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def cache_bytes_held(self) -> tuple[float, int]:
        """(bytes of cache one token of a sequence's history holds, bytes a running sequence holds whatever its
        length): the model's own account when it gives one (DeepSeek-V4.1's `cache_footprint`: the stored history per
        token, the state slot), else a block's bytes per token and the per-sequence state slot."""
        model = self.loaded.model
        if hasattr(model, "cache_footprint"):
            return model.cache_footprint()
        per_token = kv_block_bytes(model, self.block_size, self.cache_dtype, self.num_draft_layers) / self.block_size
        return per_token, model.state_slot_bytes(self.num_draft_layers, self._draft_lookahead) if self.num_state_slots else 0

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None, what: str = "prompt", index: int | None = None
    ) -> Sequence:
        """Queue a request. `what` names it in error messages ("prompt 3"). `index`: its request
        index (its id, and the default seed derives from it), when the caller numbers requests
        itself (attention data parallel: the index over all ranks); default: the next one."""
        self.check_request(prompt_token_ids, params, what)
        if index is None:
            index = self._next_request_index
        self._next_request_index = max(self._next_request_index, index + 1)
        seed = params.seed if params.seed is not None else derive_seed(self.config.seed, index)
        seq = Sequence(index, prompt_token_ids, params, seed, prompt)
        seq.constraints = token_constraints(params, self.tokenizer, self.vocab_size, self.eos_token_ids)
        if params.n > 1:  # the other samples start when seq's prompt is in the cache (deepinfer.engine.parallel_samples)
            self._next_sample_id -= len(add_samples(seq, self._next_sample_id))
        if params.structured_outputs is None:
            self.scheduler.add(seq)
        else:  # queued once its grammar has compiled (deepinfer.engine.grammar_wait)
            compiler = self._grammar_compiler()
            self.grammar_wait.add(seq, compiler.submit(params.structured_outputs), compiler.release)
        return seq

    def _grammar_compiler(self):
        if self.grammars is None:
            from deepinfer.engine.grammar_compiler import GrammarCompiler

            config = self.config
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, config.grammar_cache_size, config.grammar_compile_timeout_s)
        return self.grammars

    def prepare_grammars(self):
        """Start building llguidance's view of the tokenizer off the engine thread (about a second,
        the GIL held; GrammarCompiler.prepare): a Future, or None where this engine takes no
        structured output (no llguidance, no tokenizer, expert parallelism). `deepinfer serve`
        waits for it before it takes requests, so no running request ever waits for it."""
        try:
            self._check_structured("structured_outputs")
        except InvalidRequestError:
            return None
        return self._grammar_compiler().prepare()

    def _final_length(self, seq) -> int:
        """The most tokens `seq` can reach: prompt + max_tokens, capped by the model's length."""
        return min(seq.num_prompt_tokens + (seq.params.max_tokens or self.max_model_len), self.max_model_len)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, what: str = "prompt") -> None:
        if not prompt_token_ids:
            raise InvalidRequestError(f"{what} is empty: it needs at least one token")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} has token id {bad!r}, outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{what} has {len(prompt_token_ids)} tokens; the model's maximum length is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"{what}: stop strings need a tokenizer, and this checkpoint has no tokenizer.json; use stop_token_ids", "stop")
        check_token_options(params, self.tokenizer, self.vocab_size, what, self.max_model_len)
        if params.structured_outputs is not None:
            self._check_structured(what, params.structured_outputs)
        longest = min(len(prompt_token_ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        needed = blocks_for(longest, self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"{what} needs {needed} KV blocks of {self.block_size} tokens for {longest} tokens (prompt + max_tokens), "
                f"the cache holds {self.num_kv_blocks}; raise num_kv_blocks or lower max_tokens",
                "max_tokens",
            )

    def _check_structured(self, what: str, spec=None) -> None:
        """One-line errors for structured output where this engine cannot give it, or for a spec
        over max_grammar_bytes."""
        from deepinfer.engine.grammar_source import require_llguidance

        if self.dist is not None:  # the lockstep steps (deepinfer.engine.data_parallel) do not admit requests that wait for a grammar
            raise InvalidRequestError(f"{what}: structured_outputs does not combine with expert parallelism yet; drop one of them", "structured_outputs")
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what}: structured_outputs needs a tokenizer, and this checkpoint has no tokenizer.json", "structured_outputs")
        require_llguidance()
        limit = self.config.max_grammar_bytes
        if spec is not None and spec.size() > limit:
            raise InvalidRequestError(
                f"{what}: the structured_outputs {spec.kind} is {spec.size()} bytes, too big to compile: the limit is {limit} "
                "(max_grammar_bytes, --max-grammar-bytes)",
                "structured_outputs",
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammar_wait)

    def num_waiting_sequences(self) -> int:
        """Sequences (samples) not in the running batch yet: the scheduler's queue, the samples held
        back until their request's prompt is cached, and every sample of a request waiting for its
        grammar. What a server's queue bound counts (n samples weigh n)."""
        scheduler = self.scheduler
        held_back = sum(len(seq.held_back) for queue in (scheduler.waiting, scheduler.running) for seq in queue if seq.held_back)
        return len(scheduler.waiting) + held_back + self.grammar_wait.num_samples()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (BlockManager.reset_prefix_cache): False while requests run."""
        return not self.has_unfinished() and self.block_manager.reset_prefix_cache()

    def abort(self, seq: Sequence) -> bool:
        """Drop one unfinished request, every sample of it, wherever it is (waiting for its grammar,
        queued, held back, running): its KV pages are freed now, its samples finish with
        finish_reason "abort" (vLLM's) where they had none. False, and nothing changed, when every
        sample had already finished. Between steps only (the engine is not thread-safe); with
        overlap scheduling a step in flight that holds it finishes without it, as after a stop."""
        head = seq.head
        if all(sample.status is SequenceStatus.FINISHED for sample in head.samples):
            return False
        self.grammar_wait.remove(head)
        head.held_back = []
        waiting = [sample for sample in head.samples if sample.status is SequenceStatus.WAITING]
        self.scheduler.remove_waiting(waiting)  # one pass, whatever n
        if self.tiers is not None:
            for sample in waiting:
                self.tiers.forget(sample)
        for sample in head.samples:
            if sample.status is SequenceStatus.RUNNING:
                self.scheduler.finish(sample)
            if sample.status is not SequenceStatus.FINISHED or sample.finish_reason is None:
                sample.status = SequenceStatus.FINISHED
                sample.finish_reason = sample.finish_reason or "abort"
            if self.speculative is not None:
                self.speculative.forget(sample)
        return True

    def abort_all(self) -> None:
        """Drop every unfinished request (a caller stopped iterating)."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
            if self.speculative is not None:
                self.speculative.forget(seq)
        if self.tiers is not None:
            for seq in self.scheduler.waiting:
                self.tiers.forget(seq)
        self.scheduler.waiting.clear()
        self.grammar_wait.clear()
        if self.overlap is not None:
            self.overlap.drop()

    # -- stepping ----------------------------------------------------------------------------

    def _graph_capture(self, runtime, model, dist):
        """The backend's device graphs for decode steps (runtime.graph_capture), unless the user
        asked for eager steps or expert-parallel steps cannot be captured; None: eager."""
        if runtime.graph_capture is None or self.config.enforce_eager:
            return None
        if dist is not None:
            from deepinfer.distributed.lockstep import ep_decode_capturable

            if not ep_decode_capturable(runtime.ops, model, self.config.max_num_seqs):
                return None
        return runtime.graph_capture

    def _eplb_schedule(self, model, device: torch.device, dist):
        """EPLB every config.eplb_interval steps (None when unset): starts counting the expert load."""
        if self.config.eplb_interval is None:
            return None
        if getattr(model, "placement", None) is None:
            raise InvalidRequestError("eplb_interval needs a model loaded with an expert placement (expert parallelism or redundant experts)")
        from deepinfer.distributed.eplb_schedule import EplbSchedule

        return EplbSchedule(model, device, dist, self.config.eplb_interval)

    def step(self) -> list[Sequence]:
        """Schedule, run the model, sample, check stop conditions. Returns the requests that finished,
        each by its sample 0 once all its samples have (make_output gives them all). With overlap
        scheduling, a decode step is launched here and finished by the next call. Requests whose
        grammar is ready join first; those whose grammar failed are returned, finished ("error")."""
        failed = finished_requests(self.grammar_wait.admit(self.scheduler.add, block=not self.scheduler.has_unfinished()))
        if not self.scheduler.has_unfinished():
            return failed
        if self.tiers is not None and not self._tiers_let_step_run():
            return failed
        if self.overlap is not None:
            finished = failed + self.overlap.step()
        else:
            batch = self.schedule()
            if batch is None:  # (KV tiers: preempting for a page left nothing to run this step)
                return failed
            self.before_step()
            finished = failed + self.execute(batch)
        if not self.has_unfinished():
            self.flush_tiers()
        return finished

    def flush_tiers(self) -> None:
        """Wait for the KV tiers' copies and writes in flight: the last blocks freed reach every tier (a restart finds
        them) and the tiers' figures count them. The end of a run (LLM.generate, a server's shutdown)."""
        if self.tiers is not None:
            self.tiers.drain()

    def _tiers_let_step_run(self) -> bool:
        """Advance the KV tiers' copies (never waiting) and whether a step can run: False, after waiting for a tier,
        when nothing runs and every waiting request is still loading its prefix (a step would be empty)."""
        self.tiers.poll()
        if self.scheduler.running or self.overlap is not None and self.overlap.in_flight is not None or self.scheduler.has_admissible():
            return True
        self.wait_for_tiers()  # nothing in flight: it lets go of loaded blocks held for requests that cannot be admitted beside each other
        return False

    def schedule(self) -> ScheduledBatch | None:
        """This step's batch (what `step` runs; with expert parallelism, scheduled before the ranks
        agree on the step's kind). Call `before_step` (every rank, every step) before `execute`.
        None with KV tiers when nothing can run: the waiting requests all load their prefix."""
        if self.tiers is None:
            return self.scheduler.schedule()
        self.tiers.poll()
        batch = self.scheduler.schedule()
        return batch if batch.seqs else None

    def wait_for_tiers(self) -> None:
        """Wait until a KV tier load moves on (a step that no rank has work for: expert parallelism)."""
        if self.tiers is not None and not self.tiers.wait():
            self.tiers.release_loads()

    def before_step(self) -> None:
        """Count a step, after an EPLB rebalance when one is due (with expert parallelism a
        collective: every rank calls this once per step, idle steps too, before the forward)."""
        if self.eplb is not None:
            self.eplb.before_step(self.num_steps)
        self.num_steps += 1

    def execute(self, batch: ScheduledBatch, graph_size: int | None = None) -> list[Sequence]:
        """Run the model on a scheduled batch, sample, check stop conditions (the second half of
        `step`). graph_size: None replays a device graph where one applies (one rank); with expert
        parallelism, the size of the graph every rank replays this step, or 0 for an eager step."""
        if self.speculative is not None:
            samplers, emitted, records = self.speculative.run(batch)
        else:
            samplers, tokens, step_records = self.runner.run(batch, use_graphs=graph_size != 0, graph_size=graph_size)
            emitted, records = [[t] for t in tokens], [[r] for r in step_records]
        if batch.is_prefill:
            self.scheduler.commit(batch)
            self.num_prompt_tokens_computed += batch.num_prompt_tokens
            release_held_back(self.scheduler, batch.seqs)
        finished = []
        for seq, tokens, token_records in zip(samplers, emitted, records):
            appended = 0
            for token, record in zip(tokens, token_records):  # a speculative step emits several: a stop inside the run drops the rest
                seq.token_ids.append(int(token))
                if record is not None:
                    seq.add_logprobs(record)
                appended += 1
                self.num_generated_tokens += 1
                if self._check_stop(seq, int(token)):
                    break
            if not batch.is_prefill:
                self.scheduler.commit_tokens(seq, appended)  # each appended token's predecessor was computed
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                if self.speculative is not None:
                    self.speculative.forget(seq)
                finished.append(seq)
        return finished_requests(finished)

    def _check_stop(self, seq: Sequence, token: int, length: int | None = None) -> bool:
        """Whether `token`, seq's token number `length` (default: its newest), ends it; sets the reason.
        (Overlap scheduling: tokens of a step still in flight may follow it in seq.token_ids.)"""
        params = seq.params
        length = seq.num_tokens if length is None else length
        generated = length - seq.num_prompt_tokens
        if seq.grammar is not None and self._grammar_ends(seq, token, generated - 1):
            if seq.finish_reason == "stop" and seq.stop_reason is None and params.stop and generated > params.min_tokens:
                seq.stop_reason = self._stop_string_in_tail(seq, length)  # a stop string this token completed too ends the text there
            return True
        if seq.constraints is not None and self._drew_banned(seq, token, length):
            return True
        if generated >= params.min_tokens:  # before that, EOS and stop token ids are banned and stop strings not looked for
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif params.stop and generated > params.min_tokens and (stop := self._stop_string_in_tail(seq, length)) is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and self.ends_by_length(seq, length):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    @staticmethod
    def _grammar_ends(seq: Sequence, token: int, generated: int) -> bool:
        """Advance seq's grammar with its new token; True, the reason set, when that ends seq: the
        grammar is complete ("stop", stop_reason the token when it is a stop token id; before
        min_tokens too: the grammar's end wins, an output past it could not match) or its matcher
        failed ("error").

        The mask lets `sample` draw only tokens the grammar allows, so a token it refuses means the
        request's other options (min_tokens' bans of EOS and stop token ids, allowed_token_ids,
        bad_words, a logit_bias of -inf) banned every token the grammar allowed: that is the error;
        unless the grammar allowed it and llguidance failed on its own (a limit of its parser: more
        than 2,000 alternatives open at once, say), which is said as such.
        generated: the tokens seq generated before this one."""
        from deepinfer.engine.structured_output import GrammarError

        accepting = seq.grammar.matcher.is_accepting()
        try:
            complete = seq.grammar.accept(token)
        except GrammarError as exc:
            log.debug("request %s: %s", seq.seq_id, exc)
            before = seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + generated]
            if seq.grammar.allows(before, token):
                failure = str(exc).removeprefix("the grammar matcher failed: ")
                seq.error = f"after {generated} tokens the grammar is too big or complex for llguidance: {failure}"
            elif accepting and generated < seq.params.min_tokens:
                seq.error = (f"after {generated} tokens the grammar allows only its end (EOS) or stop token ids, which min_tokens={seq.params.min_tokens} "
                             "bans: no token fits both; lower min_tokens")  # fmt: skip
            else:
                seq.error = (f"after {generated} tokens no token fits both the grammar and the request's other token options "
                             "(allowed_token_ids, bad_words, logit_bias, min_tokens)")  # fmt: skip
            seq.finish_reason = "error"
            return True
        if complete:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in seq.params.stop_token_ids else None
        return complete

    @staticmethod
    def _drew_banned(seq: Sequence, token: int, length: int) -> bool:
        """True, seq failed ("error"), when `token` (seq's token number `length`) is one its token
        options ban: they banned every token of its row, whose logits were all -inf, so the draw
        meant nothing (TokenConstraints.drew_banned) and the request cannot go on."""
        constraints = seq.constraints
        generated = length - 1 - seq.num_prompt_tokens
        recent = seq.token_ids[max(seq.num_prompt_tokens, length - 1 - constraints.width) : length - 1]
        if not constraints.drew_banned(token, generated, recent):
            return False
        options = [name for name, on in (("allowed_token_ids", seq.params.allowed_token_ids is not None), ("bad_words", bool(seq.params.bad_words)),
                                          ("min_tokens", generated < constraints.min_tokens)) if on]  # fmt: skip
        seq.error = (f"after {generated} tokens no token is left to sample: {' and '.join(options)} ban every token"
                     + (" the grammar allows" if seq.grammar is not None else "") + "; let them allow more tokens")
        seq.finish_reason = "error"
        return True

    def ends_by_length(self, seq: Sequence, length: int) -> bool:
        """Whether seq ends when it holds `length` tokens (max_tokens or the model's length), whatever they are."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and length - seq.num_prompt_tokens >= max_tokens) or length >= self.max_model_len

    def _stop_string_in_tail(self, seq: Sequence, length: int) -> str | None:
        """The stop string that token number `length` completed, if any. Only the output's tail is decoded:
        a string of L characters spans at most 4L byte-level tokens, plus one for the new token. With
        min_tokens, a stop string must end past the text of the first min_tokens tokens (vLLM looks
        only at text that arrives after them)."""
        params = seq.params
        window = 4 * max(len(s) for s in params.stop) + 1
        output = seq.token_ids[seq.num_prompt_tokens : length]
        start = max(0, len(output) - window)
        tail = self.tokenizer.decode(output[start:], skip_special_tokens=params.skip_special_tokens)
        held = len(self.tokenizer.decode(output[start : params.min_tokens], skip_special_tokens=params.skip_special_tokens)) if start < params.min_tokens else 0
        found = [(i, s) for s in params.stop if (i := _find_ending_after(tail, s, held)) >= 0]
        return min(found)[1] if found else None

    # -- outputs -----------------------------------------------------------------------------

    def make_output(self, seq: Sequence) -> RequestOutput:
        """The RequestOutput of seq's request: a CompletionOutput per sample (n), finished when all are."""
        seq = seq.head
        return RequestOutput(
            request_id=str(seq.seq_id),
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[self._completion(sample) for sample in seq.samples],
            finished=all(sample.status is SequenceStatus.FINISHED for sample in seq.samples),
            num_cached_tokens=seq.num_cached_tokens or 0,
            metrics=self._request_metrics(seq),
            prompt_logprobs=[position_logprobs(r, self.tokenizer) for r in seq.prompt_logprobs] if seq.prompt_logprobs is not None else None,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        params = seq.params
        ids = seq.output_token_ids
        # ended by EOS or a stop token id (not by a grammar that completed on an ordinary token)
        by_token = seq.finish_reason == "stop" and bool(ids) and (ids[-1] == seq.stop_reason or (seq.stop_reason is None and ids[-1] in self.eos_token_ids))
        text_ids = ids[:-1] if by_token and not params.include_stop_str_in_output else ids  # EOS / stop id: not in the text
        text = self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens) if self.tokenizer is not None else ""
        if isinstance(seq.stop_reason, str):
            held = len(self.tokenizer.decode(ids[: params.min_tokens], skip_special_tokens=params.skip_special_tokens)) if params.min_tokens else 0
            cuts = [(i, s) for s in params.stop if (i := _find_ending_after(text, s, held)) >= 0]
            if cuts:
                at, stop = min(cuts)
                text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return CompletionOutput(
            seq.sample_index, text, list(ids), seq.finish_reason, seq.stop_reason, cumulative_logprob=seq.cumulative_logprob,
            logprobs=[position_logprobs(r, self.tokenizer) for r in seq.logprobs] if seq.logprobs is not None else None, error=seq.error,
        )  # fmt: skip

    def _request_metrics(self, seq: Sequence) -> dict:
        """num_preemptions counts every sample's."""
        metrics = {"num_preemptions": sum(sample.num_preemptions for sample in seq.samples)}
        if self.speculative is not None:
            metrics.update(num_drafts_verified=seq.num_drafts_verified, num_drafts_accepted=seq.num_drafts_accepted)
        return metrics


def _find_ending_after(text: str, stop: str, held: int) -> int:
    """Where the first occurrence of `stop` in `text` that ends past character `held` starts; -1: none."""
    at = text.find(stop, max(0, held - len(stop) + 1))
    return at
