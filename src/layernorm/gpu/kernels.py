r"""Fused Triton kernels for the family of norms; their launchers, which pick a plan per row
length, check the arguments and allocate the outputs, are :mod:`layernorm.gpu.launch`.

The maths, for one row of length D (the NumPy oracle, :mod:`layernorm.reference`, computes the
same; docs/gpu-fusion.md explains the design). T is the compute dtype: float64 for float64 data,
float32 otherwise. LayerNorm (``centred``) and RMSNorm share every kernel:

    [add]  h_j = x_j + r_j in the widest compute dtype of x, r and h, rounded once to h's dtype;
           the row normalized below (xn) is h as rounded, else xn = x
    LayerNorm                                  RMSNorm
    m    = (1/D) sum_j xn_j                    (no mean: MEAN = 0)
    c    = (1/D) sum_j (xn_j - m)              the rounding error of m
    xc_j = (xn_j - m) - c                      xc_j = xn_j
    var  = (1/D) sum_j xc_j^2                  var = (1/D) sum_j xn_j^2
    MEAN = m + c,  RSTD = 1 / sqrt(var + eps),  xhat_j = xc_j * RSTD
    y_j  = scale_j * xhat_j + beta_j           scale = w, or 1 + w (zero_centered_gamma) in T

    g_j  = dy_j * scale_j                      (g = dy without weight)
    dn_j = RSTD * (g_j - mean(g) - xhat_j * mean(g * xhat))     [RMSNorm: no mean(g)]
    dx_j = dn_j;  add-norms: dx_j = dresidual_j = dn_j + dh_j in the add's dtype, rounded once
           to x's dtype and once to the residual's
    dw_j = sum over rows of dy_j * xhat_j,  db_j = sum over rows of dy_j

Exact facts the kernels rely on, whatever the hardware's division and square root:

1. A constant row (LayerNorm: max == min; RMSNorm: every element 0) is found by comparison,
   not by var == 0: xhat = 0 exactly, y = beta (0 for RMSNorm), MEAN = the row's value,
   RSTD = 1/sqrt(eps) (inf when eps = 0; the backward's dx on such a row is then rstd times
   g - mean(g): +-inf, or NaN where that is 0, as the derivative there is unbounded).
2. Row reductions' divisions and the square root are correctly rounded (tl.div_rn,
   tl.sqrt_rn; float64 '/' and sqrt are already), so the GPU computes what the interpreter
   shows, and RSTD is not flushed to zero.
3. A row whose sums overflow T, or whose var + eps falls below T's smallest normal number
   (eps = 0 and tiny values), is recomputed as xn * s, s = 2**k from max|xn| (exact), with
   eps * s**2. It saves the statistics of xn * s, RSTD negated as the mark: MEAN = mean(xn * s),
   RSTD = -1/sqrt(var(xn * s) + eps * s**2). The backward recomputes s from max|xn| and works
   on xn * s, so no value of the row overflows there either; dx = s * (RSTD_s * bracket).

Code paths, one line each:

* short rows (D <= launch.MAX_SHORT_D_FWD forward, MAX_SHORT_D_BWD backward): a program holds
  a tile of whole rows (several rows when D is small) in registers; x (and dy) are read once.
* long rows: a program loops over its row in blocks of launch.LONG_BLOCK; the forward reads xn
  twice (statistics with a Chan merge of block statistics, then y); add-norms write h in the
  first pass and read it back in the second. The backward is a row-statistics kernel (three row
  means per row, and s) and a dx kernel on a (row chunk, column block) grid.
* the rescaled rows of item 3: a branch per tile (or row) taken only where a row needs it.
* float64 data: the same kernels in float64, with tiles half as large (``launch.plan(wide=True)``).
* the memory-efficient backward (:func:`launch.backward_from_y`): the same backward kernels with
  FROM_Y, reading y where they read xn: xhat_j = (y_j - shift_j) / scale_j (shift = bias,
  a correctly rounded division), or, on the k channels layernorm.recovery keeps, the saved
  xhat from an (M, k) store through a per-channel map (channel -> column, -1 if recovered);
  on the r rows layernorm.recovery keeps whole (var < eps under a shift), the saved xhat on
  every channel from an (r, D) store through a per-row map (row -> its row there, -1 if
  recovered), read once per row (a branch per tile or row, compiled only when r > 0).
  No mean, no correction pass, no rescaling: rstd is the row's own.
* dw and db: each backward program adds its rows into partial sums in T, one (P, D) row per
  program; a second kernel sums the P rows in a fixed order. No atomics: bit-identical runs.
* the quantized output (:mod:`layernorm.gpu.quant`): short rows normalized as the forward does
  and quantized in registers; long rows through the long forward (y kept in T) and a second
  kernel that takes the groups' scales and writes q.

Results are rounded once to their dtype (y to x's; h to h's; dx, dresidual, dw, db to their
own). A row's y and dx do not depend on the other rows, nor on M.

The kernels live in :mod:`layernorm.gpu.forward`, :mod:`layernorm.gpu.backward` and
:mod:`layernorm.gpu.quant`, their shared
element helpers in :mod:`layernorm.gpu.elements`; this module names them for the launchers and
the tools.
"""

from __future__ import annotations

from .backward import (
    _bwd_long_dx_kernel,
    _bwd_long_rowstats_kernel,
    _bwd_short_kernel,
    _sum_partials_kernel,
)
from .elements import INTERPRET
from .forward import _fwd_long_kernel, _fwd_short_kernel
from .quant import _quant_rows_kernel, _quant_short_kernel

__all__ = ["INTERPRET", "_bwd_long_dx_kernel", "_bwd_long_rowstats_kernel", "_bwd_short_kernel",
           "_fwd_long_kernel", "_fwd_short_kernel", "_quant_rows_kernel", "_quant_short_kernel",
           "_sum_partials_kernel"]
