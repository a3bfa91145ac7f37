"""Every kernel launch compiles for the H100 (sm_90) without register spills and without inexact
division or square root; no GPU needed."""

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
    add-norm), specialized as a launch specializes it and at each plan's largest tile, compiles
    for sm_90 with no stack or local memory (no register spills), and its PTX has no div.full,
    sqrt.approx or other approximate or flush-to-zero instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "90", "--json"],
                         capture_output=True, text=True, env=env, check=False, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 70
    spilled = [r for r in rows if r["stack"] or r["local"]]
    assert not spilled, spilled
    inexact = [r for r in rows if r["inexact"]]
    assert not inexact, inexact
