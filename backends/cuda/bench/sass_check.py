"""Which wgmma (HGMMA) instructions of a kernel's SASS read a matrix descriptor that is not written on every path to
them: a check of what ptxas made of correct PTX.

Why: the ptxas of Triton 3.6 (CUDA 12.8) compiled the 3-stage build of prefill_gluon.py's kernel (Dqk 128) so that one
consumer warpgroup's last PV of a program read V through the uniform registers its previous loop iteration had left
(the previous key tile's V, for 7 of the 8 k-steps) and, in a program with one key tile, through registers never
written: the PTX computed the descriptor afresh on that path; ptxas 12.9 and 13.4 compile the same PTX correctly. The
GPU test saw it as wrong values on a var-len batch. The check here is a forward "written on every path" analysis of
the uniform registers over the SASS's control flow graph: an HGMMA whose descriptor registers (the B pair URx+2,
URx+3 of `gdesc[URx]` with A in registers, all four with A in shared memory) some path from the kernel's entry leaves
unwritten is reported. It finds that miscompile (the one-tile path); it cannot see a stale value that every path
writes, so it is a net, not a proof.

`disassemble(cubin, ptxas)` gives a cubin's SASS (compile_check.py's ptxas run builds the cubin); `unwritten_descriptors(sass)`
lists the findings. Not a bench module (no OPS): compile_check.py calls it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"(@!?U?P[T0-9]+)\s+(.*)")
_HGMMA = re.compile(r"HGMMA\S*\s+[^,]+,\s*(?:(R\d+),\s*)?gdesc\[UR(\d+)\]")
_NO_UNIFORM_DESTINATION = ("HGMMA", "SYNCS", "UTMA", "STS", "ST.", "ST ", "UBLKCP", "USETMAXREG")
UNIFORM_REGISTERS = 64


def disassemble(cubin: Path, ptxas: str | Path) -> str:
    """The SASS of a cubin ptxas built, by the cuobjdump that ships beside that ptxas (Triton's)."""
    return subprocess.run([str(Path(ptxas).parent / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def _split_predicate(text: str) -> tuple[str | None, str]:
    m = _PREDICATE.match(text)
    return (m.group(1), m.group(2)) if m else (None, text)


def uniform_destinations(text: str) -> set[int]:
    """The uniform registers an instruction writes: its first operand where that is a uniform register (two for .64 and
    .WIDE forms, four for .128)."""
    _, body = _split_predicate(text)
    parts = body.split(None, 1)
    if len(parts) < 2 or parts[0].startswith(_NO_UNIFORM_DESTINATION):
        return set()
    opcode, operands = parts
    m = re.fullmatch(r"UR(\d+)", operands.split(",")[0].strip())
    if not m:
        return set()
    width = 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _blocks(instructions: list[tuple[int, str]]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Basic blocks (index ranges) and their successors: blocks start at the entry, at branch targets and after a BRA,
    EXIT or RET; a predicated branch or exit also falls through."""
    index = {a: i for i, (a, _) in enumerate(instructions)}
    starts = {0}
    for i, (_, text) in enumerate(instructions):
        _, body = _split_predicate(text)
        m = re.match(r"BRA\S*\s+(?:.*?)(0x[0-9a-f]+)", body)
        if m and int(m.group(1), 16) in index:
            starts.add(index[int(m.group(1), 16)])
        if re.match(r"(BRA|EXIT|RET)\b", body) and i + 1 < len(instructions):
            starts.add(i + 1)
    bounds = sorted(starts) + [len(instructions)]
    blocks = list(zip(bounds[:-1], bounds[1:]))
    block_at = {start: b for b, (start, _) in enumerate(blocks)}
    successors: list[list[int]] = []
    for start, end in blocks:
        predicate, body = _split_predicate(instructions[end - 1][1])
        falls_through = end < len(instructions)
        out = []
        m = re.match(r"BRA\S*\s+(?:.*?)(0x[0-9a-f]+)", body)
        if m:
            target = index.get(int(m.group(1), 16))
            if target is not None:
                out.append(block_at[target])
            if predicate and falls_through:
                out.append(block_at[end])
        elif re.match(r"(EXIT|RET)\b", body):
            if predicate and falls_through:
                out.append(block_at[end])
        elif falls_through:
            out.append(block_at[end])
        successors.append(out)
    return blocks, successors


def unwritten_descriptors(sass_text: str) -> list[str]:
    """The HGMMA instructions (address and text) whose descriptor registers are not written on every path from the
    kernel's entry, with the registers."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass_text.splitlines()) if m]
    if not instructions:
        return []
    blocks, successors = _blocks(instructions)
    predecessors: list[list[int]] = [[] for _ in blocks]
    for b, out in enumerate(successors):
        for s in out:
            predecessors[s].append(b)
    every = set(range(UNIFORM_REGISTERS))
    writes = [uniform_destinations(text) for _, text in instructions]  # parsed once, not once a pass
    block_writes = [set().union(*writes[start:end]) for start, end in blocks]
    written_in = [set() if b == 0 else set(every) for b in range(len(blocks))]
    written_out = [set(every) for _ in blocks]
    changed = True
    while changed:  # forward "written on every path": intersection over predecessors, to a fixed point
        changed = False
        for b in range(len(blocks)):
            entry = set() if b == 0 or not predecessors[b] else set.intersection(*(written_out[p] for p in predecessors[b]))
            out = entry | block_writes[b]
            if entry != written_in[b] or out != written_out[b]:
                written_in[b], written_out[b], changed = entry, out, True
    findings = []
    for b, (start, end) in enumerate(blocks):
        written = set(written_in[b])
        for i in range(start, end):
            address, text = instructions[i]
            m = _HGMMA.search(text)
            if m:
                base = int(m.group(2))
                needed = [base + 2, base + 3] if m.group(1) else [base, base + 1, base + 2, base + 3]
                missing = [r for r in needed if r not in written]
                if missing:
                    findings.append(f"{address:#06x} {text}: {', '.join(f'UR{r}' for r in missing)} not written on every path")
            written |= writes[i]
    return findings


__all__ = ["disassemble", "uniform_destinations", "unwritten_descriptors"]
