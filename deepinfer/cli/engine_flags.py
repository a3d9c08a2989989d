"""The engine flags `deepinfer run`, `run-batch` and `serve` share: the model, vLLM's engine flags
with vLLM's meaning, speculative decoding, the backend, expert parallelism. Each command adds them
with `add_engine_flags` (in the groups its `--help=GROUP` shows), checks them with
`check_engine_flags` (one line, exit 2, before anything starts) and builds its LLM with `load_llm`.

vLLM's engine flags, with vLLM's meaning: --dtype (auto, half = float16, bfloat16, float = float32),
--max-model-len, --gpu-memory-utilization, --kv-cache-dtype, --max-num-seqs,
--max-num-batched-tokens, --enforce-eager, --seed, --tokenizer, --chat-template. --tensor-parallel-size
(-tp) is accepted at 1 only: deepinfer has no tensor parallelism and spreads a model over devices by
expert parallelism (--ep)."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.engine.dtype_names import DTYPE_NAMES
from deepinfer.engine.step_budget import SERVER_BUDGET
from deepinfer.errors import UserError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # deepinfer.ops.kv_cache_format's (repeated: the CLI imports no torch before it must)
MAX_GRAMMAR_BYTES = 256 << 10  # EngineConfig.max_grammar_bytes's default (repeated for the same reason)


MODEL_HELP = """the checkpoint, its tokenizer and chat template, its dtype and length
--model takes an HF checkpoint folder (DeepSeek V2, V3, V4 or V4.1) or an embedded tiny model: tiny-v3,
tiny-v4 or tiny-v41 (dummy weights; made on first use). Chat messages are rendered by the tokenizer's chat
template, as LLM.chat renders them (DeepSeek-V4 checkpoints ship a Python encoder instead, which
deepinfer follows); --chat-template and --tokenizer replace the template or the whole tokenizer."""

ENGINE_HELP = """scheduling and the KV cache (vLLM's flags, with vLLM's meaning)
A step runs at most --max-num-seqs sequences and --max-num-batched-tokens tokens; longer prompts
prefill in chunks. The KV cache is paged; its pages come from --gpu-memory-utilization's share of
the device (or --num-kv-blocks), and a request that does not fit waits or is recomputed later."""

SPECULATIVE_HELP = """speculative decoding: the checkpoint's draft layers draft, the model verifies
SPEC is METHOD[:NUM_DRAFTS[:POLICY]] or the same as a JSON object: mtp:3:fixed verifies every draft
each step, mtp:3:confidence the drafts that maximise expected tokens per second (from the drafts'
confidence and a step-cost model measured at start-up; docs/architecture.md says how); on
DeepSeek-V4.1, dspark drafts a block with its DSpark layers, and its default policy, head, verifies
while the confidence head's expected gain beats the cost of the wider step (dspark:5:fixed: all). A request's
tokens are those it draws without speculation wherever the verifying logits equal a plain decode
step's: always with --deterministic. Not with --ep yet."""

BACKEND_HELP = """which backend runs the ops, and how its kernels run
`deepinfer backends` lists each backend, whether it runs here (and why not), its op coverage and
the options --backend-option takes. On the CPU the run uses every usable core but one
(OMP_NUM_THREADS or --cpu-threads choose)."""

PARALLEL_HELP = """expert parallelism over several devices (docs/distributed.md)
--ep N shards a MoE model's experts over N devices of this host, one process each, which deepinfer
starts; attention runs data parallel: each rank runs its own share of the requests. Flags, files,
the devices and the model's expert count are checked once before the ranks start; a rank that fails
is reported in one line. Under a torchrun you start yourself (several hosts) --ep defaults to the
number of processes. deepinfer has no tensor parallelism; DeepSeek-V4 runs with --ep 1 only yet."""


def add_engine_flags(p, server: bool = False) -> None:
    """The engine's flags, in the groups `--help=GROUP` shows (deepinfer/cli/flag_help.py): model,
    engine, speculative, backend, parallel. server: `deepinfer serve`'s defaults where a server's differ (vLLM's)."""
    model = p.add_argument_group("model", MODEL_HELP)
    model.add_argument(
        "--model", metavar="PATH",
        help="an HF checkpoint folder, or tiny-v3 / tiny-v4 / tiny-v41: the embedded tiny DeepSeek-V3 / V4 / V4.1 (dummy weights; default tiny-v3)",
    )
    model.add_argument("--tokenizer", metavar="PATH", help="load the tokenizer (and its chat template) from this folder instead of the model's")
    model.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                       help="the chat template for chat messages instead of the tokenizer's: a Jinja file, or the template itself")
    model.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, metavar="DTYPE",
                       help="the model's dtype: auto (bfloat16 on accelerators, float32 on the CPU), half = float16, bfloat16, "
                            "float = float32 (vLLM's names; bf16, fp16, fp32 too)")
    model.add_argument("--max-model-len", type=int, metavar="N",
                       help="the longest sequence, prompt and generated tokens (default and most: the model's max_position_embeddings)")
    model.add_argument("--seed", type=int, default=0, help="seed from which each request's sampling seed is derived (default 0)")
    model.add_argument("--logprobs-mode", default="raw_logprobs", choices=("raw_logprobs", "processed_logprobs"),
                       help="what logprobs report: the model's own (default, as vLLM) or the distribution sampled from "
                            "(after penalties, logit_bias, bans and temperature)")
    engine = p.add_argument_group("engine", ENGINE_HELP)
    engine.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="sequences per step at most (default 256)")
    if server:
        budget = dict(default=SERVER_BUDGET, help=f"tokens per step; longer prompts prefill in chunks (default {SERVER_BUDGET}, as vLLM's server)")
    else:
        budget = dict(default=None, help="tokens per step; longer prompts prefill in chunks (default, as vLLM's LLM: 16384 on an accelerator "
                                         "with at least 70 GiB of memory, else 8192)")
    engine.add_argument("--max-num-batched-tokens", type=int, metavar="N", **budget)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="the share in (0, 1] of the accelerator's memory the engine may use; the KV cache gets what of it is free "
                             "once the weights are loaded (default 0.9; the CPU's cache is a share of the free RAM)")
    engine.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV cache pages (default: from the memory budget)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model dtype; fp8 (= fp8_e4m3): e4m3 rows with a per-token scale, about half the bytes per token")
    engine.add_argument("--max-grammar-bytes", type=int, default=MAX_GRAMMAR_BYTES, metavar="N",
                        help="the largest structured_outputs (schema, regex, choice list or grammar, in bytes) a request may give; "
                             f"larger ones are refused (default {MAX_GRAMMAR_BYTES})")
    engine.add_argument("--no-prefix-caching", action="store_true", help="switch the prefix cache off")
    engine.add_argument("--kv-offload-cpu-gib", type=float, metavar="GIB",
                        help="keep prefix-cache blocks that leave the device in this much pinned host memory, and load them back on a hit")
    engine.add_argument("--kv-offload-dir", metavar="DIR",
                        help="keep prefix-cache blocks in this directory too: checksummed files, found again after a restart and by every "
                             "process given the same directory")
    engine.add_argument("--kv-offload-disk-gib", type=float, metavar="GIB", help="the most --kv-offload-dir holds (default: half its free space)")
    engine.add_argument("--kv-offload-ttl", type=float, metavar="S", dest="kv_offload_ttl_s",
                        help="seconds a block lives in --kv-offload-dir and --kv-store-url from its write (default: no expiry)")
    engine.add_argument("--kv-store-url", metavar="URL",
                        help="a shared KV store behind the other tiers: redis://HOST:PORT/DB or valkey://... (pip install 'deepinfer[redis]'), "
                             "or a plugin's scheme")
    engine.add_argument("--swa-bounded-replay", action=argparse.BooleanOptionalAction, default=True,
                        help="DeepSeek-V4.1: at prefill run the decoder layers (after the last KV source) only on the prompt's last "
                             "sliding_window + dspark_block_size tokens, the encoder layers on every token (an approximation of a full "
                             "prefill; default on; --no-swa-bounded-replay runs every layer on every token)")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (cuda backend)")
    engine.add_argument("--no-overlap", action="store_true", help="each decode step waits for the one before (default: overlap scheduling on cuda and ascend)")
    engine.add_argument("--no-mixed-steps", action="store_true",
                        help="prefill steps do not also decode running requests (default: they do, except in deterministic mode)")
    speculative = p.add_argument_group("speculative", SPECULATIVE_HELP)
    speculative.add_argument("--speculative", metavar="SPEC",
                             help="speculative decoding: METHOD[:NUM_DRAFTS[:POLICY]] (e.g. mtp:3:confidence, or dspark on DeepSeek-V4.1) or a "
                                  "JSON object {\"method\": \"mtp\"|\"dspark\", \"num_drafts\": 3, \"policy\": \"fixed\"|\"confidence\"|\"head\"}; "
                                  "the checkpoint's MTP (V2/V3/V4) or DSpark (V4.1) layers draft, the model verifies")
    backend = p.add_argument_group("backend", BACKEND_HELP)
    backend.add_argument("--backend", default="auto", help="auto (cuda, then ascend, then reference), cuda, ascend or reference")
    backend.add_argument("--allow-fallback", action="store_true", help="let the reference serve ops the backend has no kernel for")
    backend.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                         help="a backend option, e.g. ep_path=nccl (repeatable; `deepinfer backends` lists each backend's options)")
    backend.add_argument("--deterministic", action="store_true",
                         help="batch-invariant kernels only: a request's logits and tokens are bit-identical whatever it is batched with "
                              "(an error names any op the backend has no such kernel for)")
    backend.add_argument("--interpret", action="store_true",
                         help="run the backend's Triton kernels in the Triton interpreter on the CPU (slow; for checking kernels)")
    backend.add_argument("--cpu-threads", type=int, metavar="N",
                         help="torch's CPU threads (default on the CPU: OMP_NUM_THREADS if set, else the usable cores but one)")
    ep = p.add_argument_group("parallel", PARALLEL_HELP)
    ep.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                    help="accepted for vLLM command lines: 1 only (deepinfer has no tensor parallelism; use --ep N)")
    ep.add_argument("--ep", type=int, metavar="N", help="shard the experts over N devices, one process each (default 1; under torchrun: its process count)")
    ep.add_argument("--num-redundant-experts", type=int, default=0, metavar="R",
                    help="extra copies of busy experts per MoE layer (experts + R must divide by N)")
    ep.add_argument("--eplb", action="store_true", help="count the expert load and re-place the experts by EPLB every --eplb-interval steps")
    ep.add_argument("--eplb-interval", type=int, default=1000, metavar="STEPS", help="steps between EPLB rebalances (default 1000)")
    ep.add_argument("--expert-load", metavar="FILE", help="JSON [MoE layers][experts] token counts: place the experts by EPLB from the start")
    ep.add_argument("--dist-timeout", type=float, default=300.0, metavar="S",
                    help="seconds (> 0) a rank waits for the others in a collective before the run fails (default 300)")


def load_llm(args, ctx):
    """The run's LLM (every rank builds the same one; `ctx`: the rank's DistContext, None alone)."""
    from deepinfer.engine.llm import LLM
    from deepinfer.options import parse_assignments

    return LLM(
        model=args.model,
        backend=args.backend,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        swa_bounded_replay=args.swa_bounded_replay,
        enforce_eager=args.enforce_eager,
        interpret=args.interpret,
        allow_fallback=args.allow_fallback,
        backend_options=parse_assignments(args.backend_option),
        ep=ctx.world_size if ctx is not None else 1,
        num_redundant_experts=args.num_redundant_experts,
        eplb_interval=args.eplb_interval if args.eplb else None,
        expert_load=args.expert_load,
        dist_timeout=args.dist_timeout,
        cpu_threads=args.cpu_threads,
        kv_cache_dtype=args.kv_cache_dtype,
        deterministic=args.deterministic,
        speculative=args.speculative,
        overlap=False if args.no_overlap else None,
        mixed_steps=False if args.no_mixed_steps else None,
        logprobs_mode=args.logprobs_mode,
        max_grammar_bytes=args.max_grammar_bytes,
        kv_offload_cpu_gib=args.kv_offload_cpu_gib,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_disk_gib=args.kv_offload_disk_gib,
        kv_offload_ttl_s=args.kv_offload_ttl_s,
        kv_store_url=args.kv_store_url,
    )


def check_engine_flags(args) -> None:
    """Engine flag values no run could use: one line naming the flag (exit 2), before anything starts."""
    from deepinfer.distributed.environment import check_timeout
    from deepinfer.engine.cpu_threads import MAX_CPU_THREADS

    if args.tensor_parallel_size != 1:
        size = args.tensor_parallel_size
        if size < 1:
            raise UserError(f"--tensor-parallel-size must be 1, got {size}")
        raise UserError(
            f"--tensor-parallel-size {size}: deepinfer has no tensor parallelism; it spreads a MoE model over {size} devices "
            f"by expert parallelism, with attention data parallel: --ep {size} (docs/distributed.md)"
        )
    if args.ep is not None and args.ep < 1:
        raise UserError(f"--ep must be >= 1, got {args.ep}")
    counts = (
        ("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-model-len", args.max_model_len), ("--num-kv-blocks", args.num_kv_blocks), ("--eplb-interval", args.eplb_interval),
        ("--max-grammar-bytes", args.max_grammar_bytes),
    )
    for flag, value in counts:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--kv-offload-cpu-gib", args.kv_offload_cpu_gib), ("--kv-offload-disk-gib", args.kv_offload_disk_gib),
                        ("--kv-offload-ttl", args.kv_offload_ttl_s)):  # fmt: skip
        if value is not None and not value > 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    if args.kv_offload_disk_gib is not None and args.kv_offload_dir is None:
        raise UserError("--kv-offload-disk-gib sizes the disk tier: give --kv-offload-dir too")
    if args.kv_offload_ttl_s is not None and args.kv_offload_dir is None and args.kv_store_url is None:
        raise UserError("--kv-offload-ttl is the lifetime of --kv-offload-dir's and --kv-store-url's blocks: give one of them too")
    if (args.kv_offload_cpu_gib or args.kv_offload_dir or args.kv_store_url) and args.no_prefix_caching:
        raise UserError("the KV offload flags keep prefix-cache blocks: they do not combine with --no-prefix-caching")
    if args.kv_store_url:
        from deepinfer.kv_tiers.open_store import store_entry_point

        try:
            store_entry_point(args.kv_store_url)
        except ValueError as exc:
            raise UserError(f"--kv-store-url: {exc}") from None
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {args.gpu_memory_utilization}")
    if args.num_redundant_experts < 0:
        raise UserError(f"--num-redundant-experts must be >= 0, got {args.num_redundant_experts}")
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= MAX_CPU_THREADS:
        raise UserError(f"--cpu-threads must lie in [1, {MAX_CPU_THREADS}], got {args.cpu_threads}")
    check_timeout(args.dist_timeout, "--dist-timeout")
    read_chat_template(args.chat_template)
    from deepinfer.model.embedded_names import check_model_path

    check_model_path(args.model)  # a misspelt embedded name lists them, at once
    if args.backend != "auto":
        from deepinfer import plugins

        plugins.load_plugins().backend(args.backend)  # the name only: declaring backends imports no torch, probing might
    if args.tokenizer is not None:
        from deepinfer.model.tokenizer import check_tokenizer_folder

        check_tokenizer_folder(args.tokenizer)
    if args.speculative is not None:
        from deepinfer.engine.speculative.config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(args.speculative)
        except UserError as exc:
            raise UserError(f"--speculative: {str(exc).removeprefix('speculative: ')}") from None


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as Jinja source: the file it names, else the value itself when it reads as a
    template (it holds a brace or a newline; vLLM's rule). One line (exit 2) otherwise."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a template longer than a file name may be
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--chat-template: cannot read {value} ({exc})") from None
    if not any(c in value for c in "{}\n"):
        raise UserError(f"--chat-template {value}: no such file (and it is not a Jinja template)")
    return value
