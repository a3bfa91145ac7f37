"""The GPU tests run on CUDA when a device is present, else in Triton's interpreter on CPU tensors.

Triton picks the interpreter when a kernel is decorated, i.e. when layernorm.gpu.kernels is first
imported, so TRITON_INTERPRET is set here, at collection, before the test modules import it.
"""

from __future__ import annotations

import os

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


if torch is not None:
    import pytest

    @pytest.fixture
    def poisoned_outputs(monkeypatch):
        """Every buffer the launchers allocate (outputs, statistics, partial sums) starts as
        NaN, so an element no kernel writes is NaN in the results and fails the comparison,
        instead of passing on whatever the allocator's memory held. The modules of the
        launchers' tests use it for every test (``pytest.mark.usefixtures``)."""
        from triton_cases import poisoned_empty

        from layernorm.gpu import launch

        monkeypatch.setattr(launch.torch, "empty", poisoned_empty)

    @pytest.fixture
    def check(float64_oracle):
        """:func:`triton_cases.assert_matches_oracle` with the float64 oracle."""
        from triton_cases import assert_matches_oracle

        def check(case, **kw) -> dict:
            return assert_matches_oracle(case, float64_oracle, **kw)
        return check

    @pytest.fixture
    def partial_rows(monkeypatch) -> list[int]:
        """The number of partial rows of dw and db (of programs writing them) of every
        backward launched from here on, with 16 "SMs"."""
        from layernorm.gpu import launch

        monkeypatch.setattr(launch, "_sm_count", lambda device: 16)
        seen: list[int] = []
        count = launch._partial_rows

        def recording(*args, **kw) -> int:
            seen.append(count(*args, **kw))
            return seen[-1]
        monkeypatch.setattr(launch, "_partial_rows", recording)
        return seen

    @pytest.fixture(params=["short", "long"])
    def path(request, monkeypatch) -> int:
        """The row length of a short-row test (several rows a tile), or of a long-row one:
        every D > 64 takes the long path in blocks of 32 (16 for float64), ragged last block
        included. A test may choose one path by indirect parametrization ("short" or
        "long")."""
        from triton_cases import LONG_D, SHORT_D

        from layernorm.gpu import launch

        if request.param == "short":
            return SHORT_D
        monkeypatch.setattr(launch, "MAX_SHORT_D_FWD", 64)
        monkeypatch.setattr(launch, "MAX_SHORT_D_BWD", 64)
        monkeypatch.setattr(launch, "LONG_BLOCK", 32)
        assert launch.plan("fwd", LONG_D).long and launch.plan("bwd", LONG_D, wide=True).long
        return LONG_D
