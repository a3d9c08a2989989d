"""Repetition, frequency and presence penalties (vLLM's, OpenAI's): logits pushed away from tokens a
request has already seen, read from a per-request token history kept on the device.

The history lives in slot tables the engine owns (deepinfer.engine.penalty_history): a slot per
penalized request, holding how many times it generated each token and which tokens its prompt
holds. A row names its slot; the op never sees token lists, so its cost is one pass over the
row's logits and counts, whatever the sequence's length.
"""

from __future__ import annotations

import torch

from deepinfer.registry import ALLCLOSE, op


def unpack_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 words -> [R, V] bool: bit (v % 32) of word v // 32 (bit 31 is the sign bit)."""
    widened = words.long() & 0xFFFFFFFF
    bit_index = torch.arange(32, device=words.device, dtype=torch.int64)
    return ((widened[:, :, None] >> bit_index) & 1).flatten(1)[:, :vocab].bool()


def penalty_kernel_args(logits, slots, output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty) -> list | None:
    """The kernels' tensor arguments (slots int64; output counts and prompt mask int32 with unit-stride
    rows; the three penalties float32) after the checks; None when logits is empty. Both backends'
    launchers start here."""
    check_penalty_inputs(logits, slots, output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty)
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return None
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"apply_penalties runs on float32 logits with unit-stride rows, got {logits.dtype} with strides {logits.stride()}")
    counts = output_counts if output_counts.dtype == torch.int32 and output_counts.stride(-1) == 1 else output_counts.to(torch.int32).contiguous()
    mask = prompt_mask if prompt_mask.dtype == torch.int32 and prompt_mask.stride(-1) == 1 else prompt_mask.to(torch.int32).contiguous()
    params = [t.to(torch.float32).contiguous() for t in (presence_penalty, frequency_penalty, repetition_penalty)]
    return [slots.to(torch.int64).contiguous(), counts, mask, *params]


def check_penalty_inputs(logits, slots, output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty) -> None:
    """One-line ValueErrors for shapes that do not fit together (every backend calls this)."""
    rows, vocab = logits.shape
    if output_counts.dim() != 2 or output_counts.shape[1] != vocab:
        raise ValueError(f"output_counts has shape {tuple(output_counts.shape)}, expected [slots, {vocab}] for logits {tuple(logits.shape)}")
    if tuple(prompt_mask.shape) != (output_counts.shape[0], (vocab + 31) // 32):
        raise ValueError(f"prompt_mask has shape {tuple(prompt_mask.shape)}, expected ({output_counts.shape[0]}, {(vocab + 31) // 32})")
    for name, value in (("slots", slots), ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty)):  # fmt: skip
        if tuple(value.shape) != (rows,):
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({rows},) for logits {tuple(logits.shape)}")


@op(family="sampling", outputs=("logits",), compare=ALLCLOSE, golden_precision="native", in_place="logits")
def apply_penalties(
    logits: torch.Tensor,
    slots: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalize seen tokens, in place. logits: [B, V] float32 (modified and returned); slots: [B]
    int64, the row's slot in the history tables (< 0: the row has none and is left unchanged);
    output_counts: [S, V] int32, per slot how many times each token was generated; prompt_mask:
    [S, ceil(V/32)] int32, per slot bit (v % 32) of word v // 32 set = token v is in the prompt;
    presence_penalty, frequency_penalty, repetition_penalty: [B] float32.

    Per row with slot s, in float32 and in this order (vLLM's apply_penalties):
      c = output_counts[s, v]; seen = c > 0 or v in the prompt;
      repetition: a seen token's logit x becomes x / r when x > 0, else x * r (r = repetition_penalty);
      frequency:  x - f * c (the product rounded, then the difference);
      presence:   x - p where c > 0.
    -inf stays -inf. Neutral values (r = 1, f = p = 0) leave every logit bit for bit unchanged.
    """
    check_penalty_inputs(logits, slots, output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty)
    rows, vocab = logits.shape
    if rows == 0:
        return logits
    active = (slots >= 0)[:, None]
    state = slots.long().clamp(min=0)
    counts = output_counts[state]
    generated = counts > 0
    seen = generated | unpack_bits(prompt_mask[state], vocab)
    x = logits.float()
    r = repetition_penalty.float()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency_penalty.float()[:, None] * counts.float()
    x = torch.where(generated, x - presence_penalty.float()[:, None], x)
    return logits.copy_(torch.where(active, x, logits))
