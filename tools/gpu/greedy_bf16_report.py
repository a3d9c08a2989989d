"""Greedy tokens of the tiny embedded model: cuda bf16 / float32 against the reference backend (GPU only).

Prints, per prompt, the first 16 tokens of each run and where each first differs from the
reference backend's float32 tokens.
"""

from deepinfer import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "In 1969, the first person to walk on the moon was"]
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(backend, dtype):
    llm = LLM(backend=backend, dtype=dtype, announce=False, seed=0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


runs = {(b, d): tokens(b, d) for b, d in (("reference", "float32"), ("reference", "bfloat16"), ("cuda", "float32"), ("cuda", "bfloat16"))}
ref = runs[("reference", "float32")]
for i, prompt in enumerate(PROMPTS):
    print(f"prompt {i}: {prompt!r}")
    for key, toks in runs.items():
        first = next((j for j, (a, b) in enumerate(zip(toks[i], ref[i])) if a != b), None)
        print(f"  {key[0]:>9} {key[1]:>8}: {toks[i]}  first difference from reference fp32: {first}")
