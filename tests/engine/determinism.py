"""What the deterministic-mode tests share: a probe request's logits recorded at every step, batches
of other requests around it, and small checkpoints (a 512-token vocabulary) that the Triton
interpreter can run in batches of 64."""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROBE_SEED = 987_654_321  # the probe's sampling seed: how the recorder finds its rows
SMALL_VOCAB = 512


class ProbeLogits:
    """Wraps the engine's resolved `sample` op and keeps the float32 logits of every row sampled
    with PROBE_SEED, by the position of the token it samples. Eager steps only (a replayed device
    graph would not call the wrapper)."""

    def __init__(self, llm):
        self.ops = llm.engine.runner.ops
        self.inner = self.ops.sample
        self.steps: dict[int, torch.Tensor] = {}
        self.ops.sample = self._sample

    def _sample(self, *, logits, seeds, positions, **kwargs):
        for row, seed in enumerate(seeds.tolist()):
            if seed == PROBE_SEED:
                self.steps[int(positions[row])] = logits[row].detach().to("cpu", copy=True)
        return self.inner(logits=logits, seeds=seeds, positions=positions, **kwargs)

    def take(self) -> dict[int, torch.Tensor]:
        steps, self.steps = self.steps, {}
        return steps


def neighbour_prompts(count: int, vocab: int, seed: int, lengths: tuple[int, int] = (2, 40)) -> list[dict]:
    """`count` random token-id prompts of random lengths (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (count,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in sizes]


def run_probe(llm, recorder: ProbeLogits, probe_ids: list[int], neighbours: list[dict], max_tokens: int, temperature: float = 0.0):
    """Generate the probe among `neighbours` (placed in the middle; the neighbours greedy, with
    their own lengths so the batch changes shape while the probe decodes). Returns (logits per
    step, the probe's tokens, its prompt tokens served from the prefix cache)."""
    from deepinfer import SamplingParams

    prompts = list(neighbours)
    at = len(prompts) // 2
    prompts.insert(at, {"prompt_token_ids": probe_ids})
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % (2 * max_tokens), ignore_eos=True, seed=i) for i in range(len(prompts))]
    params[at] = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=PROBE_SEED)
    recorder.take()
    out = llm.generate(prompts, params, use_tqdm=False)[at]
    return recorder.take(), out.outputs[0].token_ids, out.num_cached_tokens


def differing_steps(want: dict[int, torch.Tensor], got: dict[int, torch.Tensor]) -> list[tuple[int, float]]:
    """(position, max |difference|) of every step whose logits are not bit-identical."""
    assert sorted(want) == sorted(got), f"steps {sorted(got)} vs {sorted(want)}"
    return [(p, float((got[p] - want[p]).abs().max())) for p in sorted(want) if not torch.equal(got[p], want[p])]


def write_small_checkpoint(folder: Path, model_type: str = "deepseek_v3", **overrides) -> Path:
    """The embedded tiny V3 (or V4) with a SMALL_VOCAB vocabulary and no tokenizer (prompts are token
    ids); `overrides` change more of its config (e.g. fewer layers)."""
    from safetensors.torch import save_file

    from deepinfer.model import embedded
    from deepinfer.model.config import ModelConfig

    folder.mkdir(parents=True, exist_ok=True)
    if model_type == "deepseek_v4":
        config = {**embedded.V4_CONFIG, "vocab_size": SMALL_VOCAB, **overrides}
        tensors = embedded.random_v4_weights(config)
    else:
        config = {**embedded.CONFIG, "vocab_size": SMALL_VOCAB, **overrides}
        tensors = embedded.random_weights(ModelConfig.from_dict(config))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
