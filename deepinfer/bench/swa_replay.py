"""DeepSeek-V4.1's decoder SWA bounded replay, on against off: what the approximation changes and what it saves.

For each prompt length L, one random prompt (token ids drawn from a seeded generator):
- logits: one prefill of the prompt through the model with the bounded replay's host facts and one without
  (every layer on every token), the last position's float32 logits compared: the largest absolute difference,
  the largest logit (its scale), whether the two argmaxes agree and the replay-off top-1 - top-2 margin;
- greedy agreement: `output_tokens` greedy tokens on an engine with the replay on and one with it off (no prefix
  caching, one request at a time): the positions where they agree, and the first where they differ;
- prefill cost: the layer-token rows the prefill computes (encoder layers x L + decoder layers x the rows from
  the sequence's decoder_from; off: every layer x L), and the time to the first token on each engine, fastest of
  `repeat` runs (the prefill steps, sampling included).
The engines load the model once each; timings are of the machine and backend named in the output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.bench.prefix_replay import machine_info, timed_request

BLOCK = 16  # token block size of `last_logits`' own caches


@dataclass
class ReplayComparison:
    prompt_len: int
    decoder_from: int  # the first position the decoder layers compute with the replay on
    rows_on: int  # layer-token rows of the prefill with the replay on
    rows_off: int
    decoder_rows_on: int
    decoder_rows_off: int
    prefill_ms_on: float  # time to the first token, fastest of the repeats
    prefill_ms_off: float
    max_logit_diff: float  # last position, |on - off|, largest over the vocabulary
    max_abs_logit: float  # the largest |logit| of the replay-off prefill: the scale of the difference
    argmax_equal: bool
    greedy_margin: float  # the replay-off prefill's top-1 minus top-2 logit: how far its greedy choice is from flipping
    greedy_agree: int  # positions of the greedy continuations that are equal
    first_divergence: int | None  # the first position where they differ (None: never)
    output_tokens: int


def last_logits(model, ids: list[int], bounded: bool, device) -> torch.Tensor:
    """The last position's float32 logits of one prefill of `ids` in a fresh state slot (every layer on every
    token unless `bounded`)."""
    from deepinfer.model.forward_batch import ForwardBatch, HostBatch

    n = len(ids)
    blocks = -(-n // BLOCK)  # the prompt's history in blocks 0, 1, ... of caches of its own
    decoder_from = [model.decoder_replay_start(n)] if bounded else None
    host = HostBatch(starts=[0], lengths=[n], cached=[0], slots=[0], pages=[list(range(blocks))], decoder_from=decoder_from)
    batch = ForwardBatch(
        is_prefill=True, input_ids=torch.tensor(ids, device=device), positions=torch.arange(n, device=device),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device), block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        logits_indices=torch.tensor([n - 1], device=device), max_query_len=n, max_seq_len=n, host=host,
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),
    )  # fmt: skip
    return model.forward(batch, model.new_caches(blocks, BLOCK, 1, model.dtype))[0].float().cpu()


def run(
    backend: str = "reference",
    model: str = "tiny-v41",
    prompt_lens=(256, 512, 960),
    output_tokens: int = 32,
    repeat: int = 3,
    max_num_batched_tokens: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    json_path: Path | None = None,
    backend_options: dict[str, str] | None = None,
    cpu_threads: int | None = None,
) -> tuple[dict, list[ReplayComparison]]:
    """Returns (settings, one comparison per prompt length); a model other than DeepSeek-V4.1 is a ValueError."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.model.deepseek_v41 import bounded_replay

    engines = {}
    for on in (True, False):
        engines[on] = LLM(model=model, backend=backend, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=False, max_model_len=max(prompt_lens) + output_tokens, swa_bounded_replay=on, announce=False,
                          backend_options=backend_options, cpu_threads=cpu_threads).engine  # fmt: skip
    loaded = engines[True].loaded
    if loaded.config.model_type != "deepseek_v41":
        raise ValueError(f"the bounded replay is DeepSeek-V4.1's; {model} is {loaded.config.model_type}")
    config, net = loaded.config, loaded.model
    layers, decoder_layers = config.num_hidden_layers, config.num_hidden_layers - bounded_replay.decoder_start(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)

    def random_ids(n: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()

    warm_up = random_ids(bounded_replay.replay_tail(config) + 16)
    for engine in engines.values():
        timed_request(engine, warm_up, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    results = []
    for length in prompt_lens:
        prompt = random_ids(length)
        start = net.decoder_replay_start(length)
        on, off = last_logits(net, prompt, True, net.device), last_logits(net, prompt, False, net.device)
        runs = {flag: [timed_request(engine, prompt, params) for _ in range(repeat)] for flag, engine in engines.items()}
        tokens_on, tokens_off = runs[True][0][2], runs[False][0][2]
        differ = [i for i, (a, b) in enumerate(zip(tokens_on, tokens_off)) if a != b]
        results.append(ReplayComparison(
            length, start, (layers - decoder_layers) * length + decoder_layers * (length - start), layers * length,
            decoder_layers * (length - start), decoder_layers * length,
            min(r[0] for r in runs[True]) * 1e3, min(r[0] for r in runs[False]) * 1e3,
            float((on - off).abs().max()), float(off.abs().max()), int(on.argmax()) == int(off.argmax()), float(-off.topk(2).values.diff()),
            len(tokens_on) - len(differ), differ[0] if differ else None, output_tokens,
        ))  # fmt: skip
    settings = {"model": model, "dtype": dtype, "replay_tail": bounded_replay.replay_tail(config), "decoder_layers": decoder_layers, "layers": layers,
                "output_tokens": output_tokens, "repeat": repeat, "max_num_batched_tokens": max_num_batched_tokens, "seed": seed}  # fmt: skip
    if json_path is not None:
        payload = {"machine": machine_info(engines[True]), "settings": settings, "results": [asdict(r) for r in results]}
        json_path.write_text(json.dumps(payload, indent=1) + "\n")
    return settings, results


def format_results(settings: dict, results: list[ReplayComparison]) -> str:
    lines = [
        f"bounded replay: decoder layers {settings['decoder_layers']} of {settings['layers']} on the prompt's last {settings['replay_tail']} tokens; "
        f"{settings['output_tokens']} greedy tokens compared",
        "  prompt  decoder rows on/off  all rows on/off  prefill ms on   off  speedup  max |dlogit|  max |logit|  argmax  margin  greedy agree  first diff",
    ]
    for r in results:
        diff = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(
            f"{r.prompt_len:8d}  {r.decoder_rows_on:8d}/{r.decoder_rows_off:<8d}  {r.rows_on:7d}/{r.rows_off:<7d}"
            f"  {r.prefill_ms_on:13.1f} {r.prefill_ms_off:5.1f}  {r.prefill_ms_off / r.prefill_ms_on:6.2f}x"
            f"  {r.max_logit_diff:12.3g}  {r.max_abs_logit:11.3g}  {str(r.argmax_equal).lower():>6}  {r.greedy_margin:6.3f}"
            f"  {r.greedy_agree:5d}/{r.output_tokens:<6d}  {diff:>10}"
        )
    return "\n".join(lines)
