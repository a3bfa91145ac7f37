"""The machine and library versions a benchmark row or the report records beside its figures."""

from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path

__all__ = ["machine_info"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    """Machine and versions, for the report header and benchmark rows."""
    import numpy

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "logical cpus": str(os.cpu_count()),
        "numpy": numpy.__version__,
    }
    for mod in ("numba", "torch", "triton", "ml_dtypes", "matplotlib"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    return info
