"""DeepSeek-V4.1's decoder SWA bounded replay: at prefill the decoder layers run on the prompt's tail only.

V4.1's layers split in two (docs/models/deepseek_v41.md). The encoder, layers 0 .. the last KV source (0-20 in the
release), writes everything a later token reads from far away: the compressed KV and index keys, Engram's n-gram
history. The decoder, every layer after the last KV source (21-39), owns nothing but its window ring: it reads
the encoder's compressed KV through the encoder's (or its own Reindex layers') selection, plus its own window. So
with the bounded replay on, a prefill runs the encoder on every prompt token and the decoder only on the prompt's
last `replay_tail` tokens, whatever the prompt's length; decode steps run every layer on their token as always.

`replay_tail` = the sliding window plus one DSpark block (the release's ring: 128 + 5 = 133 rows, as ATOM sizes
it), so the decoder rows a decode step reads were computed from windows of at least `dspark_block_size` rows.

It is an approximation of a full prefill: a decoder row at the tail's start sees a window truncated at the tail
start (the decoder rows before it were never computed), and from the next decoder layer on even the last prompt
token's window holds rows computed from truncated windows; the encoder's state is exact. What the decoder layers
attend to, exactly: at decoder layer l, the tail row at position t (t >= b, b = the sequence's `decoder_from`)
attends to layer l's window rows of positions max(b, t - window + 1) .. t (computed on the tail), the compressed
entries its top-k owner selects for t (an encoder layer's selection at t, or a decoder Reindex layer's over the
full compressed history) and the sink. Below the tail nothing of layer l exists.

The boundary is a sequence's property, not a step's: `decoder_from` = max(0, prompt tokens - replay_tail), so a
prompt prefilled in chunks, a recomputation after preemption and a prefix hit (which reaches no further than
`decoder_from`: the model's `prefix_hit_limit`) all compute the same rows as one prefill. With `decoder_from` 0 (a
prompt no longer than the tail, the replay off, or a request that wants its prompt's logprobs) every layer runs on
every token, exactly the forward without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.spans import SharedKV, Span


def decoder_start(config: V41Config) -> int:
    """The first decoder layer: the one after the last KV source (num_hidden_layers when there is none)."""
    sources = config.kv_source_layer_ids
    return max(sources) + 1 if sources else config.num_hidden_layers


def replay_tail(config: V41Config) -> int:
    """The prompt tokens the decoder layers run on: the window plus a DSpark block of slack."""
    return config.sliding_window + (config.dspark_block_size if config.num_nextn_predict_layers else 0)


def decoder_from(config: V41Config, prompt_tokens: int) -> int:
    """A sequence's first position the decoder layers compute, for a prompt of `prompt_tokens`."""
    return max(0, prompt_tokens - replay_tail(config)) if decoder_start(config) < config.num_hidden_layers else 0


@dataclass
class DecoderTail:
    """One step's rows that enter the decoder layers, with the spans and the cross-layer state they run with."""

    rows: torch.Tensor | None  # [T'] int64: the step's rows kept, ascending (None: every row)
    spans: list[Span]  # the kept rows' spans, window_from set to each sequence's decoder_from
    shared: list[SharedKV]  # each kept span's CSA2 state, the selections cut to its kept rows

    def logits_rows(self, wanted: torch.Tensor) -> torch.Tensor:
        """`wanted` rows of the step as rows of the tail; a ValueError when one was cut."""
        if self.rows is None:
            return wanted
        found = torch.searchsorted(self.rows, wanted).clamp(max=max(0, self.rows.numel() - 1))
        if wanted.numel() and (self.rows.numel() == 0 or not torch.equal(self.rows[found], wanted)):
            raise ValueError("a row whose logits are wanted lies before its sequence's decoder tail (the bounded replay computed no logits there)")
        return found


def decoder_tail(spans: list[Span], shared: list[SharedKV], starts: list[int], device) -> DecoderTail | None:
    """The decoder's part of a step whose sequences' decoder layers start at positions `starts` (decoder_from);
    None when every start is 0: every row enters the decoder, as without the bounded replay."""
    if not any(starts):
        return None
    kept_spans, kept_shared, pieces, offset, cut_any = [], [], [], 0, False
    for span, state, start in zip(spans, shared, starts):
        first = max(span.start, start)
        length = span.end - first
        if first > span.start:
            cut_any = True
        if length <= 0:
            continue
        cut = first - span.start
        pieces.append(torch.arange(span.offset + cut, span.offset + span.length, device=device))
        kept_spans.append(replace(span, start=first, length=length, offset=offset, window_from=start))
        kept_shared.append(_cut(state, cut))
        offset += length
    rows = (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)) if cut_any else None
    return DecoderTail(rows, kept_spans, kept_shared)


def _cut(state: SharedKV, cut: int) -> SharedKV:
    """The state with its per-token selections starting `cut` rows later (the compressed history is shared)."""
    if not cut:
        return state
    return replace(state, topk=None if state.topk is None else state.topk[cut:], blocks=None if state.blocks is None else state.blocks[cut:])
