"""Expert parallelism end to end on the CPU (gloo, reference backend, float32, the embedded tiny
model): greedy generation with 2 and 4 ranks equals one rank, with and without redundant experts
(placed by EPLB from a skewed synthetic load, then re-placed during the run), with idle ranks, and
in deterministic mode (equal to one deterministic process);
`deepinfer run --ep 2` (which starts torchrun) writes its output once, in input order; a rank
that dies or hangs ends the run with a one-line error on the other ranks, keeping written results.

The multi-rank runs start this file under torchrun (`python -m torch.distributed.run ... this
file worker|cli ...`): see `_worker_main` at the bottom.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()

# Five prompts of different lengths and output budgets: ranks finish at different steps, so some
# ranks run idle steps while others still decode.
PROMPTS = [
    [0, 2182, 11, 1100, 6657, 344],
    [0, 671, 7664, 294],
    [0, 16, 223, 17, 223, 18, 223, 19, 223, 20],
    [0, 4117],
    [0, 3476, 14, 4081, 5046, 302, 260, 9281],
]
MAX_TOKENS = [6, 8, 4, 7, 5]
NUM_MOE_LAYERS, NUM_EXPERTS = 3, 16  # the embedded model


def skewed_load() -> list[list[float]]:
    """A synthetic load: Zipf-like over the 16 experts, a different order per MoE layer."""
    import torch

    g = torch.Generator().manual_seed(6)
    base = 1000.0 / (torch.arange(NUM_EXPERTS, dtype=torch.float64) + 1) ** 1.2
    return [base[torch.randperm(NUM_EXPERTS, generator=g)].round().tolist() for _ in range(NUM_MOE_LAYERS)]


def scenarios(world: int) -> dict[str, dict]:
    """name -> (prompt indices, LLM keyword arguments)."""
    redundant = 4 if world == 4 else 2  # 16 + R experts must divide over the ranks
    # At 4 ranks only what differs from 2: the sharding of 16 + 4 experts (redundant_eplb runs every
    # prompt) and ranks without prompts; plain and deterministic runs are the 2-rank test's.
    plain = {"plain": {"prompts": list(range(len(PROMPTS))), "llm": {}}} if world == 2 else {}
    return {
        **plain,
        # EPLB places 16 + R experts from the skewed load, then re-places them from the counted load
        # every 2 steps (experts move between ranks and are read from the checkpoint again).
        "redundant_eplb": {
            "prompts": list(range(len(PROMPTS))),
            "llm": {"num_redundant_experts": redundant, "expert_load": skewed_load(), "eplb_interval": 2},
        },
        "fewer_prompts_than_ranks": {"prompts": list(range(world - 2 if world > 2 else 1)), "llm": {}},
        # batch-invariant kernels on every rank (gloo reduces in a fixed order): tokens equal one
        # deterministic process's
        **({"deterministic": {"prompts": list(range(len(PROMPTS))), "llm": {"deterministic": True}}} if world == 2 else {}),
    }


def sampling_params(indices):
    from deepinfer import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True) for i in indices]


def make_llm(**kwargs):
    from deepinfer import LLM

    return LLM(backend="reference", dtype="float32", announce=False, num_kv_blocks=32, **kwargs)


def subprocess_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["DEEPINFER_CACHE"] = str(cache)
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
    return env


def torchrun(nproc: int, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(HERE), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)


# ---- the single-process reference ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)  # once, before any rank starts
    return root


@pytest.fixture(scope="module")
def expected(cache) -> list[list[int]]:
    """Greedy tokens of every prompt, one process, every expert local (--ep 1)."""
    return _one_process_tokens(cache)


@pytest.fixture(scope="module")
def expected_deterministic(cache) -> list[list[int]]:
    """The same in deterministic mode (other kernels: the tokens may differ from `expected`)."""
    return _one_process_tokens(cache, deterministic=True)


def _one_process_tokens(cache, **kwargs) -> list[list[int]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        llm = make_llm(**kwargs)
        indices = range(len(PROMPTS))
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], sampling_params(indices), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in tokens] == MAX_TOKENS
    return tokens


def test_one_rank_with_redundant_experts_and_eplb_matches(cache, expected, monkeypatch, tmp_path):
    """Redundant copies and re-placement between steps change no token (one process, 16 + 4 experts)."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    load_file = tmp_path / "load.json"
    load_file.write_text(json.dumps({"load": skewed_load()}))
    llm = make_llm(num_redundant_experts=4, expert_load=str(load_file), eplb_interval=2)
    indices = range(len(PROMPTS))
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], sampling_params(indices), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.eplb.num_rebalances >= 1
    assert llm.engine.loaded.model.placement.num_physical == 20


def test_ep_needs_torchrun_and_sizes_must_divide(cache, monkeypatch):
    from deepinfer.engine.sampling_params import InvalidRequestError
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.embedded import CONFIG
    from deepinfer.model.moe import ExpertSharding

    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InvalidRequestError, match="torchrun --nproc-per-node 2"):
        make_llm(ep=2)

    class FourRanks:  # a DistContext's shape; the error comes before any group is used
        rank, world_size = 1, 4

    with pytest.raises(ValueError, match="18 physical experts per layer do not divide over 4"):
        ExpertSharding(FourRanks(), num_redundant_experts=2).placement(ModelConfig.from_dict(CONFIG))


def test_cli_passes_every_option_to_the_ranks():
    from deepinfer.cli import run as run_cli_module
    from deepinfer.cli.main import build_parser

    parser = build_parser()
    argv = ["run", "--ep", "2", "--prompt", "a b", "--prompt", "c", "--temperature", "0", "--eplb", "--num-redundant-experts", "2", "--dist-timeout", "7.5"]
    args = parser.parse_args(argv)
    words = run_cli_module.command_line(args)
    again = parser.parse_args(["run", *words])
    assert vars(again) == vars(args)
    assert "--backend" not in words  # defaults are left out


# ---- several ranks --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_generation_equals_one_rank(world, cache, expected, expected_deterministic, tmp_path):
    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    run = torchrun(world, "worker", str(tmp_path), str(HANG_S), env=subprocess_env(cache))
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name, scenario in scenarios(world).items():
        want = [(expected_deterministic if name == "deterministic" else expected)[i] for i in scenario["prompts"]]
        assert ranks[0][name]["tokens"] == want, f"{name}: --ep {world} differs from --ep 1"
        for r, rank in enumerate(ranks):
            stats = rank[name]
            assert stats["weights_match_checkpoint"], f"{name}: rank {r} holds expert weights that are not its placement's"
            if r:
                assert stats["tokens"] == [], "only rank 0 gets results"
    eplb = [rank["redundant_eplb"] for rank in ranks]
    assert all(s["rebalances"] >= 1 for s in eplb), eplb
    assert sum(s["experts_read"] for s in eplb) > 0, f"no rank gained an expert it had not loaded: {eplb}"
    assert all(s["num_physical"] == NUM_EXPERTS + (4 if world == 4 else 2) for s in eplb)


def test_cli_ep2_spawns_torchrun_and_writes_once_in_input_order(cache, expected, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": m}) + "\n" for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))))
    out = tmp_path / "out.jsonl"
    args = ["run", "--ep", "2", "--backend", "reference", "--dtype", "float32", "--no-progress", "--num-kv-blocks", "32"]
    args += ["--temperature", "0", "--ignore-eos", "--num-redundant-experts", "2", "--eplb", "--eplb-interval", "3", "-i", str(src), "-o", str(out)]
    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    run = subprocess.run([sys.executable, "-m", "deepinfer", *args], env=subprocess_env(cache), capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "torchrun --standalone --nproc-per-node 2" in run.stderr
    assert run.stderr.count("summary:") == 1 and run.stderr.count("dummy weights (random") == 1, run.stderr  # rank 0 only
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(len(PROMPTS))], "written once each, in input order"
    assert [line["token_ids"] for line in lines] == expected


def test_ep2_ranks_share_the_disk_tier_across_a_restart(cache, tmp_path):
    """Two `run --ep 2` runs on one --kv-offload-dir: the second run's ranks (new processes, nothing on their devices)
    load the first run's blocks from disk, and every request's tokens are those of one process without tiers."""
    import torch

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 1000, (40,), generator=g).tolist() for _ in range(4)]  # two full 16-token blocks each
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        want = [o.outputs[0].token_ids for o in make_llm().generate([{"prompt_token_ids": p} for p in prompts], sampling_params([0] * 4), use_tqdm=False)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": MAX_TOKENS[0]}) + "\n" for i, p in enumerate(prompts)))
    from waits import HANG_S  # (here, not at the top: the ranks run this file without tests/ on their path)

    def run(out: Path) -> str:
        args = ["run", "--ep", "2", "--backend", "reference", "--dtype", "float32", "--no-progress", "--num-kv-blocks", "32", "--temperature", "0",
                "--ignore-eos", "--kv-offload-dir", str(tmp_path / "kv"), "-i", str(src), "-o", str(out)]  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "deepinfer", *args], env=subprocess_env(cache), capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 0, done.stderr[-4000:]
        assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == want
        return next(line for line in done.stderr.splitlines() if "kv tiers" in line)

    first = run(tmp_path / "first.jsonl")
    assert "disk: 0 blocks loaded" in first and "4 stored" in first  # rank 0's two requests, two full blocks each
    second = run(tmp_path / "second.jsonl")
    assert "disk: 4 blocks loaded" in second and "by 2 requests" in second, second


# ---- failures ------------------------------------------------------------------------------------


def _failure_run(tmp_path, cache, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    # Prompt 0 finishes at the first step (max_tokens 1) and is written; rank 1 then dies / hangs.
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 1 if i == 0 else 30}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "out.jsonl"
    args = ["run", "--backend", "reference", "--dtype", "float32", "--no-progress", "--num-kv-blocks", "32", "--temperature", "0", "--ignore-eos"]
    run = torchrun(2, mode, "3", *args, *extra, "-i", str(src), "-o", str(out), env=subprocess_env(cache))
    return run, out


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("deepinfer: error:")]


def test_a_rank_that_dies_ends_the_run_with_one_line_and_keeps_written_results(cache, tmp_path):
    run, out = _failure_run(tmp_path, cache, "cli-die")
    assert run.returncode != 0
    errors = _error_lines(run.stderr)
    assert len(errors) == 1 and "rank 0 of 2" in errors[0], run.stderr[-4000:]  # the dead rank says nothing
    assert "[rank0]:" not in run.stderr, "a traceback instead of a one-line error"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [0], "the result finished before the failure is kept"


def test_a_rank_that_hangs_times_out_with_one_line_on_every_rank(cache, tmp_path):
    run, out = _failure_run(tmp_path, cache, "cli-hang", "--dist-timeout", "3")
    assert run.returncode != 0
    errors = _error_lines(run.stderr)
    assert any("rank 0 of 2" in e and "3 s" in e for e in errors), run.stderr[-4000:]
    assert any("rank 1 of 2" in e for e in errors), run.stderr[-4000:]  # stopped by torchrun: says so
    assert len(errors) == 2, errors
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0]


# ---- under torchrun ------------------------------------------------------------------------------


def _check_local_weights(llm) -> bool:
    """Every expert this rank holds equals its logical expert in the checkpoint."""
    import torch
    from safetensors import safe_open

    from deepinfer.model.deepseek import moe_layer_indices

    model = llm.engine.loaded.model
    placement = model.placement
    inter = model.config.moe_intermediate_size
    with safe_open(str(Path(llm.model_path) / "model.safetensors"), framework="pt") as f:
        for n, (layer, moe) in enumerate(zip(moe_layer_indices(model.config), model.moe_layers)):
            slots = placement.local_slots
            if moe.local_logical != placement.phy2log[n, slots.start : slots.stop].tolist():
                return False
            gate_up, down = moe.gate_up.parts[0].weight, moe.down.weight
            for slot, e in enumerate(moe.local_logical):
                name = f"model.layers.{layer}.mlp.experts.{e}."
                want = [f.get_tensor(name + p + ".weight").float() for p in ("gate_proj", "up_proj", "down_proj")]
                got = [gate_up[slot, :inter], gate_up[slot, inter:], down[slot]]
                if not all(torch.equal(a, b) for a, b in zip(got, want)):
                    return False
    return True


def _worker(out_dir: str, dist_timeout: float) -> None:
    """Each scenario on this rank; dist_timeout: the hang guard (nothing here should time out, however slow)."""
    import gc

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    report = {}
    for name, scenario in scenarios(world).items():
        llm = make_llm(ep=world, dist_timeout=dist_timeout, **scenario["llm"])
        indices = scenario["prompts"]
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], sampling_params(indices), use_tqdm=False)
        engine = llm.engine
        report[name] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "rebalances": engine.eplb.num_rebalances if engine.eplb is not None else 0,
            "experts_read": engine.eplb.num_experts_read if engine.eplb is not None else 0,
            "num_physical": engine.loaded.model.placement.num_physical,
            "weights_match_checkpoint": _check_local_weights(llm),
        }
        del llm, engine, outputs
        gc.collect()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def _cli_with_fault(mode: str, at_step: int, argv: list[str]) -> int:
    """`deepinfer run` on this rank; rank 1 dies (or hangs) when it reaches step `at_step`."""
    import time

    from deepinfer.cli.main import main
    from deepinfer.engine.llm_engine import LLMEngine

    def fault(self):
        if int(os.environ["RANK"]) == 1 and self.num_steps + 1 >= at_step:  # before step `at_step`
            if mode == "cli-die":
                os._exit(7)
            time.sleep(24 * 3600)  # hangs, however long rank 0 takes to time out: only torchrun's stop ends it

    before_step = LLMEngine.before_step  # every rank calls it once per step, idle steps too
    LLMEngine.before_step = lambda self: (fault(self), before_step(self))[1]
    return main(argv)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "worker":
        _worker(rest[0], float(rest[1]))
    else:
        sys.exit(_cli_with_fault(mode, int(rest[0]), rest[1:]))
