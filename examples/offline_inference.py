"""Offline inference with deepinfer's Python API (vLLM's shape).

    python examples/offline_inference.py                      # the embedded tiny model (dummy weights)
    python examples/offline_inference.py --model /path/to/DeepSeek-V3 --backend cuda
"""

import argparse

from deepinfer import LLM, SamplingParams

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="an HF checkpoint folder (default: the embedded tiny model)")
parser.add_argument("--backend", default="auto", help="auto, cuda, ascend or reference")
args = parser.parse_args()

# backend="auto" picks cuda, then ascend, then reference, and says which. seed=0 makes runs repeat:
# each request samples with a seed derived from it (or with SamplingParams(seed=...) when given).
llm = LLM(model=args.model, backend=args.backend, seed=0)

prompts = [
    "Hello, my name is",
    "The capital of France is",
    {"prompt_token_ids": llm.get_tokenizer().encode("The future of AI is")},  # token ids work too
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)
outputs = llm.generate(prompts, sampling_params)  # one RequestOutput per prompt, in input order

for output in outputs:
    completion = output.outputs[0]
    # A token-id prompt has no text of its own (output.prompt is None): show its ids instead.
    shown = repr(output.prompt) if output.prompt is not None else f"token ids {output.prompt_token_ids}"
    print(f"prompt: {shown} ({len(output.prompt_token_ids)} tokens)")
    print(f"  text: {completion.text!r}  [{completion.finish_reason}, {len(completion.token_ids)} tokens]")

# Greedy decoding, a stop string, and one SamplingParams per prompt:
greedy = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=32, stop=["."])]
for output in llm.generate(["Once upon a time", "The quick brown fox"], greedy, use_tqdm=False):
    print(repr(output.outputs[0].text), output.outputs[0].finish_reason)
