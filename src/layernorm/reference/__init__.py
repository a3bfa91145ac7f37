r"""NumPy reference for the normalization family: the oracle every other backend is checked against.

The maths (one row of length D; docs/derivation.md has every step). LayerNorm centres the row;
RMSNorm does not, and has no shift:

    LayerNorm                              RMSNorm
    mean = (1/D) sum_j x_j
    var  = (1/D) sum_j (x_j - mean)^2      ms   = (1/D) sum_j x_j^2
    rstd = 1 / sqrt(var + eps)             rstd = 1 / sqrt(ms + eps)
    xhat = (x - mean) * rstd               xhat = x * rstd
    y    = scale * xhat + beta             y    = scale * xhat

scale is gamma, or 1 + gamma with ``zero_centered_gamma`` (no scale without gamma). With
g = dy * scale,

    dbeta  = sum over rows of dy
    dgamma = sum over rows of dy * xhat     (also with zero_centered_gamma: d(1 + gamma)/dgamma = 1)
    dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))     LayerNorm: two row reductions
    dx     = rstd * (g - xhat * mean(g * xhat))               RMSNorm: one

The add-norms form h = x + residual, rounded once to ``residual_dtype``, and normalize h. x and
residual each enter h with derivative 1, so with dh the gradient reaching h from the residual
stream (h feeds the next block as well as the norm),

    dx = dresidual = dh + (the norm's dx with respect to h)

Forward mode (the Jacobian-vector product, docs/derivation.md "Forward mode"): with tangents
u of x, tgamma and tbeta,

    t_xhat = rstd * (u - mean(u) - xhat * mean(xhat * u))     LayerNorm (RMSNorm: no mean(u))
    t_y    = scale * t_xhat + tgamma * xhat + tbeta

the backward's operator applied to u: d xhat / dx is symmetric, so the same two (one) row
reductions give both products. An add-norm's tangent of h is tx + tresidual; t_y is the norm's
of it. The ``*_jvp`` functions read the same cache as the backward.

Both kinds share one statistics routine (centring optional), one backward core and one cache
class, :class:`NormCache`: xhat (M, D), rstd (M,) and a copy of the scale (D,). That is all
the formula reads: two (one) row reductions and no forward recomputation. x, mean and var are
not kept. The scale is copied, so the backward differentiates the forward that ran even when
the caller changes gamma in place in between (an optimizer step): every backend follows this
rule. The add-norms keep nothing more (:class:`AddNormCache`): not h, not x, not residual.

Accuracy mechanism (chosen by measurement: ``layernorm stability``, docs/numerics.md). All
arithmetic is in the compute dtype cdt: float64 for float64 inputs, float32 for float32,
float16 and bfloat16 inputs; u is its unit roundoff (2**-24 float32, 2**-53 float64).
Per row of length D:

1. LayerNorm statistics, corrected two-pass: m = mean(x); d = x - m; d = d - mean(d);
   var = mean(d*d); rstd = 1/sqrt(var + eps); xhat = d * rstd. The second subtraction removes
   the rounding error of m (up to half an ulp of |m|, plus the sum's error) from every centred
   value; without it y is off by ~ u*|mean|/std, and a constant row gives xhat = ±1, not 0.
   RMSNorm has no mean to subtract: ms = mean(x*x), a sum of non-negative terms, is accurate
   to ~ u*log2(D) relative with nothing to cancel.
2. Every row sum is pairwise (NumPy's over a C-contiguous row, error ~ u*log2(D)), never
   sequential (error ~ u*D). A kernel uses a tree or blocked sum, or Chan's merge of
   per-block (count, mean, M2).
3. A row whose sum or sum of squares overflows cdt (|sum(x)| or D*(x - mean)**2, D*x**2 for
   RMSNorm, above the largest float: |x - mean| or |x| ~ 1.8e19/sqrt(D) in float32 and
   bfloat16, 1.3e154/sqrt(D) in float64) is normalized as x*2**-e with eps*4**-e in float64
   (a power-of-two scaling is exact; max|x*2**-e| < 1) and its rstd scaled back by 2**-e.
   Other rows pay one isfinite test of var (ms).
4. Backward: g = dy*scale, the row means and dx in cdt with pairwise row sums. When g is
   close to span{1, xhat} (span{xhat} for RMSNorm) the bracket cancels: dx's normwise error
   is a few u*kappa, kappa = max|g|*rstd/max|dx|, set by the rounding of the cached xhat and
   of g (docs/numerics.md has the measurements, and why float64 sums are not used).
5. Sums over rows (dgamma, dbeta) accumulate in float64.
6. scale = 1 + gamma is formed in cdt, never in a half dtype: bfloat16 holds 1 + gamma only to
   2**-8, so a small gamma (a zero-centred gamma starts at 0 and stays near it) would round
   away, and its training with it.
7. Add-norms: h = x + residual is formed in the widest compute dtype of x, residual and
   residual_dtype, then rounded once to residual_dtype (x's dtype by default; float32 keeps a
   bfloat16 model's residual stream in float32). The norm reads that rounded h and computes in
   h's compute dtype, so y is layer_norm_forward(h) (rms_norm_forward(h)), rounded once to x's
   dtype. The backward adds dh to the norm's dx in the add's compute dtype, before that dx is
   rounded, and rounds the total once to x's dtype (dx) and once to residual's (dresidual).

Only NumPy is used here: no autodiff, no other array library. The package's modules:
``core`` (the caches, and the statistics, forward, backward and forward mode every norm
shares), ``functions`` (the public functions of each norm and add-norm) and ``modules`` (the
stateful :class:`LayerNorm` and :class:`RMSNorm`).
"""


from __future__ import annotations

from .core import AddNormCache, NormCache, OutputCache
from .functions import (
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_layer_norm_jvp,
    add_rms_norm_backward,
    add_rms_norm_forward,
    add_rms_norm_jvp,
    layer_norm_backward,
    layer_norm_forward,
    layer_norm_jvp,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_jvp,
)
from .modules import LayerNorm, RMSNorm
from .quant import layer_norm_quant, rms_norm_quant

__all__ = [
    "AddNormCache",
    "LayerNorm",
    "NormCache",
    "OutputCache",
    "RMSNorm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_layer_norm_jvp",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "add_rms_norm_jvp",
    "layer_norm_backward",
    "layer_norm_forward",
    "layer_norm_jvp",
    "layer_norm_quant",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_jvp",
    "rms_norm_quant",
]
