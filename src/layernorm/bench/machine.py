"""The machine and library versions a benchmark row or the report records beside its figures."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["command_line", "machine_info", "run_meta"]


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
    for mod in ("torch", "triton", "ml_dtypes", "matplotlib"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    return info


def command_line() -> str:
    """The command that is running, as a user would type it again: ``layernorm ...`` for the
    command (its script or ``python -m layernorm``), else ``python <script> ...``."""
    script = Path(sys.argv[0])
    if script.name in ("layernorm", "__main__.py") or not script.name:
        return " ".join(["layernorm", *sys.argv[1:]])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return " ".join(["python", script.as_posix(), *sys.argv[1:]])


def run_meta() -> dict:
    """What every benchmark run records beside its rows: when, where, the command, the machine
    and versions, and the 1-minute load average (other processes share the cores), to which the
    run appends the load average at its end."""
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "command": command_line(),
        "machine": machine_info(),
        "loadavg": [os.getloadavg()[0]],
    }
