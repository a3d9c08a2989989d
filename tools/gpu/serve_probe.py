"""Serving-latency probe (H200): `deepinfer serve`'s app and engine thread on the random V2-Lite-shaped
model, in a process of its own, for a `bench serve --url` client started by the shell script in
another process (so the client does not share this process's GIL).

It writes its port to --port-file once serving. Every SIGUSR1 prints one line: wall time and the
CPU seconds of the engine thread, the HTTP thread and the whole process since the last SIGUSR1, plus
the engine's step count and step seconds from the metrics; so the script can bracket each rate.
--sample-hz N: a sampler thread records, N times a second, where the engine and HTTP threads are
(their 4 innermost frames); SIGUSR2 prints the 25 commonest stacks of each and starts over.
--switch-interval S: sys.setswitchinterval(S) (CPython's default 0.005).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import threading
import time


def thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    def __init__(self, hz: float, threads: dict[str, threading.Thread]):
        super().__init__(daemon=True)
        self.period, self.threads = 1.0 / hz, threads
        self.counts = {name: collections.Counter() for name in threads}
        self.lock = threading.Lock()

    def run(self):
        while True:
            time.sleep(self.period)
            frames = sys._current_frames()
            with self.lock:
                for name, thread in self.threads.items():
                    frame, stack = frames.get(thread.ident), []
                    while frame is not None and len(stack) < 4:
                        stack.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}")
                        frame = frame.f_back
                    self.counts[name][" < ".join(stack)] += 1

    def dump(self):
        with self.lock:
            for name, counter in self.counts.items():
                total = sum(counter.values()) or 1
                print(f"--- {name}: {total} samples", flush=True)
                for stack, n in counter.most_common(25):
                    print(f"{100 * n / total:5.1f}%  {stack}", flush=True)
                counter.clear()


class Compiles:
    """Triton JIT compiles (new kernel specialisations) by kernel name, through triton.knobs' hooks."""

    def __init__(self):
        self.names, self.seconds, self._started, self.verbose = collections.Counter(), 0.0, {}, False
        try:
            from triton import knobs
        except ImportError:
            print("no triton.knobs: compiles are not counted", flush=True)
            return
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **kw):
        self._started[(getattr(kw.get("fn"), "name", "?"), str(kw.get("key")))] = time.perf_counter()
        return False

    def _after(self, **kw):
        name = getattr(kw.get("fn"), "name", "?")
        start = self._started.pop((name, str(kw.get("key"))), None)
        self.names[name] += 1
        if self.verbose:  # what made this specialisation new: its constexprs and argument types
            constants = {k: v for k, v in (kw.get("compile") or {}).get("constants", {}).items() if not str(k).startswith("(")}
            print(f"COMPILE {name} {str(kw.get('repr'))[:1500]} constants={str(constants)[:800]}", flush=True)
        if start is not None:
            self.seconds += time.perf_counter() - start

    def take(self) -> str:
        line = f"compiles {sum(self.names.values())} ({self.seconds:.2f} s): " + ", ".join(f"{n} x{c}" for n, c in self.names.most_common(12))
        self.names.clear()
        self.seconds = 0.0
        return line


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--model", default=None, help="an embedded or HF model instead of the random V2-Lite shape (a CPU try-out)")
    p.add_argument("--port-file", required=True)
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--sample-hz", type=float, default=0)
    args = p.parse_args()

    from deepinfer.bench.throughput import random_shape_llm
    from deepinfer.cli.bench_serve import InProcessServer

    compiles = Compiles()
    if args.model:
        from deepinfer import LLM

        llm = LLM(model=args.model, backend=args.backend, announce=False, seed=0, max_num_seqs=256)
    else:
        llm = random_shape_llm(args.backend, args.layers, {"seed": 0, "max_num_seqs": 256})
    if llm.compiles_on_first_use:
        print("warm-up", llm.warm_up(), flush=True)
    print("after warm-up:", compiles.take(), flush=True)
    compiles.verbose = True
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    server = InProcessServer(llm, "random", max_queue=4096)
    engine_thread, http_thread = server.front.loop._thread, server.thread
    metrics = server.front.metrics
    last = {"wall": time.monotonic(), "engine": thread_cpu_s(engine_thread.native_id), "http": thread_cpu_s(http_thread.native_id),
            "proc": time.process_time(), "steps": 0, "step_s": 0.0}  # fmt: skip
    sampler = Sampler(args.sample_hz, {"engine": engine_thread, "http": http_thread}) if args.sample_hz else None
    if sampler:
        sampler.start()

    def step_totals():
        count = total = 0.0
        for metric in metrics.registry.collect():
            if metric.name == "deepinfer_step_seconds":
                for s in metric.samples:
                    if s.name.endswith("_count"):
                        count += s.value
                    elif s.name.endswith("_sum"):
                        total += s.value
        return count, total

    def usr1(*_):
        now = {"wall": time.monotonic(), "engine": thread_cpu_s(engine_thread.native_id), "http": thread_cpu_s(http_thread.native_id),
               "proc": time.process_time()}  # fmt: skip
        now["steps"], now["step_s"] = step_totals()
        d = {k: now[k] - last[k] for k in now}
        steps = max(d["steps"], 1)
        print(f"SNAP wall {d['wall']:.2f} s | cpu engine {d['engine']:.2f} http {d['http']:.2f} process {d['proc']:.2f} s | "
              f"steps {int(d['steps'])} mean step {1e3 * d['step_s'] / steps:.2f} ms (sum {d['step_s']:.2f} s) | {compiles.take()}", flush=True)  # fmt: skip
        last.update(now)

    signal.signal(signal.SIGUSR1, usr1)
    signal.signal(signal.SIGUSR2, lambda *_: sampler.dump() if sampler else None)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.port))
    os.replace(args.port_file + ".tmp", args.port_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
