"""The C++ CPU engine found and loaded, never compiled here: the operator that runs the ops on
CPU tensors, with the kernel set this CPU runs.

``csrc/`` holds the engine (``engine.h``: the kernels of every norm, ``forward.cpp``,
``backward.cpp`` and ``kernels.cpp``) and the operator (``operator.h``: checks, outputs,
threads; ``cpu_ops.cpp``, ``autograd.cpp`` and ``arrays.cpp``), which registers the CPU
kernels of ``layernorm::fwd``, ``layernorm::bwd``, ``layernorm::norm``, ``layernorm::fwd_y``,
``layernorm::bwd_y`` and the quantized norms, the NumPy API's entry points and the bandwidth
yardstick's copy. :mod:`.build` builds them: into the wheel (``_built/`` beside this file), or
with ``layernorm build`` into the user's cache.

:func:`load` looks for the engine of these sources and this torch's minor version in
``LAYERNORM_ENGINE_DIR`` (where set), in the package (the wheel's) and in the user's cache,
loads the operator, and has it choose the widest kernel set this CPU runs (``LAYERNORM_ISA``
forces one: ``x86-64-v3`` or ``x86-64-v4``). It never compiles and never waits on a lock.

Where there is no engine for this torch, or this CPU runs none of its kernel sets, one warning
at the caller's line says why and how to get one, and :func:`load` returns False;
``LAYERNORM_NO_CPP=1`` returns False without a warning. Then the ops' CPU kernels and the NumPy
API run the NumPy fallback (:mod:`layernorm.cpu.fallback`, the reference's arithmetic on one
thread): the same results within the tolerance table, many times slower.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

from . import build

__all__ = ["FOLDER", "KERNELS", "load"]

FOLDER: Path | None = None
"""The folder of the engine :func:`load` loaded, or None."""
KERNELS: str | None = None
"""The kernel set the operator chose (``x86-64-v3`` or ``x86-64-v4``), or None."""

_PACKAGE = str(Path(__file__).resolve().parents[1])
_FALLBACK = "CPU tensors and layernorm.cpu run the NumPy fallback instead, many times slower"


def _warn(message: str) -> None:
    """One RuntimeWarning at the first line outside this package: the caller's import or call.
    (warnings counts no frame of the import machinery in a stacklevel.)"""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            level += 1
            if not name.startswith(_PACKAGE):
                break
        frame = frame.f_back
    warnings.warn(f"layernorm: {message}", RuntimeWarning, stacklevel=level)


def _missing(name: str) -> str:
    """Why no engine of this name is found, and what to do."""
    series = build.torch_series(torch.__version__)
    command = (f"`layernorm build` builds one for this torch into {build.cache_root()} "
               f"(about {build.BUILD_SECONDS} s, with g++)")
    cause = build.failure(build.cache_root(), name)
    if cause is not None:
        return (f"the C++ CPU engine for torch {series} could not be built ({cause}): "
                f"{_FALLBACK}. To fix: {build.REMEDIES}; `layernorm build` tries again "
                "and clears this message")
    packaged = build.manifest(build.PACKAGED)
    if packaged is not None and packaged.get("torch") != series:
        return (f"this install's C++ CPU engine is built for torch {packaged.get('torch')}, "
                f"and torch {torch.__version__} is imported: {_FALLBACK}. Install torch "
                f"{packaged.get('torch')}, or {command}; LAYERNORM_NO_CPP=1 runs the fallback "
                "without this message")
    return (f"no C++ CPU engine is built for these sources and torch {series} (a source "
            f"checkout, or the sources changed since the build): {_FALLBACK}. {command}; "
            "LAYERNORM_NO_CPP=1 runs the fallback without this message")


def load() -> bool:
    """Load the engine built for these sources and this torch, with the kernel set this CPU
    runs best (or LAYERNORM_ISA's), and register its CPU kernels; True on success (the caller
    then gives it its settings: ``torch.ops.layernorm_cpu._setup``). Otherwise
    one warning says why and what to do, and False is returned."""
    global FOLDER, KERNELS
    if os.environ.get("LAYERNORM_NO_CPP") == "1":
        return False
    name = build.engine_name(torch.__version__)
    folder = build.find(name)
    if folder is None:
        _warn(_missing(name))
        return False
    try:
        if not hasattr(torch.ops.layernorm_cpu, "_select"):
            torch.ops.load_library(str(folder / build.OPERATOR))
        KERNELS = torch.ops.layernorm_cpu._select(str(folder),
                                                  os.environ.get("LAYERNORM_ISA", ""))
    except Exception as exc:  # noqa: BLE001 - any failure to load means: fall back
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _warn(f"the C++ CPU engine in {folder} cannot run here ({why}): {_FALLBACK}")
        return False
    FOLDER = folder
    return True
