"""Every kernel plan compiles for the H100 (sm_90) without register spills; no GPU needed."""

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
    """Protects the plan limits (MAX_SHORT_D_FWD/BWD, tile sizes, warps): at each plan's
    largest tile every kernel compiles for sm_90 with no stack or local memory, i.e. no
    register spills, in bfloat16 and float32."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), "90", "--json"],
                         capture_output=True, text=True, env=env, check=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 26
    spilled = [r for r in rows if r["stack"] or r["local"]]
    assert not spilled, spilled
