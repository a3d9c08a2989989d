"""On one GPU: the device-generic helpers the EP benchmarks time and capture with (deepinfer/bench/
device_api.py, ep.Marks, the backend's graph capture) against plain torch.cuda results."""

import torch

from deepinfer.bench import device_api
from deepinfer.bench.ep import Marks
from deepinfer.device_graphs import TorchGraphCapture

dev = torch.device("cuda", 0)
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
marks = Marks(dev)
marks("start")
for _ in range(10):
    a @ a
marks("end")
print("Marks:", marks.times_us(), "(10 bf16 4096^3 matmuls)")
with device_api.side_stream(dev):
    b = a @ a
device_api.synchronize(dev)
print("side stream result equal:", torch.equal(b, a @ a))
print("device name:", device_api.device_name(dev), "| torch.cuda:", torch.cuda.get_device_name(dev))
print("peer access 0->0:", device_api.peer_access("cuda", 0, 0))
x = torch.ones(8, device=dev)
capture = TorchGraphCapture("cuda", "CUDAGraph")
graph, out = capture.capture(lambda: x * 2, device=dev, pool=capture.new_pool(dev), warmups=0)
x.fill_(3)
graph.replay()
device_api.synchronize(dev)
print("graph replay saw the new input:", out.tolist() == [6.0] * 8)
device_api.empty_cache(dev)
print("empty_cache ok")
