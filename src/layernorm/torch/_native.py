"""The C++ operator that runs the ops on CPU tensors: built on first use, cached on disk.

``csrc/cpu_ops.cpp`` registers the CPU kernels of ``layernorm::fwd``, ``layernorm::bwd``,
``layernorm::norm``, ``layernorm::fwd_y`` and ``layernorm::bwd_y``. It is compiled with torch's
``cpp_extension`` (g++ and ninja) the first time ``layernorm.torch`` is imported on a machine
(about 15 s here) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later imports load it in well under a second. The arithmetic
stays in the Numba kernels: the operator calls the compiled kernels of
:mod:`layernorm.cpu.entry` by address.

Large outputs (1 MiB and more) come from a pool of blocks whose tensors were freed, so that a
call does not pay the first touch of fresh pages (:func:`layernorm.cpu.memory.pool_cap` caps
it).

Where it cannot be built (no compiler, no ninja, or ``LAYERNORM_NO_CPP=1``), :func:`load`
says so in one warning and returns False, and the CPU kernels are registered from Python
instead (:mod:`._cpu`): the same arithmetic, with more time per call.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from .. import recovery
from ..cpu import entry, kernels, memory

__all__ = ["load"]

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
# -fopenmp: at::parallel_for is inlined from torch's headers as an OpenMP region, which without
# it compiles to a serial loop. No -lgomp: the region runs on the OpenMP runtime torch loaded.
FLAGS = ("-O2", "-fopenmp")

# kept alive for the life of the process: the C++ operator calls it
_RESOLVE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_char_p)


def _resolve(request: bytes) -> int:
    kind = request.decode().split(" ", 1)[0]
    if kind not in entry.ROLES:  # a kernel this layernorm.cpu does not have: the operator raises
        warnings.warn(f"layernorm: the CPU kernels have no entry point {kind!r}", RuntimeWarning,
                      stacklevel=1)
        return 0
    try:
        return entry.resolve(request.decode())
    except Exception as exc:  # noqa: BLE001 - reported, and the operator raises on 0
        warnings.warn(f"layernorm: compiling the CPU kernel {request.decode()!r} failed: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)
        return 0


_callback = _RESOLVE(_resolve)


def _name() -> str:
    """The extension's name: changes with its source and with torch's version, so that an
    edited source or another torch never loads a stale build."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([*FLAGS, torch.__version__]).encode()
                            ).hexdigest()
    return f"layernorm_cpu_{digest[:12]}"


def load() -> bool:
    """Build (or load the cached build of) the C++ operator and register its CPU kernels;
    True on success. On failure, one warning says why and False is returned."""
    if os.environ.get("LAYERNORM_NO_CPP") == "1":
        return False
    if shutil.which("ninja") is None:  # the ninja wheel's binary, where the venv is not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=_name(), sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                           is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any failure to build means: fall back
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"layernorm.torch: the C++ CPU operator could not be built ({why}); "
                      f"CPU tensors use the Python path, which costs more per call",
                      RuntimeWarning, stacklevel=2)
        return False
    address = ctypes.cast(_callback, ctypes.c_void_p).value
    torch.ops.layernorm_cpu._setup(address, entry.OPENMP_SERIAL_ELEMENTS,
                                   kernels.ROWS_PER_CHUNK, kernels.MAX_CHUNKS, kernels.NSTATS,
                                   kernels.CENTRED, kernels.ZERO_CENTERED, memory.CAP_BYTES,
                                   recovery.MARGIN, kernels.HI, kernels.LO, kernels.RSTD,
                                   kernels.SCALE)
    return True
