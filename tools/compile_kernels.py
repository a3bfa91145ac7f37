"""Compile every kernel plan ahead of time for an NVIDIA target, without a GPU, and report the
registers, stack (spills) and shared memory per thread block.

    python tools/compile_kernels.py [sm]     # a table; sm defaults to 90 (H100)
    python tools/compile_kernels.py 90 --json

Triton ships ptxas and cuobjdump, so this needs only the triton wheel. It must run without
TRITON_INTERPRET (the interpreter's kernels cannot be compiled); tests/gpu/test_gpu_compile.py
runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from layernorm.gpu import kernels as K

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
_POINTERS_F32 = {"MEAN", "RSTD", "COEF", "DW_PART", "DB_PART"}
_POINTERS_DATA = {"X", "Y", "DY", "DX", "W", "B", "DW", "DB"}


def _signature(kernel: triton.JITFunction, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _POINTERS_F32:
            sig[name] = "*fp32"
        elif name in _POINTERS_DATA:
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig


def resource_usage(kernel: triton.JITFunction, dtype: str, constexprs: dict, num_warps: int,
                   sm: int) -> dict:
    """Compile one specialization for sm_<sm>; its REG, STACK, SHARED and LOCAL per thread.
    Constexprs the kernel does not take are dropped."""
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=_signature(kernel, dtype, constexprs),
                                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32),
                              options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return dict(zip(("reg", "stack", "shared", "local"), map(int, found.groups()), strict=True))


def plans() -> list[tuple[str, triton.JITFunction, dict, int]]:
    """(label, kernel, constexprs, num_warps) of every launch the launchers make, at the row
    lengths where a plan's tiles are largest (each plan's register high-water mark)."""
    flags = {"HAS_W": True, "HAS_B": True}
    absent = {"HAS_W": False, "HAS_B": False, "W": None, "B": None}  # None pointers
    out = []
    for D in (1, 256, 1024, K.MAX_SHORT_D_FWD):
        p = K.plan("fwd", D)
        out.append((f"fwd short D={D}", K._fwd_short_kernel,
                    {**flags, "ROWS": p.rows, "BLOCK_D": p.block}, p.num_warps))
    p = K.plan("fwd", K.MAX_SHORT_D_FWD + 1)
    out.append(("fwd long", K._fwd_long_kernel, {**flags, "BLOCK": p.block}, p.num_warps))
    for D in (256, 1024, K.MAX_SHORT_D_BWD):
        p = K.plan("bwd", D)
        out.append((f"bwd short D={D}", K._bwd_short_kernel,
                    {**flags, "ROWS": p.rows, "BLOCK_D": p.block}, p.num_warps))
    p = K.plan("bwd", K.MAX_SHORT_D_BWD + 1)
    out.append(("bwd long row stats", K._bwd_long_rowstats_kernel,
                {"HAS_W": True, "BLOCK": p.block}, p.num_warps))
    out.append(("bwd long dx", K._bwd_long_dx_kernel, {**flags, "BLOCK": p.block}, p.num_warps))
    p = K.plan("fwd", 1024)
    out.append(("fwd short no affine", K._fwd_short_kernel,
                {**absent, "ROWS": p.rows, "BLOCK_D": p.block}, p.num_warps))
    p = K.plan("bwd", 1024)
    out.append(("bwd short no affine", K._bwd_short_kernel,
                {**absent, "DW_PART": None, "DB_PART": None, "ROWS": p.rows, "BLOCK_D": p.block},
                p.num_warps))
    out.append(("sum partials", K._sum_partials_kernel,
                {**flags, "BLOCK_P": K.REDUCE_BLOCK_P, "BLOCK_N": K.REDUCE_BLOCK_N},
                K.REDUCE_NUM_WARPS))
    return out


def main(argv: list[str]) -> int:
    sm = int(argv[0]) if argv and argv[0].isdigit() else 90
    rows = []
    for dtype in ("bf16", "fp32"):
        for label, kernel, constexprs, num_warps in plans():
            usage = resource_usage(kernel, dtype, constexprs, num_warps, sm)
            rows.append({"kernel": label, "dtype": dtype, "num_warps": num_warps, **usage})
    if "--json" in argv:
        print(json.dumps(rows))
    else:
        print(f"sm_{sm}: registers, stack (spills) and shared memory per thread block")
        for r in rows:
            print(f"{r['kernel']:<22} {r['dtype']:<5} warps {r['num_warps']:>2}  reg {r['reg']:>3}"
                  f"  stack {r['stack']:>4}  local {r['local']:>3}  shared {r['shared']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
