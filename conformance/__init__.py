"""deepinfer's conformance suite: one golden set, every backend compared against it and each other.

- `cases/`: the cases, one module per op family, each a seeded recipe for an op's inputs.
- `generate.py`: runs the reference in float64 over every case and writes `golden/`.
- `golden/`: `<op>.safetensors` (inputs and outputs) and `manifest.json`.
- `worker.py`: runs one backend's kernels over the golden inputs, in its own process.
- `runner.py`: starts a worker per backend, compares, prints the table.
- `out_of_tree.py`: the cases of installed packages (entry-point group `deepinfer.conformance_cases`),
  their goldens computed from the float64 reference at the start of each run.
- `multirank.py`: the dispatch/combine cases split over N expert-parallel ranks (torchrun-style
  processes), reassembled and checked against the same goldens.
"""
