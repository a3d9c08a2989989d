"""deepinfer_cuda.bench.sass_check on hand-written SASS in cuobjdump's format: the shape of the miscompile ptxas 12.8 made
of prefill_gluon's 3-stage build (a loop whose last-tile branch reads, for its PV wgmma, the uniform registers the
other branch wrote in an earlier iteration) is found; the same loop writing them on that branch too is not."""

from __future__ import annotations

from deepinfer_cuda.bench.sass_check import uniform_destinations, unwritten_descriptors


def _sass(lines: list[str]) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;                  /* 0x000000000000 */" for i, text in enumerate(lines))


def _loop(last_tile_writes_descriptor: bool) -> str:
    """A consumer loop: the QK descriptor (UR12..UR15) before it; per iteration, the branch of every tile but the last
    writes V's descriptor (UR10, UR11, at 0x80) before the PV at 0xc0; the last tile's (the jump to 0xa0) writes it only
    if asked."""
    last = ["UMOV UR10, UR20", "UMOV UR11, 0x40000040"] if last_tile_writes_descriptor else ["NOP", "NOP"]
    return _sass([
        "UMOV UR12, URZ",  # 0x00
        "UMOV UR13, URZ",  # 0x10
        "UMOV UR14, URZ",  # 0x20
        "UMOV UR15, 0x40000040",  # 0x30
        "UISETP.GE.AND UP0, UPT, UR4, UR6, UPT",  # 0x40 loop head
        "PLOP3.LUT P1, PT, PT, PT, UP0, 0x80, 0x0",  # 0x50
        "@P1 BRA 0xa0",  # 0x60
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT",  # 0x70
        "UIADD3 UR10, UR20, 0x80, URZ",  # 0x80
        "UMOV UR11, 0x40000040",  # 0x90
        *last,  # 0xa0, 0xb0: the last tile's branch
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR8].tnspB, R88, gsb0",  # 0xc0
        "UIADD3 UR4, UR4, 0x1, URZ",  # 0xd0
        "ISETP.NE.AND P0, PT, R0, RZ, PT",  # 0xe0
        "@P0 BRA 0x40",  # 0xf0
        "EXIT",  # 0x100
    ])


def test_a_wgmma_reading_descriptor_registers_some_path_leaves_unwritten_is_found():
    found = unwritten_descriptors(_loop(last_tile_writes_descriptor=False))
    assert len(found) == 1 and found[0].startswith("0x00c0 HGMMA") and "UR10, UR11 not written on every path" in found[0], found
    assert unwritten_descriptors(_loop(last_tile_writes_descriptor=True)) == []


def test_shared_memory_operands_need_all_four_registers_and_wide_writes_count_twice():
    assert uniform_destinations("UIMAD.WIDE.U32 UR14, UR49, -0x55555555, URZ") == {14, 15}
    assert uniform_destinations("UIADD3.64 UR18, UR14, 0x80, URZ") == {18, 19}
    assert uniform_destinations("@!UP4 USHF.L.U32 UR11, UR10, 0xb, URZ") == {11}
    assert uniform_destinations("UISETP.GE.AND UP0, UPT, UR49, UR6, UPT") == set()
    assert uniform_destinations("SYNCS.EXCH.64 URZ, [UR7+0x38130], UR10") == set()
    sass = _sass(["UMOV UR12, URZ", "UMOV UR13, URZ", "UMOV UR14, URZ", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT", "EXIT"])
    assert unwritten_descriptors(sass) == ["0x0030 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT: UR15 not written on every path"]
