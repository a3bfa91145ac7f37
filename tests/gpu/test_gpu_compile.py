"""Every kernel launch compiles for the H100 (sm_90) without spill traffic in its loops and without
inexact division or square root; no GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "compile_kernels.py"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton without its NVIDIA tools")
def test_kernels_compile_for_sm90_without_spills():
    """Protects the plan limits (MAX_SHORT_D_FWD/BWD, tile sizes, warps) and the exact facts the
    kernels rely on: each launch of every norm (bfloat16 and float32; float64 LayerNorm and its
    add-norm; the memory-efficient backward of LayerNorm and its add-norm, with kept channels
    and rows kept whole; the quantized norm's, short and long rows, to int8 and float8),
    specialized as a launch specializes it and at each plan's largest
    tile, compiles
    for sm_90 with no local arrays and no spill instruction that runs per loop iteration (a
    register or two kept on the stack once per program, outside the loops, is allowed: ptxas
    does that to keep two programs per SM), and its PTX has no div.full, sqrt.approx or other
    approximate or flush-to-zero instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "90", "--json"],
                         capture_output=True, text=True, env=env, check=False, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    # 70 launches of the default mode, 10 of the memory-efficient one, 5 of the quantized norm
    assert len(rows) == 85
    spilled = [r for r in rows if r["loop_spills"] or r["local"]]
    assert not spilled, spilled
    inexact = [r for r in rows if r["inexact"]]
    assert not inexact, inexact


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   STL.64 [R1], R2 ;
        /*0020*/                   FADD R4, R4, R5 ;
        /*0030*/               @P0 LDL R6, [R1+0x8] ;
        /*0040*/              @!P1 BRA 0x20 ;
        /*0050*/                   LDL.LU.64 R18, [R1] ;
        /*0060*/                   CALL.REL.NOINC 0x90 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
        /*0090*/                   STL [R1+0x4], R7 ;
        /*00a0*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_loop_spills_counts_only_what_runs_per_iteration():
    """Protects the spill rule's reading of machine code: a spill between a backward branch's
    target and the branch (0x30) counts, and so does one in a subroutine past the last EXIT
    (0x90, called from loops); a spill before or after every loop (0x10, 0x50) does not."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import compile_kernels
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert compile_kernels.loop_spills(SASS) == 2
    assert compile_kernels.loop_spills(SASS.replace("BRA 0x20", "BRA 0x50")) == 1
