"""Where `sample`'s device time goes (H200): each of its kernels' average time over 20 calls, per
bench case (greedy, top-k/top-p, temperature only, min_p; batch 256, V 129280), from the torch
profiler; and the same calls' total from a CUDA graph."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer_cuda.bench import sampling as bench


def main() -> None:
    device = torch.device("cuda")
    for case in bench.CASES:
        if case.op != "sample" or case.name.endswith("_replay"):
            continue
        state = case.setup(device)
        for _ in range(3):
            case.kernel(state)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                case.kernel(state)
            torch.cuda.synchronize()
        total = 0.0
        for evt in prof.key_averages():
            if evt.device_type is not None and evt.count >= 20:
                avg = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
                total += avg * evt.count / 20
                print(f"{case.name:32s} {evt.key[:48]:<48} calls {evt.count:4d} avg {avg:8.1f} us", flush=True)
        print(f"{case.name:32s} device total per call {total:8.1f} us", flush=True)
        del state
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
