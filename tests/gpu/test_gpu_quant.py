"""The Triton kernels of the quantized norms (layernorm.gpu.quant) through their launcher
(layernorm.gpu.launch.forward_quant), held to the spec's tests (quant_cases.QuantSpec, the same
the CPU paths pass) on both of their paths: a tile of whole rows quantized in registers, and
long rows (the plan's limits lowered) quantized from y in a second kernel. On CUDA where
present, else in Triton's interpreter on CPU tensors (conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
from quant_cases import QuantSpec  # noqa: E402
from triton_cases import OVERFLOW_IS_AN_ANSWER  # noqa: E402

from layernorm.gpu import launch  # noqa: E402

# every buffer the launchers allocate starts as NaN (conftest.py); the interpreter computes
# masked-out lanes too
pytestmark = [pytest.mark.usefixtures("poisoned_outputs"), OVERFLOW_IS_AN_ANSWER]


@pytest.fixture(params=["short", "long"])
def backend(request, monkeypatch) -> str:
    """The Triton launcher, with rows short (whole in a tile) or long (every D > 64: the long
    forward in blocks of 32, then the quantization kernel in blocks of 32 per token, of whole
    groups per group)."""
    if request.param == "long":
        monkeypatch.setattr(launch, "MAX_SHORT_D_FWD", 64)
        monkeypatch.setattr(launch, "LONG_BLOCK", 32)
        assert launch.plan("fwd", 128).long
    return "triton"


def test_the_launcher_checks_a_direct_call():
    """Protects the launcher from an out-of-bounds write: a group size it does not take (0,
    32, or one not dividing D) and a static scale with a group size are refused before any
    kernel runs."""
    import torch

    x = torch.ones(2, 192)
    for group_size, scale in ((0, None), (32, None), (128, None), (64, torch.ones(1))):
        with pytest.raises(ValueError, match="group_size|static scale"):
            launch.forward_quant(x, None, None, None, 1e-6, centred=False, float8=False,
                                 scale=scale, group_size=group_size, qmax=127.0,
                                 min_scale=2.0**-23)


class TestTritonQuantSpec(QuantSpec):
    """The spec on the Triton kernels, on shapes the interpreter runs in seconds."""

    ORACLE_SHAPE = (6, 256)
    BATCH_SHAPE = (9, 256)


def test_the_gpu_tool_without_cuda_says_so():
    """Protects tools/gpu_quant.py (the quantized norm's GPU timing, run by
    tools/gpu_session.sh quant) on a machine without CUDA: one line and exit status 2, no
    traceback; it imports the benchmark's pieces it times with."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the tool would measure")
    tool = Path(__file__).resolve().parents[2] / "tools" / "gpu_quant.py"
    res = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 2 and res.stderr.strip() == "tools/gpu_quant.py: no CUDA device here"
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_quant", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SHAPES and module.CASES
