import time, resource
from deepinfer import LLM, SamplingParams
from deepinfer.engine.structured_params import StructuredOutputsParams
llm = LLM(seed=0)
llm.generate(["warm"], SamplingParams(max_tokens=2), use_tqdm=False) if "use_tqdm" in LLM.generate.__code__.co_varnames else llm.generate(["warm"], SamplingParams(max_tokens=2))
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF); c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
w, c = time.perf_counter(), cpu()
out = llm.generate(["Is Paris in France?"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
print(f"first structured generate: wall {time.perf_counter()-w:.2f} s, cpu {cpu()-c:.2f} s, text {out[0].outputs[0].text!r}")
w, c = time.perf_counter(), cpu()
out = llm.generate(["Is Paris in France?"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))
print(f"second structured generate: wall {time.perf_counter()-w:.2f} s, cpu {cpu()-c:.2f} s, text {out[0].outputs[0].text!r}")
