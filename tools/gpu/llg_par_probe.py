"""How fast llguidance fills a step's masks, by executor thread count (H200 host; CPU only).

B matchers of `bench structured`'s schema (DeepSeek-V3's vocabulary) walk at random, as a
random-weight model samples: each step fills all B masks (fill_next_token_bitmask_par, median ms
over the steps) and advances every matcher by a uniformly random allowed token. Then whether the
fill releases the GIL: a Python thread counts while the main thread fills, and as long again while
it sleeps (equal counts: released).

    python tools/gpu/llg_par_probe.py B
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time

import llguidance
import torch
from llguidance.torch import fill_next_token_bitmask_par

from deepinfer.bench import structured as bench
from deepinfer.engine.structured_output import GrammarCompiler, SequenceGrammar
from deepinfer.model import embedded
from deepinfer.model.tokenizer import Tokenizer


def allowed_tokens(mask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = ((mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:vocab]
    return torch.nonzero(bits).flatten()


def walk(template, batch: int, vocab: int, threads: int, steps: int = 40) -> float:
    """Median ms of a step's fill of `batch` matchers walking at random."""
    grammars = [SequenceGrammar(template) for _ in range(batch)]
    host = torch.empty((batch, -(-vocab // 32)), dtype=torch.int32)
    executor, rng, fills = llguidance.LLExecutor(threads), random.Random(0), []
    for _ in range(steps):
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(g.matcher, i) for i, g in enumerate(grammars)], host)
        fills.append(time.perf_counter() - start)
        for i, grammar in enumerate(grammars):
            allowed = allowed_tokens(host[i], vocab)
            grammar.accept(int(allowed[rng.randrange(len(allowed))]))
    return 1e3 * statistics.median(fills[5:])


def gil_released(template, batch: int, vocab: int) -> tuple[int, int]:
    """(a spinning thread's count during 50 fills, during as long a sleep)."""
    grammars = [SequenceGrammar(template) for _ in range(batch)]
    host = torch.empty((batch, -(-vocab // 32)), dtype=torch.int32)
    executor = llguidance.LLExecutor(1)
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    c0, start = count[0], time.perf_counter()
    for _ in range(50):
        fill_next_token_bitmask_par(executor, [(g.matcher, i) for i, g in enumerate(grammars)], host)
    spent = time.perf_counter() - start
    c1 = count[0]
    time.sleep(spent)
    c2 = count[0]
    stop[0] = True
    thread.join()
    return c1 - c0, c2 - c1


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    folder = embedded.ensure_embedded(alias="tiny-v3")
    config = embedded.CONFIG
    tokenizer = Tokenizer.from_folder(folder, bos_token_id=config["bos_token_id"], eos_token_ids=[config["eos_token_id"]])
    vocab = config["vocab_size"]
    template = GrammarCompiler(tokenizer, vocab, [config["eos_token_id"]]).submit(bench.spec_of(16)).result()
    for threads in (1, 2, 3, 4, 6):
        print(f"B{batch} threads {threads}: {walk(template, batch, vocab, threads):.2f} ms", flush=True)
    during, sleeping = gil_released(template, batch, vocab)
    print(f"spin count during fills {during}, during as long a sleep {sleeping} (equal: the fill releases the GIL)")


if __name__ == "__main__":
    main()
