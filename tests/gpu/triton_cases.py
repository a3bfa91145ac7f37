"""The Triton kernels' test cases, shared by the tests of tests/gpu: a norm's inputs as tensors
(:class:`Case`, :func:`make_case`), its run through the launchers and the float64 oracle, the
comparison with the tolerance table (:func:`assert_matches_oracle`), and inputs laid out or
valued to test one thing (:func:`strided`, :func:`rescaled_rows`).

    DEVICE                  "cuda" where present, else "cpu" (Triton's interpreter)
    make_case(norm, M, D, dtype, ...) -> Case: inputs drawn from a seed, rounded to the dtypes
    Case.run() -> (results, mean, rstd); Case.oracle(float64_oracle)
    assert_matches_oracle(case, float64_oracle, ...) -> results within the table
    poisoned_empty          torch.empty whose floating buffers start as NaN (the
                            ``poisoned_outputs`` fixture of conftest.py installs it)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from fuzzing import family_scales

from layernorm import tolerances
from layernorm.dtypes import DTYPES, resolve
from layernorm.family import NORMS, Norm
from layernorm.gpu import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
SHORT_D, LONG_D = 37, 100  # a ragged row packed several a tile; a long row of ragged blocks

# Drawn extremes may have a true result beyond a dtype's range (inf), and Triton's interpreter
# computes masked-out lanes too: NumPy warns of both.
OVERFLOW_IS_AN_ANSWER = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value|divide by zero) encountered")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_numpy(t: torch.Tensor | None) -> np.ndarray | None:
    """The same values in a NumPy array of the same dtype (bfloat16 from ml_dtypes)."""
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return t.detach().float().cpu().numpy().astype(resolve("bfloat16"))
    return t.detach().cpu().numpy()


def compute_name(dtype: torch.dtype) -> str:
    return "float64" if dtype == torch.float64 else "float32"


def coarser(*names: str) -> str:
    """The least precise of the dtypes named."""
    return min(names, key=lambda n: DTYPES[n].significand_bits)


@dataclass
class Case:
    """One problem: a norm's inputs as tensors on DEVICE, and the flags of its launch."""

    norm: Norm
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    dy: torch.Tensor
    dh: torch.Tensor | None
    eps: float
    zero_centered_gamma: bool = False
    h_dtype: torch.dtype | None = None

    @property
    def xn_dtype(self) -> torch.dtype:
        """The dtype of what is normalized: h's, or x's."""
        return (self.h_dtype or self.x.dtype) if self.norm.residual else self.x.dtype

    def run(self) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """Our forward and backward through the launchers: results keyed as the oracle's, and
        the saved mean and rstd."""
        n = self.norm
        y, h, mean, rstd = launch.forward(
            self.x, self.residual, self.weight, self.bias, self.eps, centred=n.centred,
            zero_centered_gamma=self.zero_centered_gamma, h_dtype=self.h_dtype)
        dx, dr, dw, db = launch.backward(
            self.dy, self.dh, h if n.residual else self.x, self.weight, self.bias, mean, rstd,
            centred=n.centred, zero_centered_gamma=self.zero_centered_gamma,
            x_dtype=self.x.dtype if n.residual else None,
            residual_dtype=self.residual.dtype if n.residual else None)
        got = {"y": y, "h": h, "dx": dx, "dresidual": dr, "dgamma": dw, "dbeta": db}
        keep = ("y", *n.forward_outputs[1:], "dx", *n.backward_outputs[1:], "dgamma",
                *(("dbeta",) if n.centred else ()))
        return {k: got[k] for k in keep}, mean, rstd

    def oracle(self, float64_oracle):
        """The float64 oracle (tests/conftest.py) on the same rounded inputs."""
        args = [to_numpy(self.x)] + ([to_numpy(self.residual)] if self.norm.residual else [])
        args += [to_numpy(self.weight)] + ([to_numpy(self.bias)] if self.norm.centred else [])
        cot = [to_numpy(self.dy)] + ([to_numpy(self.dh)] if self.norm.residual else [])
        kw = {"residual_dtype": dtype_name(self.h_dtype)} if self.norm.residual and self.h_dtype \
            else {}
        return float64_oracle(self.norm, args, cot, eps=self.eps,
                              zero_centered_gamma=self.zero_centered_gamma, **kw)

    def tolerance_dtype(self, name: str, result: torch.Tensor) -> tuple[str, str]:
        """(dtype, quantity) of ``name``'s table entry: its own dtype, no more precise than
        the compute dtype it came from."""
        cdt = compute_name(self.xn_dtype)
        if name == "h":
            return dtype_name(result.dtype), "out"
        if name in ("dgamma", "dbeta"):
            dt = coarser(dtype_name(result.dtype), cdt)
            return dt, "param" if dt == "float64" else "gpu-param"
        return coarser(dtype_name(result.dtype), cdt), "out"


def make_case(norm: str, M: int, D: int, dtype: str, *, seed: int = 0, eps: float | None = None,
              residual_dtype: str | None = None, param_dtype: str | None = None,
              h_dtype: str | None = None, dh: bool = True, affine: str = "both",
              zero_centered_gamma: bool = False, loc: float = 0.5, spread: float = 2.0) -> Case:
    """A :class:`Case` drawn from ``seed``, rounded to the dtypes named: x = loc + spread *
    N(0, 1); weight near 1 (near 0 with zero_centered_gamma), the rest N(0, 1). ``affine``:
    "both", "weight", "bias" or "none"."""
    n = NORMS[norm]
    g = torch.Generator().manual_seed(seed)

    def draw(shape, name, mean=0.0, std=1.0):
        t = torch.randn(shape, generator=g, dtype=torch.float64) * std + mean
        return t.to(DEVICE, torch_dtype(name))

    pd = param_dtype or dtype
    rd = residual_dtype or dtype
    x = draw((M, D), dtype, loc, spread)
    residual = draw((M, D), rd) if n.residual else None
    weight = draw((D,), pd, 0.0 if zero_centered_gamma else 1.0, 0.5)
    bias = draw((D,), pd, 0.0, 0.5) if n.centred else None
    dy = draw((M, D), dtype)
    dh_t = draw((M, D), rd) if n.residual and dh else None
    return Case(n, x, residual,
                weight if affine in ("both", "weight") else None,
                bias if affine in ("both", "bias") else None,
                dy, dh_t, n.eps if eps is None else eps, zero_centered_gamma,
                torch_dtype(h_dtype) if h_dtype and n.residual else None)


def assert_matches_oracle(case: Case, float64_oracle, *, rows_scaled: bool = False,
                          floor: float = 0.0, results: dict | None = None) -> dict:
    """Every result of ``case`` within the table of the oracle's (scaled by the size of its
    terms, per row for y, dx and dresidual when ``rows_scaled``: rows of very different sizes;
    ``floor`` as for :func:`layernorm.tolerances.compare`), in the right dtype and shape;
    returns our results. ``results``: those of ``case.run()`` when the test has them already
    (the case is then not run again)."""
    got = case.run()[0] if results is None else results
    o = case.oracle(float64_oracle)
    assert got.keys() == o.results.keys()
    sizes = family_scales(o)
    for name, g in got.items():
        want = o.results[name]
        if want is None:
            assert g is None, f"{name} should be None"
            continue
        param = name in ("dgamma", "dbeta")
        ref_t = case.weight if name == "dgamma" else case.bias if name == "dbeta" else \
            case.x if name in ("y", "dx") else case.residual
        want_dtype = {"h": case.xn_dtype}.get(name, ref_t.dtype)
        assert g.dtype == want_dtype and tuple(g.shape) == want.shape, (name, g.dtype, g.shape)
        dt, quantity = case.tolerance_dtype(name, g)
        a = to_numpy(g).astype(np.float64)
        if rows_scaled and not param and name != "h":
            for r in range(a.shape[0]):
                one = slice(r, r + 1)
                row = dataclasses.replace(o, xhat=o.xhat[one], rstd=o.rstd[one], dy=o.dy[one],
                                          dh=o.dh[one])
                size = family_scales(row)[name]
                tolerances.assert_close(a[r], want[r], dt, quantity, scale=size, floor=floor,
                                        name=f"{name}[{r}]")
        else:
            tolerances.assert_close(a, want, dt, quantity, scale=sizes[name], floor=floor,
                                    name=name)
    return got


def poisoned_empty(*args, **kw) -> torch.Tensor:
    """torch.empty, filled with NaN where the dtype is floating."""
    t = _empty(*args, **kw)
    return t.fill_(float("nan")) if t.is_floating_point() else t


_empty = torch.empty


def strided(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same values as rows of a wider tensor: row stride 2 * D + 3, unit column stride."""
    if t is None:
        return None
    wide = torch.full((t.shape[0], 2 * t.shape[1] + 3), float("nan"), dtype=t.dtype,
                      device=t.device)
    wide[:, 3:3 + t.shape[1]] = t
    return wide[:, 3:3 + t.shape[1]]


def rescaled_rows(case: Case) -> None:
    """Rows whose sums overflow the compute dtype, with big = 0.9 * the largest value: row 0 one
    big and D - 1 -big (D = 8: mean -0.675 big, and x - mean overflows), row 2 a spread of
    big / 2**60 (its squares overflow), row 3 big / 4 + noise (its sum overflows). Residuals
    are 0 there."""
    big = 0.9 * DTYPES[dtype_name(case.x.dtype)].largest
    D = case.x.shape[1]
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(D, generator=g, dtype=torch.float64)
    rows = {0: torch.tensor([big] + [-big] * (D - 1), dtype=torch.float64),
            2: noise * (big * 2.0**-60), 3: big / 4 + noise * (big / 400)}
    for r, v in rows.items():
        case.x[r] = v.to(DEVICE, case.x.dtype)
        if case.residual is not None:
            case.residual[r] = 0.0
