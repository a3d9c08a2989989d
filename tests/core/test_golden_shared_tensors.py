"""A tensor bit-identical to one already in an op's golden file (a table two cases share, the integer
outputs of a recipe's two dtypes) is stored once, and every case that has it reads it back."""

import torch
from safetensors.torch import load_file

from deepinfer.registry import all_ops
from deepinfer_conformance import generate
from deepinfer_conformance.cases import Case, randn
from deepinfer_conformance.golden_io import GoldenTensors, key, read_cases


def ramp(gen, dtype):
    return {"x": torch.arange(16, dtype=torch.float64).reshape(2, 8).to(dtype)}


def noise(gen, dtype):
    return {"x": randn(gen, 2, 8, dtype=dtype)}


CASES = [Case("silu_and_mul", "ramp", torch.float32, ramp), Case("silu_and_mul", "ramp_again", torch.float32, ramp),
         Case("silu_and_mul", "noise", torch.float32, noise)]  # fmt: skip


def test_identical_tensors_are_stored_once_and_every_case_reads_them(tmp_path):
    files, records = generate.build(CASES)
    generate.write(tmp_path, files, records)
    first, again, other = (c.id for c in CASES)
    assert sorted(load_file(str(tmp_path / "silu_and_mul.safetensors"))) == sorted(
        key(case, kind, name) for case in (first, other) for kind, name in (("in", "x"), ("out", "out"))
    )
    cases = {c.id: c for c in read_cases(tmp_path)}
    assert cases[again].stored_as == {"in::x": key(first, "in", "x"), "out::out": key(first, "out", "out")}
    assert cases[first].stored_as == {} and cases[other].stored_as == {}
    golden = GoldenTensors(tmp_path)
    for case in CASES:
        stored = cases[case.id]
        assert torch.equal(golden.inputs(stored)["x"], case.inputs()["x"])
        assert torch.equal(golden.outputs(stored)["out"], generate.run_golden(all_ops()["silu_and_mul"], case, case.inputs())["out"])
    assert generate.check(tmp_path, files, records) == []


def test_a_case_that_writes_its_shared_input_leaves_the_other_cases_copy_alone(tmp_path):
    files, records = generate.build(CASES[:2])
    generate.write(tmp_path, files, records)
    golden = GoldenTensors(tmp_path)
    first, again = read_cases(tmp_path)
    golden.inputs(first)["x"].fill_(7.0)  # as an in-place kernel writes its argument
    assert torch.equal(golden.inputs(again)["x"], ramp(None, torch.float32)["x"])


def test_the_packaged_golden_set_stays_within_its_budget():
    # 25 MB: a checkout must fit the 64 MiB copy to a lent GPU machine, and every clone pays for it. A case that
    # needs more belongs in `bench ops`; a case sized to the edges it tests (tile remainders, masks, pages) fits.
    from deepinfer_conformance.golden_io import GOLDEN_DIR

    size = sum(f.stat().st_size for f in GOLDEN_DIR.iterdir() if f.is_file())
    assert size <= 25_000_000, f"the golden set is {size / 1e6:.2f} MB; shrink the cases that grew (sizes by file: ls -lS {GOLDEN_DIR})"
