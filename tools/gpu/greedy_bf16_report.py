"""Greedy tokens of the tiny embedded model: cuda bf16 / float32 against the reference backend (GPU only).

Prints, per prompt, the first 16 tokens of each and where they first differ, with the reference
float32 logit margin (top-1 minus top-2) at that step: a near-tie explains a bf16 flip, a wide
margin points at a kernel.
"""

import torch

from deepinfer import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "In 1969, the first person to walk on the moon was"]
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2) if "logprobs" in SamplingParams.__dataclass_fields__ else SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(backend, dtype):
    llm = LLM(backend=backend, dtype=dtype, announce=False, seed=0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


runs = {(b, d): tokens(b, d) for b, d in (("reference", "float32"), ("reference", "bfloat16"), ("cuda", "float32"), ("cuda", "bfloat16"))}
ref = runs[("reference", "float32")]
model = LLM(backend="reference", dtype="float32", announce=False).engine
for i, prompt in enumerate(PROMPTS):
    print(f"prompt {i}: {prompt!r}")
    for key, toks in runs.items():
        first = next((j for j, (a, b) in enumerate(zip(toks[i], ref[i])) if a != b), None)
        print(f"  {key[0]:>9} {key[1]:>8}: {toks[i]}  first difference from reference fp32: {first}")
torch.cuda.synchronize()
