"""`LLM`: the offline API in vLLM's shape.

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # the embedded tiny default (dummy weights)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping
from typing import Sequence as SequenceType

import torch

from deepinfer.engine.chat import PYTHON_API, FixNames, conversations, render_chat
from deepinfer.engine.cpu_threads import check_cpu_threads, use_cpu_threads
from deepinfer.engine.dtype_names import AUTO, torch_name
from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | dict[str, Any]


def resolve_dtype(dtype: str | torch.dtype, device_type: str) -> torch.dtype:
    """"auto": bfloat16 on accelerators, float32 on the CPU (the reference backend); any other name
    through deepinfer.engine.dtype_names (vLLM's: half = float16, float = float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO:
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    try:
        return getattr(torch, torch_name(dtype))
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


class LLM:
    """An offline engine over one model on one backend.

    model: a Hugging Face checkpoint folder, or None for the embedded tiny DeepSeek-V3 default
    (dummy weights). backend: "auto" (cuda, then ascend, then reference; it says which), or a name.
    seed: requests without their own seed get one derived from it and their request index.
    max_num_seqs / max_num_batched_tokens: sequences per step / tokens per step (longer prompts are
    prefilled in chunks; default, as vLLM's LLM: 16384 on an accelerator with at least 70 GiB, else 8192,
    deepinfer/engine/step_budget.py). num_kv_blocks: KV pages (default: as many as fit kv_cache_memory_gib, or
    what is still free of the gpu_memory_utilization share of the accelerator's memory once the
    weights are loaded, or 256 MiB on the CPU). gpu_memory_utilization: vLLM's, a fraction in
    (0, 1] (default 0.9). max_model_len: the longest sequence, prompt and generated tokens
    (default and upper bound: the model's max_position_embeddings). allow_fallback: let the reference
    serve ops the backend lacks. announce: print the backend choice, "dummy weights" and long start-up work
    (measuring speculative decoding's step costs) to stderr.
    dtype: "auto" (bfloat16 on accelerators, float32 on the CPU) or a name of
    deepinfer.engine.dtype_names (vLLM's: half, float16, bfloat16, float, float32), or a torch.dtype.
    tokenizer: a folder to load the tokenizer (tokenizer.json, tokenizer_config.json and its chat
    template) from instead of the model's (vLLM's tokenizer=).

    Expert parallelism (docs/distributed.md): ep: ranks the routed experts are sharded over, one
    process per rank started by torchrun (None: torchrun's WORLD_SIZE, or 1); every rank builds
    the same LLM and calls generate with the same prompts; each runs every ep-th request
    (attention data parallel) and rank 0 returns all results. num_redundant_experts: extra copies
    of busy experts per MoE layer (n_routed_experts + R must divide by ep). expert_load: tokens
    per expert ([MoE layers][experts], a tensor, a list or a JSON file) to place the experts by
    EPLB from the start. eplb_interval: re-place them by EPLB every this many steps, from the load
    counted meanwhile. dist_timeout: seconds a collective waits before the run fails.

    cpu_threads: torch's intra-op threads (None: the rule of deepinfer.engine.cpu_threads, applied
    when the ops run on the CPU: OMP_NUM_THREADS if set, else the usable cores but one).

    kv_cache_dtype: "auto" (the model dtype) or "fp8" / "fp8_e4m3" (vLLM's names): e4m3 cache rows
    with one float32 scale per token, about half the bytes per token, so about twice the tokens fit
    (deepinfer.ops.kv_cache_format states the layout; docs/architecture.md the accuracy).

    deterministic: every op runs a batch-invariant kernel (`deepinfer backends` marks them) and the
    model keeps its own glue invariant, so a request's logits, and with its seed its tokens, are
    bit-identical whatever it is batched with, however its prefill is chunked and whether its
    prefix came from the cache (docs/architecture.md says what else it covers). A backend without
    such a kernel for an op the model needs is a one-line error naming the op.

    speculative: speculative decoding, e.g. {"method": "mtp", "num_drafts": 3, "policy": "confidence"}
    or "mtp:3:confidence": the checkpoint's MTP layer drafts k tokens per request and step, the
    target verifies them in one forward; policy "fixed" verifies all k, "confidence" only as many as
    pay for themselves at the current load (deepinfer.engine.speculative), priced by step costs
    measured on the device once per machine and model shape and kept in the cache folder
    ($DEEPINFER_CACHE, else ~/.cache/deepinfer; "cost_model": "measure" measures them again, a
    {tokens: seconds} table gives them). On DeepSeek-V4.1, speculative="dspark" drafts with its DSpark
    blocks (a block of dspark_block_size tokens at once; "dspark:K:POLICY" fewer), and its default policy
    "head" verifies while the confidence head's expected gain beats the cost of the wider step; V2/V3/V4
    keep "mtp". The tokens are the ones
    the same request draws without speculation (same seed, same stateless noise), as far as the
    target's logits agree bit for bit. `llm.speculative_metrics()` reports acceptance.

    backend_options: the backend's options, e.g. {"ep_path": "nccl"} (`deepinfer backends` lists
    each backend's; an unknown option or value is a one-line error).

    overlap: overlap scheduling, the host scheduling and launching decode step n+1 while the device
    runs step n (deepinfer.engine.overlap). None: on where the backend runs asynchronously (cuda,
    ascend) unless speculative decoding or expert parallelism is on; False: off (`--no-overlap`);
    True: on (on the CPU it runs but gains nothing), refused with speculation or expert parallelism.

    mixed_steps: a step that prefills a prompt (chunk) also decodes one token of every running
    request, within max_num_batched_tokens, so a long prompt does not stall generation. None: on
    unless deterministic mode or speculative decoding is on; False: off (`--no-mixed-steps`); True:
    on, refused with those two.

    logprobs_mode (vLLM's): "raw_logprobs" (default) reports the model's log-probabilities before
    any processing; "processed_logprobs" those of the distribution sampled from (after penalties,
    logit_bias, bans, min_tokens and temperature; top-k/top-p/min_p truncation not applied).
    prompt_logprobs are raw either way.

    grammar_compile_timeout_s: a request with structured_outputs whose grammar has not compiled
    this long after it was added fails alone (finish_reason "error", CompletionOutput.error).
    grammar_cache_size: compiled grammars kept for later requests with the same spec (the least
    recently used is dropped past it).
    max_grammar_bytes: the largest structured_outputs a request may give, in bytes (its schema,
    regex, choice list or grammar); a larger one is refused (InvalidRequestError). Default 256 KiB.

    swa_bounded_replay: DeepSeek-V4.1's decoder SWA bounded replay: at prefill (after a prefix hit too, which
    stops at the decoder tail's start) the encoder layers run on every prompt token and the decoder layers, those after
    the last KV source, only on the prompt's last sliding_window + dspark_block_size tokens, so their cost
    is flat in the prompt's length; an approximation of a full prefill (docs/models/deepseek_v41.md gives
    the measured difference). Default on, as vLLM, SGLang and ATOM do it. False: every layer on every token
    (greedy tokens equal a full forward's). Other models have no decoder-only layers and ignore it.

    KV tiers behind the prefix cache (deepinfer.kv_tiers; vLLM's KV offloading, SGLang's HiCache): a cached block
    that leaves use is copied out, and a later request whose prefix is found there loads it back instead of
    recomputing it (its tokens count in RequestOutput.num_cached_tokens). kv_offload_cpu_gib: pinned host memory
    for blocks (GiB). kv_offload_dir: a directory of blocks, readable after a restart and by several processes
    (kv_offload_disk_gib bounds it, default half the free space; kv_offload_ttl_s: an entry's lifetime, also
    the shared store's). kv_store_url: a shared store, redis://host:port/db or valkey://... (through redis-py:
    pip install 'deepinfer[redis]'), or any scheme a plugin registers. Blocks are keyed by their prefix and
    everything their KV depends on (model, weights, config, dtypes, layout), checksummed, and a damaged or
    foreign one is recomputed; a tier that fails degrades to the others with one log line. `llm.kv_tier_stats()`
    reports hits, bytes, loads, stores, evictions and expired entries per tier.
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        tokenizer: str | os.PathLike | None = None,
        allow_fallback: bool = False,
        announce: bool = True,
        enforce_eager: bool = False,
        interpret: bool = False,
        ep: int | None = None,
        num_redundant_experts: int = 0,
        eplb_interval: int | None = None,
        expert_load: Any = None,
        dist_timeout: float = 300.0,
        backend_options: Mapping[str, str] | None = None,
        cpu_threads: int | None = None,
        kv_cache_dtype: str = "auto",
        deterministic: bool = False,
        speculative: Any = None,
        overlap: bool | None = None,
        mixed_steps: bool | None = None,
        logprobs_mode: str = "raw_logprobs",
        grammar_compile_timeout_s: float = 30.0,
        grammar_cache_size: int = 256,
        max_grammar_bytes: int = 256 << 10,
        swa_bounded_replay: bool = True,
        kv_offload_cpu_gib: float | None = None,
        kv_offload_dir: str | os.PathLike | None = None,
        kv_offload_disk_gib: float | None = None,
        kv_offload_ttl_s: float | None = None,
        kv_store_url: str | None = None,
    ):
        from deepinfer.model.facts import checkpoint_facts
        from deepinfer.model.loader import load_model
        from deepinfer.plugins import load_plugins
        from deepinfer.registry import ModelFacts
        from deepinfer.runtime import open_runtime

        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gib=kv_cache_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            eplb_interval=eplb_interval,
            kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
            speculative=speculative,
            overlap=overlap,
            mixed_steps=mixed_steps,
            logprobs_mode=logprobs_mode,
            grammar_compile_timeout_s=grammar_compile_timeout_s,
            grammar_cache_size=grammar_cache_size,
            max_grammar_bytes=max_grammar_bytes,
            kv_offload_cpu_gib=kv_offload_cpu_gib,
            kv_offload_dir=str(kv_offload_dir) if kv_offload_dir is not None else None,
            kv_offload_disk_gib=kv_offload_disk_gib,
            kv_offload_ttl_s=kv_offload_ttl_s,
            kv_store_url=kv_store_url,
        )
        config.validate()
        check_cpu_threads(cpu_threads)
        plugins = load_plugins()

        def device_type() -> str:
            spec = plugins.auto()[0] if backend == "auto" else plugins.backend(backend)
            return spec.device(interpret)

        if dtype == "auto":
            torch_dtype = resolve_dtype(dtype, device_type())
        else:
            torch_dtype = resolve_dtype(dtype, "cpu")
        dist = join_expert_parallel(ep, dist_timeout, device_type, deterministic)
        announce = announce and (dist is None or dist.rank == 0)
        if interpret:
            # Triton kernels on the CPU (how CI checks the cuda and ascend kernels); Triton reads
            # this when a kernel is decorated, so it must be set before the backend loads them.
            os.environ["TRITON_INTERPRET"] = "1"
        ep_size = dist.world_size if dist is not None else 1
        runtime = open_runtime(
            backend, dtype=torch_dtype, ep_size=ep_size, allow_fallback=allow_fallback, plugins=plugins, interpret=interpret,
            options=backend_options, deterministic=config.deterministic,
            model=lambda: dataclasses.replace(checkpoint_facts(model) or ModelFacts(), kv_cache_fp8=kv_cache_dtype != "auto"),
        )  # fmt: skip
        if dist is not None and runtime.device.type != dist.device.type:
            raise InvalidRequestError(f"backend {runtime.backend.name} runs on {runtime.device.type}, but the process group was formed for {dist.device.type}")
        if announce and backend == "auto":
            print(f"deepinfer: {runtime.chosen_by}", file=sys.stderr)
        use_cpu_threads(cpu_threads, on_cpu=runtime.device.type == "cpu")
        experts = None
        if dist is not None or num_redundant_experts or eplb_interval is not None or expert_load is not None:
            from deepinfer.model.moe import ExpertSharding

            experts = ExpertSharding(dist, num_redundant_experts, num_nodes(dist), _expert_load(expert_load))
        loaded = load_model(model, runtime.ops, runtime.device, torch_dtype, experts, max_model_len=max_model_len, tokenizer=tokenizer,
                            swa_bounded_replay=swa_bounded_replay)  # fmt: skip
        if announce and loaded.dummy_weights:
            print(f"deepinfer: model {loaded.path}: dummy weights (random, for trying the engine; the text is gibberish)", file=sys.stderr)
        self._setup(LLMEngine(loaded, runtime, torch_dtype, config, dist=dist, announce=announce))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An LLM over an engine built by hand (tests, custom models)."""
        llm = cls.__new__(cls)
        llm._setup(engine)
        return llm

    def _setup(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.dist = getattr(engine, "dist", None)
        self._num_submitted = 0  # requests ever queued (data parallel: over all ranks)

    @property
    def rank(self) -> int:
        """This process's rank (0 without expert parallelism): only rank 0 gets results."""
        return self.dist.rank if self.dist is not None else 0

    @property
    def world_size(self) -> int:
        return self.dist.world_size if self.dist is not None else 1

    # -- facts for the user --------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self.engine.runtime.backend.name

    @property
    def chosen_by(self) -> str:
        return self.engine.runtime.chosen_by

    @property
    def model_path(self) -> str:
        return str(self.engine.loaded.path)

    @property
    def dummy_weights(self) -> bool:
        return bool(getattr(self.engine.loaded, "dummy_weights", False))

    def cache_bytes_held(self) -> tuple[float, int]:
        """(cache bytes per token of history, cache bytes per running request that do not grow with it)."""
        return self.engine.cache_bytes_held()

    def get_tokenizer(self):
        return self.tokenizer

    def speculative_metrics(self) -> dict[str, float] | None:
        """Speculative decoding's figures since the LLM was built (None without speculation):
        acceptance_length, drafts_verified_per_step, accepted_per_verified, ..."""
        spec = self.engine.speculative
        return spec.metrics.summary() if spec is not None else None

    def kv_tier_stats(self) -> dict[str, dict] | None:
        """The KV tiers' figures since the LLM was built, per tier (None without tiers): blocks and bytes loaded from
        it (hit_blocks, hit_bytes), requests that loaded from it (loads), blocks stored, what it holds, evictions,
        expired entries, errors (deepinfer.kv_tiers.tier_stats)."""
        tiers = self.engine.tiers
        return tiers.stats() if tiers is not None else None

    # -- generation ----------------------------------------------------------------------------

    def warm_up(self) -> dict[str, float]:
        """Compile and capture now what the first requests of each size would otherwise wait for
        (engine/warmup.py): a prefill of every power of two up to the token budget, the decode graph
        of every batch bucket. Requests after it run and are seeded as without it."""
        from deepinfer.engine.warmup import warm_up

        return warm_up(self.engine)

    @property
    def compiles_on_first_use(self) -> bool:
        """Whether the backend compiles kernels or captures graphs on first use (a warm-up pays off)."""
        runtime = self.engine.runtime
        return runtime.compiles_on_first_use or runtime.graph_capture is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name): a repeated workload is then computed again,
        not served from the cache. False, and nothing forgotten, while a request is unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | SequenceType[Prompt],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}. sampling_params is
        one SamplingParams for all prompts, or one per prompt (None: SamplingParams()).

        With expert parallelism (ep > 1, one process per rank) every rank passes the same prompts
        and runs its share (attention data parallel); rank 0 returns every result and the other
        ranks return an empty list.
        """
        return self._collect(self.generate_iter(prompts, sampling_params, use_tqdm))

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the next message of each conversation (vLLM's LLM.chat); one RequestOutput per
        conversation, in input order, whose .prompt is the rendered text.

        messages: one conversation, a list of {"role": "system" | "user" | "assistant", "content": str}
        dicts, or a list of conversations. Each is rendered by the tokenizer's chat template, or by
        `chat_template` (Jinja source) when given, or, for a DeepSeek-V4 model whose tokenizer has
        no template, by deepinfer's encoder of V4's format (deepinfer.engine.chat_dsv4:
        chat_template_kwargs {"thinking": True, "reasoning_effort": "max"}, reasoning_content, tool
        calls), then generated as generate() does (sampling_params: one for all, or one per
        conversation). add_generation_prompt: end with the assistant's turn header;
        continue_final_message (with add_generation_prompt=False): let the model continue the last
        message instead. tools: OpenAI's tool definitions. chat_template_kwargs: more template
        variables. A problem (no chat template, a malformed message, the template's own error) is a
        one-line InvalidRequestError naming the conversation.
        """
        batch = conversations(messages)
        names = [f"conversation {i}" for i in range(len(batch))]
        prompts = [
            self.render_conversation(
                conversation, name, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools,
            )
            for conversation, name in zip(batch, names)
        ]  # fmt: skip
        return self._collect(self.generate_iter(prompts, sampling_params, use_tqdm, names=names))

    def render_conversation(self, conversation, what: str, *, fixes: FixNames = PYTHON_API, **options) -> str:
        """One conversation's prompt text as chat() renders it (deepinfer.engine.chat.render_chat,
        with this model's tokenizer and its built-in format); `deepinfer run` and `run-batch`
        render their "messages" through it too. `options`: render_chat's keywords."""
        return render_chat(self.tokenizer, conversation, what, model_type=self.engine.loaded.config.model_type, fixes=fixes, **options)

    def _collect(self, stream: "GenerationStream") -> list[RequestOutput]:
        """Every result of `stream`, in input order (ranks other than 0: an empty list)."""
        results: list[RequestOutput | None] = [None] * stream.num_requests
        for index, output in stream:
            results[index] = output
        if self.rank != 0:
            return []
        return results  # type: ignore[return-value]

    def generate_iter(
        self,
        prompts: Prompt | SequenceType[Prompt],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        names: SequenceType[str] | None = None,
        on_invalid: Callable[[int, InvalidRequestError], None] | None = None,
    ) -> "GenerationStream":
        """Like generate(), but yields (input index, RequestOutput) as each request finishes.

        Every prompt is checked and queued before this returns, so a bad prompt raises here,
        before anything runs. Abandoning the iterator drops the unfinished requests. `names` say
        how error messages name each prompt (default "prompt <index>"). `on_invalid`: instead of
        raising, call on_invalid(index, error) for each prompt that fails its checks and leave it
        out (its index is never yielded); the others run.
        """
        requests = self.make_requests(prompts, sampling_params, names, on_invalid)
        self.engine.abort_all()  # leftovers of an iterator that was never run
        base = self._num_submitted
        self._num_submitted += len(requests)
        queued = sum(r is not None for r in requests)
        if self.dist is not None:
            from deepinfer.engine.data_parallel import DataParallelStream, my_requests

            position = {}
            for i in my_requests(len(requests), self.dist):
                if requests[i] is not None:
                    ids, params, text = requests[i]
                    position[self.engine.add_request(ids, params, text, index=base + i).seq_id] = i
            return DataParallelStream(self.engine, self.dist, position, len(requests), use_tqdm, queued=queued)
        position = {}
        for i, request in enumerate(requests):
            if request is not None:  # the index (and the default seed) counts the prompts left out too
                ids, params, text = request
                position[self.engine.add_request(ids, params, text, index=base + i).seq_id] = i
        return GenerationStream(self.engine, position, len(requests), use_tqdm, queued=queued)

    def make_requests(self, prompts, sampling_params, names=None, on_invalid=None) -> list[tuple[list[int], SamplingParams, str | None] | None]:
        """Each prompt tokenized and checked against the engine, as generate() does before it queues
        anything: (token ids, params, text) each, for LLMEngine.add_request; InvalidRequestError
        for the first that fails, or with on_invalid, None for it (reported to on_invalid). Touches no
        engine state: `deepinfer serve` calls it off the engine's thread."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"got {len(params_list)} sampling params for {len(prompts)} prompts; pass one, or one per prompt")
            bad = next((i for i, p in enumerate(params_list) if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise InvalidRequestError(f"sampling_params[{bad}] is a {type(params_list[bad]).__name__}, not a SamplingParams")
        requests = []
        if names is not None and len(names) != len(prompts):
            raise InvalidRequestError(f"got {len(names)} names for {len(prompts)} prompts")
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            what = names[i] if names is not None else f"prompt {i}"
            try:
                ids, text = self._tokenize(prompt, what)
                self.engine.check_request(ids, params, what)
            except InvalidRequestError as exc:
                if on_invalid is None:
                    raise
                on_invalid(i, exc)
                requests.append(None)
                continue
            requests.append((ids, params, text))
        return requests

    def _encode(self, text: str, what: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what}: this checkpoint has no tokenizer.json; pass prompts as {{'prompt_token_ids': [...]}}")
        check_text(text, what)
        check_text_length(text, what, self.tokenizer.max_token_chars, self.engine.max_model_len)
        return list(self.tokenizer.encode(text))

    def _tokenize(self, prompt: Prompt, what: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self._encode(prompt, what), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError(f"{what}: prompt_token_ids must be a list of integers")
            return list(ids), prompt.get("prompt")
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self._encode(prompt["prompt"], what), prompt["prompt"]
        raise InvalidRequestError(f"{what} must be a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}")


def check_text(text: str, what: str) -> None:
    """InvalidRequestError for text that is not valid Unicode (a lone surrogate such as "\\udc00",
    which JSON escapes and undecodable command-line bytes produce): it cannot be tokenized or written."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), which is not valid Unicode text"
        ) from None


def check_text_length(text: str, what: str, max_token_chars: int, max_model_len: int) -> None:
    """InvalidRequestError, before tokenizing, for text too long for the model whatever its tokens
    (a token spells at most max_token_chars characters: Tokenizer.max_token_chars): tokenizing tens
    of megabytes takes gigabytes and seconds, for a prompt that would be refused after."""
    fewest = -(-len(text) // max_token_chars)
    if fewest >= max_model_len:
        raise InvalidRequestError(
            f"{what} is {len(text)} characters long, so at least {fewest} tokens (a token of this tokenizer spells at most {max_token_chars} "
            f"characters); the model's maximum length is {max_model_len}, which must leave room for at least one generated token"
        )


def join_expert_parallel(ep: int | None, timeout_s: float, device_type, deterministic: bool = False):
    """The run's DistContext for expert parallelism over `ep` ranks (None: one process).

    ep=None takes the torchrun world (WORLD_SIZE), if any. ep > 1 needs one process per rank:
    torchrun --nproc-per-node ep (or `deepinfer run --ep N`, which starts it). device_type: a
    callable giving the backend's device type (the process group's collective library follows it).
    deterministic: the collective library in its deterministic mode (`init_distributed`)."""
    from deepinfer.distributed.group import check_timeout, env_world_size, init_distributed

    check_timeout(timeout_s)
    world_size = env_world_size()
    if ep is None:
        ep = world_size
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise InvalidRequestError(f"ep must be an integer >= 1, got {ep!r}")
    if ep != world_size:
        if world_size == 1:
            raise InvalidRequestError(
                f"ep={ep} needs one process per rank: start them with torchrun --nproc-per-node {ep} "
                f"(or `deepinfer run --ep {ep}`, which does)"
            )
        raise InvalidRequestError(f"ep={ep}, but torchrun started {world_size} processes (WORLD_SIZE); expert parallelism spans all of them")
    if ep == 1:
        return None
    return init_distributed(timeout_s, device=device_type(), deterministic=deterministic)


def num_nodes(dist) -> int:
    """Hosts of the run: WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun."""
    from deepinfer.distributed.group import env_int

    if dist is None:
        return 1
    per_node = env_int("LOCAL_WORLD_SIZE", dist.world_size, minimum=1)
    return max(1, dist.world_size // per_node) if dist.world_size % per_node == 0 else 1


def _expert_load(value):
    """An expert load given as a tensor, a nested list, or a path to a JSON file of a nested list
    ([num_moe_layers, n_routed_experts] or [n_routed_experts])."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (str, os.PathLike)):
        import json

        try:
            with open(value, encoding="utf-8") as f:
                value = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"cannot read the expert load {value}: {exc}") from None
        if isinstance(value, dict):
            value = value.get("load", value)
    try:
        return torch.tensor(value, dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"the expert load must be a [layers, experts] list of numbers ({exc})") from None


@dataclass
class StepResults:
    """What one step of a stream finished: (input index, RequestOutput) pairs, and the token counts
    since the stream started (over every rank the stream speaks for)."""

    finished: list[tuple[int, RequestOutput]]
    prompt_tokens: int
    generated_tokens: int


class GenerationStream:
    """Iterates (input index, RequestOutput) as requests finish, with a progress bar that shows
    the tokens generated and the prompt and generation throughput (deepinfer.engine.progress).

    The iteration, the bar and the clean-up (an abandoned stream drops its unfinished requests) are
    here; how a step runs is `_steps`: one engine step at a time here, the ranks' lockstep in
    DataParallelStream."""

    def __init__(self, engine: LLMEngine, position: dict[int, int], num_requests: int, use_tqdm: bool, *, queued: int | None = None):
        """position: seq_id -> input index of each queued request; num_requests: input prompts
        (queued or not); queued: requests the bar counts (default num_requests)."""
        self.engine = engine
        self.position = position
        self.num_requests = num_requests
        self.queued = num_requests if queued is None else queued
        self.use_tqdm = use_tqdm
        self._iterator = self._run()

    def __iter__(self) -> Iterator[tuple[int, RequestOutput]]:
        return self

    def __next__(self) -> tuple[int, RequestOutput]:
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()

    def _run(self) -> Iterator[tuple[int, RequestOutput]]:
        from deepinfer.engine.progress import Progress

        progress = Progress(self.queued, self.use_tqdm)
        try:
            for step in self._steps():
                progress.update(len(step.finished), step.prompt_tokens, step.generated_tokens)
                yield from step.finished
        finally:
            self.engine.abort_all()
            self.engine.flush_tiers()
            progress.close()

    def _steps(self) -> Iterator[StepResults]:
        """One engine step at a time until every request has finished."""
        engine = self.engine
        prompt0, gen0 = engine.num_prompt_tokens_computed, engine.num_generated_tokens
        while engine.has_unfinished():
            done = engine.step()
            finished = [(self.position[seq.seq_id], engine.make_output(seq)) for seq in done]
            yield StepResults(finished, engine.num_prompt_tokens_computed - prompt0, engine.num_generated_tokens - gen0)
