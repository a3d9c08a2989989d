import time, statistics, torch, llguidance, random, sys
from llguidance.torch import fill_next_token_bitmask_par
from deepinfer.bench import structured as bench
from deepinfer.model import embedded
from deepinfer.model.tokenizer import Tokenizer
from deepinfer.engine.structured_output import GrammarCompiler, SequenceGrammar, grammar_text
folder = embedded.ensure_embedded(alias="tiny-v3")
C = embedded.CONFIG
tok = Tokenizer.from_folder(folder, bos_token_id=C["bos_token_id"], eos_token_ids=[C["eos_token_id"]])
gc = GrammarCompiler(tok, C["vocab_size"], [C["eos_token_id"]])
spec = bench.spec_of(16)
template = gc.submit(spec).result()
text = grammar_text(spec)
t0=time.perf_counter(); other = llguidance.LLMatcher(gc.ll_tokenizer(), text, log_level=0); print(f"one more compile {1e3*(time.perf_counter()-t0):.1f} ms")
V=C["vocab_size"]; words=-(-V//32); B=int(sys.argv[1]) if len(sys.argv)>1 else 64
def walk(groups, threads, steps=40):
    templates=[template]+[llguidance.LLMatcher(gc.ll_tokenizer(), text, log_level=0) for _ in range(groups-1)]
    gs=[SequenceGrammar(templates[i%groups]) for i in range(B)]
    host=torch.empty((B,words),dtype=torch.int32); ex=llguidance.LLExecutor(threads); rng=random.Random(0); fills=[]
    for step in range(steps):
        t0=time.perf_counter(); fill_next_token_bitmask_par(ex,[(g.matcher,i) for i,g in enumerate(gs)],host); fills.append(time.perf_counter()-t0)
        bits=((host.unsqueeze(-1) >> torch.arange(32,dtype=torch.int32)) & 1).reshape(B,-1)[:, :V]
        for i,g in enumerate(gs):
            allowed=torch.nonzero(bits[i]).flatten()
            g.accept(int(allowed[rng.randrange(len(allowed))]))
    return 1e3*statistics.median(fills[5:])
for threads in (1, 2, 3, 4, 6):
    print(f"B{B} threads {threads}: {walk(1, threads):.2f} ms", flush=True)
# does the fill release the GIL? a Python thread counts while the main thread fills
import threading
gs=[SequenceGrammar(template) for i in range(B)]
host=torch.empty((B,words),dtype=torch.int32); ex=llguidance.LLExecutor(1)
count=[0]; stop=[False]
def spin():
    while not stop[0]:
        count[0]+=1
th=threading.Thread(target=spin); th.start(); time.sleep(0.05)
c0=count[0]; t0=time.perf_counter()
for _ in range(50):
    fill_next_token_bitmask_par(ex,[(g.matcher,i) for i,g in enumerate(gs)],host)
dt=time.perf_counter()-t0; c1=count[0]; time.sleep(dt); c2=count[0]; stop[0]=True; th.join()
print(f"spin count during fills {c1-c0}, during as long a sleep {c2-c1} (equal: the fill releases the GIL)")
