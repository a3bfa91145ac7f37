// The CPU kernels of the ops layernorm::fwd, layernorm::bwd and layernorm::norm, and of the
// memory-efficient pair layernorm::fwd_y and layernorm::bwd_y.
//
// The arithmetic is the CPU engine's (engine.h: forward.cpp, backward.cpp). This file checks,
// allocates, converts the parameters to the compute dtype, and splits rows over torch's own
// threads (operator.h): a call costs about what one of torch's own operators does, follows
// torch.set_num_threads, runs small work on the calling thread, and in a forked child runs on
// the calling thread (operator.h, parallel).

#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "operator.h"

namespace layernorm::op {
namespace {

// The checks both backwards make of the rows they read (xn, or y in the memory-efficient
// mode, named ``name``), dy, dh, the parameters and the forward's (M, NSTATS) statistics;
// returns D.
int64_t check_backward(const Tensor& dy, const OptTensor& dh, const Tensor& src,
                       const char* name, const OptTensor& weight, const OptTensor& bias,
                       const Tensor& stats0) {
  TORCH_CHECK(src.dim() >= 1 && src.size(-1) >= 1, "layernorm: ", name,
              " must be (..., D) with D >= 1, got ", src.sizes());
  const int64_t d = src.size(-1), m = src.numel() / d;
  check_cpu(src, name);
  check_like(dy, src, "dy", name);
  if (dh.has_value()) check_like(*dh, src, "dh", name);
  check_param(weight, d, "weight");
  check_param(bias, d, "bias");
  check_cpu(stats0, "stats0");
  TORCH_CHECK_VALUE(stats0.dim() == 2 && stats0.size(0) == m &&
                        stats0.size(1) == engine::kStats &&
                        stats0.scalar_type() == ScalarType::Double,
                    "layernorm: stats0 must be the forward's (M, ", engine::kStats,
                    ") float64 statistics for M = ", m, ", got ", stats0.sizes(), " ",
                    stats0.scalar_type());
  return d;
}

// D of x (..., D), checked: D >= 1.
int64_t row_length(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "layernorm: x must be (..., D) with D >= 1, got ",
              x.sizes());
  return x.size(-1);
}

// x (..., D), normalized over its last axis as M = numel / D rows: y and h of x's shape (h
// an empty (0,) without residual) and stats ((M, NSTATS) float64, undefined when the caller
// keeps none). With `quant`, y is quantized as it says (its q and scales allocated by the
// caller) and the y returned is undefined.
std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& x, const OptTensor& residual,
                                           const OptTensor& weight, const OptTensor& bias,
                                           double eps, bool centred, bool zero_centered_gamma,
                                           std::optional<ScalarType> h_dtype, bool keep,
                                           const RowsHook& after = {},
                                           const engine::Quantize* quant = nullptr) {
  const int64_t d = row_length(x), m = x.numel() / d;
  const bool add = residual.has_value();
  check_cpu(x, "x");
  if (add) check_like(*residual, x, "residual", "x");
  check_param(weight, d, "weight");
  check_param(bias, d, "bias");
  const ScalarType xdt = x.scalar_type(), hdt = h_dtype.value_or(xdt);
  const ScalarType cdt = compute(add ? hdt : xdt);
  const Tensor xc = x.contiguous();
  Tensor y = quant ? Tensor() : output(x.sizes(), x.options());
  Tensor rc, h;
  if (add) {
    rc = residual->contiguous();
    h = output(x.sizes(), x.options().dtype(hdt));
  } else if (!quant) {
    h = at::empty({0}, x.options());
  }
  Tensor stats = keep ? at::empty({m, engine::kStats}, x.options().dtype(at::kDouble)) : Tensor();
  if (m == 0) return {y, h, stats};
  // the parameters in the compute dtype for this call (no copy where they already are)
  const void* scale = param_row(weight, d, cdt, zero_centered_gamma, 1.0, 0);
  const void* shift = param_row(bias, d, cdt, false, 0.0, 1);
  const engine::Forward a{xc.const_data_ptr(),
                          add ? rc.const_data_ptr() : nullptr,
                          add ? h.mutable_data_ptr() : nullptr,
                          quant ? nullptr : y.mutable_data_ptr(),
                          scale,
                          shift,
                          eps,
                          centred,
                          keep ? stats.mutable_data_ptr<double>() : nullptr,
                          nullptr,
                          m,
                          d,
                          dtype_of(xdt),
                          add ? dtype_of(rc.scalar_type()) : engine::Dtype::none,
                          add ? dtype_of(hdt) : engine::Dtype::none};
  if (quant) {
    const engine::Kernels& k = kernels();
    parallel(0, m, grain(d), [&](int64_t i0, int64_t i1) {
      k.quantize_rows(a, *quant, i0, i1);
    });
  } else {
    run_forward(a, kSerialElements, after);
  }
  return {y, h, stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_cpu(
    const Tensor& x, const OptTensor& residual, const OptTensor& weight,
    const OptTensor& bias, double eps, bool centred, bool zero_centered_gamma,
    std::optional<ScalarType> h_dtype) {
  auto [y, h, stats] = forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                               h_dtype, true);
  // the second statistics tensor is the CUDA layout's; on the CPU it is (M, 0)
  return {y, h, stats, at::empty({stats.size(0), 0}, x.options().dtype(at::kLong))};
}

std::tuple<Tensor, Tensor> norm_cpu(const Tensor& x, const OptTensor& residual,
                                    const OptTensor& weight, const OptTensor& bias, double eps,
                                    bool centred, bool zero_centered_gamma,
                                    std::optional<ScalarType> h_dtype) {
  auto [y, h, stats] = forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                               h_dtype, false);
  return {y, h};
}

// q (x's shape: float8_e4m3fn where `float8`, else int8), the scales (float32: (..., D /
// group_size), group_size D where none is given; a copy of the static `scale` where one is)
// and h (undefined without residual) of the norm of x (or of h = x + residual) with its y
// quantized (engine.h, Quantize), with the dtype's qmax and min_scale (operator.h).
std::tuple<Tensor, Tensor, Tensor> quantized(
    const Tensor& x, const OptTensor& residual, const OptTensor& weight, const OptTensor& bias,
    double eps, bool centred, bool zero_centered_gamma, std::optional<ScalarType> h_dtype,
    bool float8, const OptTensor& scale, std::optional<int64_t> group_size,
    const OptTensor& scale_ub) {
  const int64_t d = row_length(x), m = x.numel() / d;
  const QuantLimits limits = quant_limits(float8);
  // group_size: 64 or 128 (layernorm.reference.quant.GROUP_SIZES), dividing D
  const int64_t g = group_size.value_or(d);
  TORCH_CHECK_VALUE(!group_size.has_value() || ((g == 64 || g == 128) && d % g == 0),
                    "layernorm: group_size must be None or 64 or 128 dividing D = ", d, ", got ",
                    g);
  auto value = [](const OptTensor& t, const char* name) {
    check_cpu(*t, name);
    TORCH_CHECK_VALUE(t->numel() == 1 && t->scalar_type() == ScalarType::Float,
                      "layernorm: ", name, " must be a one-element float32 tensor, got ",
                      t->sizes(), " ", t->scalar_type());
    return t->item<float>();
  };
  const bool dynamic = !scale.has_value();
  TORCH_CHECK_VALUE(dynamic || (!group_size.has_value() && !scale_ub.has_value()),
                    "layernorm: a static scale takes no group_size or scale_ub");
  std::vector<int64_t> scale_sizes(x.sizes().begin(), x.sizes().end());
  scale_sizes.back() = d / g;
  Tensor q = output(x.sizes(),
                    x.options().dtype(float8 ? ScalarType::Float8_e4m3fn : ScalarType::Char));
  Tensor scales = dynamic ? output(scale_sizes, x.options().dtype(at::kFloat))
                          : scale->clone(at::MemoryFormat::Contiguous);
  const float static_scale = dynamic ? 0.0f : value(scale, "scale");
  TORCH_CHECK_VALUE(dynamic || (std::isfinite(static_scale) && static_scale > 0.0f),
                    "layernorm: scale must be finite and > 0, got ", static_scale);
  const float ub = scale_ub.has_value() ? value(scale_ub, "scale_ub")
                                        : std::numeric_limits<float>::infinity();
  TORCH_CHECK_VALUE(!scale_ub.has_value() || (std::isfinite(ub) && ub > 0.0f),
                    "layernorm: scale_ub must be finite and > 0, got ", ub);
  engine::Quantize quant{q.mutable_data_ptr(),
                         dynamic ? scales.mutable_data_ptr<float>() : nullptr,
                         static_scale,
                         ub,
                         limits.qmax,
                         limits.min_scale,
                         g,
                         float8 ? engine::QDtype::float8_e4m3fn : engine::QDtype::int8};
  Tensor h = std::get<1>(forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                                 h_dtype, false, {}, &quant));
  return {q, scales, h};
}

// The two ops: the plain norm's (two outputs) and the add-norm's (h too). Two schemas, not one
// with an optional residual: a decode step's call pays torch's dispatch per argument and per
// output (a third output and two more arguments took about 0.6 us of a 10 us call on the
// development machine).
std::tuple<Tensor, Tensor> norm_quant_cpu(const Tensor& x, const OptTensor& weight,
                                          const OptTensor& bias, double eps, bool centred,
                                          bool zero_centered_gamma, bool float8,
                                          const OptTensor& scale,
                                          std::optional<int64_t> group_size,
                                          const OptTensor& scale_ub) {
  auto [q, scales, h] = quantized(x, std::nullopt, weight, bias, eps, centred,
                                  zero_centered_gamma, std::nullopt, float8, scale, group_size,
                                  scale_ub);
  return {q, scales};
}

std::tuple<Tensor, Tensor, Tensor> add_norm_quant_cpu(
    const Tensor& x, const Tensor& residual, const OptTensor& weight, const OptTensor& bias,
    double eps, bool centred, bool zero_centered_gamma, std::optional<ScalarType> h_dtype,
    bool float8, const OptTensor& scale, std::optional<int64_t> group_size,
    const OptTensor& scale_ub) {
  return quantized(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype, float8,
                   scale, group_size, scale_ub);
}

// The two backwards after their own checks: dx (and dresidual, when residual_dtype is given)
// allocated, dy and dh in their compute dtypes, the engine's backward over the row chunks on
// torch's threads (src is xn, or y with `recovery`), the partials reduced in chunk order, and
// dweight, dbias in the parameters' dtypes. d: the row length (check_backward's).
std::tuple<Tensor, Tensor, Tensor, Tensor> run_backward(
    const Tensor& src, int64_t d, const Tensor& dy, const OptTensor& dh, const void* scale,
    const Tensor& stats, const OptTensor& weight, const OptTensor& bias, bool centred,
    ScalarType cdt, ScalarType dxdt, std::optional<ScalarType> residual_dtype,
    const engine::Recovery* recovery) {
  const int64_t m = src.numel() / d;
  const bool add = residual_dtype.has_value();
  const Tensor srcc = src.contiguous();
  const Tensor dyc = in_dtype(dy, cdt);
  Tensor dx = output(src.sizes(), src.options().dtype(dxdt));
  Tensor dres = at::empty({0}, src.options());
  // dh joins dx in the widest of the dtypes involved; dresidual, when asked for, is a second
  // copy of the same sum in its own dtype
  const ScalarType adt = widest(dxdt, residual_dtype.value_or(dxdt), cdt);
  if (add) dres = output(src.sizes(), src.options().dtype(*residual_dtype));
  const bool with_dh = dh.has_value();
  const Tensor dhc = with_dh ? in_dtype(*dh, adt) : Tensor();
  Tensor sums = at::empty({2, d}, src.options().dtype(at::kDouble));
  const engine::Backward a{srcc.const_data_ptr(),
                           dyc.const_data_ptr(),
                           with_dh ? dhc.const_data_ptr() : nullptr,
                           dx.mutable_data_ptr(),
                           add ? dres.mutable_data_ptr() : nullptr,
                           scale,
                           stats.const_data_ptr<double>(),
                           nullptr,
                           nullptr,
                           nullptr,
                           recovery,
                           centred,
                           m,
                           d,
                           dtype_of(srcc.scalar_type()),
                           dtype_of(dyc.scalar_type()),
                           with_dh ? dtype_of(dhc.scalar_type()) : engine::Dtype::none,
                           dtype_of(dxdt),
                           add ? dtype_of(*residual_dtype) : engine::Dtype::none,
                           dtype_of(cdt)};
  run_chunks(a, sums, kSerialElements);
  // copies: a custom op's outputs never share memory
  Tensor dw = weight.has_value() ? sums[0].to(weight->scalar_type(), false, true)
                                 : at::empty({0}, src.options());
  Tensor db = bias.has_value() ? sums[1].to(bias->scalar_type(), false, true)
                               : at::empty({0}, src.options());
  return {dx, dres, dw, db};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_cpu(
    const Tensor& dy, const OptTensor& dh, const Tensor& xn, const OptTensor& weight,
    const OptTensor& bias, const Tensor& stats0, const Tensor& stats1, bool centred,
    bool zero_centered_gamma, std::optional<ScalarType> x_dtype,
    std::optional<ScalarType> residual_dtype) {
  const int64_t d = check_backward(dy, dh, xn, "xn", weight, bias, stats0);
  const ScalarType ndt = xn.scalar_type();
  const ScalarType cdt = compute(ndt);
  const void* scale = param_row(weight, d, cdt, zero_centered_gamma, 1.0, 0);
  return run_backward(xn, d, dy, dh, scale, stats0.contiguous(), weight, bias, centred, cdt,
                      x_dtype.value_or(ndt), residual_dtype, nullptr);
}

// --- the memory-efficient pair -----------------------------------------------------------
// fwd_y: keep, then the forward with kept, then rows and xrows. keep (k,) int64 is
// layernorm.recovery's rule on the scale and shift as the kernel formed them in T (weight, or
// 1 + weight, ones without it; bias, zeros without it), compared in float64 against y's dtype's
// smallest normal (tiny) and largest numbers:
//   recovered  <=>  MARGIN |scale_j| >= |shift_j| + tiny  and  |scale_j| sqrt(D) + |shift_j| <=
//                   largest / 2
// and kept (M, k) is xhat of the other channels from the statistics, in float64 rounded to T:
// ((x SCALE - HI) - LO) RSTD. rows (r,) int64 are the rows kept whole: where the shift is
// non-zero on a recovered channel, those with rstd^2 eps > 1/2 in double (var < eps), rstd =
// RSTD SCALE; xrows (r, D) their xhat, formed as kept is.

std::pair<double, double> limits(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return {std::numeric_limits<float>::min(), std::numeric_limits<float>::max()};
    case ScalarType::Double:
      return {std::numeric_limits<double>::min(), std::numeric_limits<double>::max()};
    case ScalarType::Half:
      return {static_cast<double>(std::numeric_limits<at::Half>::min()),
              static_cast<double>(std::numeric_limits<at::Half>::max())};
    case ScalarType::BFloat16:
      return {static_cast<double>(std::numeric_limits<at::BFloat16>::min()),
              static_cast<double>(std::numeric_limits<at::BFloat16>::max())};
    default: TORCH_CHECK_TYPE(false, "layernorm: no CPU kernel for dtype ", t);
  }
}

// keep (k,): the channels whose xhat the forward keeps, ascending; and whether the shift is
// non-zero on a channel not kept (only then are rows kept whole).
std::pair<Tensor, bool> keep_of(const OptTensor& weight, const OptTensor& bias,
                                bool zero_centered_gamma, ScalarType cdt, ScalarType ydt,
                                int64_t d, const at::TensorOptions& options) {
  const auto [tiny, largest] = limits(ydt);
  const double root = std::sqrt(static_cast<double>(d));
  const double margin = op::margin();
  auto recovered = [&](double s, double b) {
    return margin * s >= b + tiny && s * root + b <= largest / 2;  // NaN: false, kept
  };
  std::vector<int64_t> keep;
  bool shifted = false;
  if (!weight.has_value() && !bias.has_value()) {  // scale 1, shift 0: all or none
    if (!recovered(1.0, 0.0)) {
      keep.resize(d);
      for (int64_t j = 0; j < d; ++j) keep[j] = j;
    }
  } else {
    // the scale and shift as the kernel forms them in T, read as T
    const void* s =
        weight.has_value() ? param_row(weight, d, cdt, zero_centered_gamma, 1.0, 0) : nullptr;
    const void* b = bias.has_value() ? param_row(bias, d, cdt, false, 0.0, 1) : nullptr;
    auto scan = [&](auto zero) {
      using T = decltype(zero);
      const T* sp = static_cast<const T*>(s);
      const T* bp = static_cast<const T*>(b);
      for (int64_t j = 0; j < d; ++j) {
        const double sj = sp ? std::abs(static_cast<double>(sp[j])) : 1.0;
        const double bj = bp ? std::abs(static_cast<double>(bp[j])) : 0.0;
        if (!recovered(sj, bj)) {
          keep.push_back(j);
        } else if (bj != 0.0) {
          shifted = true;
        }
      }
    };
    if (cdt == ScalarType::Double) {
      scan(0.0);
    } else {
      scan(0.0f);
    }
  }
  Tensor out = at::empty({static_cast<int64_t>(keep.size())}, options.dtype(at::kLong));
  if (!keep.empty()) std::copy(keep.begin(), keep.end(), out.mutable_data_ptr<int64_t>());
  return {out, shifted};
}

// rows (r,) int64, ascending: the rows of the statistics (M, NSTATS) with rstd^2 eps > 1/2,
// rstd = RSTD SCALE, in double (layernorm.recovery.kept_rows; the caller checks the shift).
Tensor rows_of(const Tensor& stats, double eps, const at::TensorOptions& options) {
  const int64_t m = stats.size(0), ns = engine::kStats;
  const double* st = stats.const_data_ptr<double>();
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < m; ++i) {
    const double r = st[i * ns + engine::kRstd] * st[i * ns + engine::kScale];
    if (r * r * eps > 0.5) rows.push_back(i);
  }
  Tensor out = at::empty({static_cast<int64_t>(rows.size())}, options.dtype(at::kLong));
  if (!rows.empty()) std::copy(rows.begin(), rows.end(), out.mutable_data_ptr<int64_t>());
  return out;
}

// Rows [i0, i1) of out (n, c), float32 or float64: xhat of xn's rows (row i is rows[i], or i
// where rows is null) at the channels `cols` (c of them, or every channel where null), xn
// (M, D) contiguous of dtype xdt, from the statistics st (M, NSTATS), in float64 rounded once
// to out's dtype: ((x SCALE - HI) - LO) RSTD.
void xhat_rows(const void* xn, ScalarType xdt, const double* st, const int64_t* rows,
               int64_t i0, int64_t i1, const int64_t* cols, int64_t c, int64_t d,
               const Tensor& out) {
  const int64_t ns = engine::kStats;
  const int64_t chi = engine::kHi, clo = engine::kLo, cr = engine::kRstd, cs = engine::kScale;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xdt, "xhat", [&] {
    const scalar_t* xp = static_cast<const scalar_t*>(xn);
    auto fill = [&](auto* op) {
      using T = std::remove_pointer_t<decltype(op)>;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row_i = rows ? rows[i] : i;
        const double* s = st + row_i * ns;
        const double sc = s[cs], hi = s[chi], lo = s[clo], r = s[cr];
        const scalar_t* row = xp + row_i * d;
        T* o = op + i * c;
        if (cols) {
          for (int64_t j = 0; j < c; ++j) {
            o[j] = static_cast<T>(((static_cast<double>(row[cols[j]]) * sc - hi) - lo) * r);
          }
        } else {
          for (int64_t j = 0; j < c; ++j) {
            o[j] = static_cast<T>(((static_cast<double>(row[j]) * sc - hi) - lo) * r);
          }
        }
      }
    };
    if (out.scalar_type() == ScalarType::Double) {
      fill(out.mutable_data_ptr<double>());
    } else {
      fill(out.mutable_data_ptr<float>());
    }
  });
}

// (n, c) in cdt: xhat_rows of every one of the n rows `rows` of xn (M, D), over torch's threads.
Tensor xhat_of(const Tensor& xn, const Tensor& stats, const int64_t* rows, int64_t n,
               const int64_t* cols, int64_t c, ScalarType cdt) {
  const int64_t d = xn.size(-1);
  Tensor out = at::empty({n, c}, xn.options().dtype(cdt));
  if (n == 0 || c == 0) return out;
  const Tensor xc = xn.contiguous();
  const double* st = stats.const_data_ptr<double>();
  parallel(0, n, grain(c), [&](int64_t i0, int64_t i1) {
    xhat_rows(xc.const_data_ptr(), xc.scalar_type(), st, rows, i0, i1, cols, c, d, out);
  });
  return out;
}

using Tensors8 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Tensors8 fwd_y_cpu(const Tensor& x, const OptTensor& residual, const OptTensor& weight,
                   const OptTensor& bias, double eps, bool centred, bool zero_centered_gamma,
                   std::optional<ScalarType> h_dtype) {
  const int64_t d = row_length(x), m = x.numel() / d;
  const bool add = residual.has_value();
  const ScalarType ndt = add ? h_dtype.value_or(x.scalar_type()) : x.scalar_type();  // xn's
  const ScalarType cdt = compute(ndt);
  auto [keep, shifted] =
      keep_of(weight, bias, zero_centered_gamma, cdt, x.scalar_type(), d, x.options());
  const int64_t k = keep.numel();
  const int64_t* cols = keep.const_data_ptr<int64_t>();
  // the kept channels' xhat taken by each task from the rows it has just normalized, while
  // they are in cache
  Tensor kept = at::empty({m, k}, x.options().dtype(cdt));
  RowsHook gather;
  if (k > 0) {
    gather = [&](const engine::Forward& a, int64_t i0, int64_t i1) {
      xhat_rows(add ? a.h : a.x, ndt, a.stats, nullptr, i0, i1, cols, k, d, kept);
    };
  }
  auto [y, h, stats] = forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                               h_dtype, true, gather);
  Tensor rows = shifted ? rows_of(stats, eps, x.options())
                        : at::empty({0}, x.options().dtype(at::kLong));
  Tensor xrows = xhat_of(add ? h : x, stats, rows.const_data_ptr<int64_t>(), rows.numel(),
                         nullptr, d, cdt);
  return {y, h, stats, at::empty({m, 0}, x.options().dtype(at::kLong)), keep, kept, rows, xrows};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_y_cpu(
    const Tensor& dy, const OptTensor& dh, const Tensor& y, const OptTensor& weight,
    const OptTensor& bias, const Tensor& stats0, const Tensor& stats1, const Tensor& keep,
    const Tensor& kept, const Tensor& rows, const Tensor& xrows, bool centred,
    bool zero_centered_gamma, std::optional<ScalarType> x_dtype,
    std::optional<ScalarType> residual_dtype) {
  const int64_t d = check_backward(dy, dh, y, "y", weight, bias, stats0);
  const int64_t m = y.numel() / d;
  check_cpu(keep, "keep");
  check_cpu(kept, "kept");
  TORCH_CHECK_VALUE(keep.dim() == 1 && keep.scalar_type() == ScalarType::Long,
                    "layernorm: keep must be the forward's (k,) int64 channels, got ",
                    keep.sizes(), " ", keep.scalar_type());
  const int64_t k = keep.size(0);
  const ScalarType cdt = kept.scalar_type();
  TORCH_CHECK_VALUE(kept.dim() == 2 && kept.size(0) == m && kept.size(1) == k &&
                        (cdt == ScalarType::Float || cdt == ScalarType::Double),
                    "layernorm: kept must be the forward's (M, k) = (", m, ", ", k,
                    ") float32 or float64 xhat, got ", kept.sizes(), " ", cdt);
  check_cpu(rows, "rows");
  check_cpu(xrows, "xrows");
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.scalar_type() == ScalarType::Long,
                    "layernorm: rows must be the forward's (r,) int64 rows, got ", rows.sizes(),
                    " ", rows.scalar_type());
  const int64_t r = rows.size(0);
  TORCH_CHECK_VALUE(xrows.dim() == 2 && xrows.size(0) == r && xrows.size(1) == d &&
                        xrows.scalar_type() == cdt,
                    "layernorm: xrows must be the forward's (r, D) = (", r, ", ", d, ") ", cdt,
                    " xhat (kept's dtype), got ", xrows.sizes(), " ", xrows.scalar_type());
  // the kernel indexes the rows of y by these: none may fall outside them
  const Tensor keepc = keep.contiguous();
  check_ascending(keepc, d, "keep", "channels");
  const Tensor rowsc = rows.contiguous();
  check_ascending(rowsc, m, "rows", "rows");
  const Tensor yc = y.contiguous();
  const Tensor stats = stats0.contiguous();
  const Tensor keptc = kept.contiguous();
  const Tensor xrowsc = xrows.contiguous();
  const void* scale = param_row(weight, d, cdt, zero_centered_gamma, 1.0, 0);
  // the kernel reads the shift in T, as the scale (a half bias is widened here)
  const void* shift = param_row(bias, d, cdt, false, 0.0, 1);
  const engine::Recovery recovery{shift,
                                  k > 0 ? keepc.const_data_ptr<int64_t>() : nullptr,
                                  k > 0 ? keptc.const_data_ptr() : nullptr,
                                  k,
                                  r > 0 ? rowsc.const_data_ptr<int64_t>() : nullptr,
                                  r > 0 ? xrowsc.const_data_ptr() : nullptr,
                                  r};
  return run_backward(yc, d, dy, dh, scale, stats, weight, bias, centred, cdt,
                      x_dtype.value_or(y.scalar_type()), residual_dtype, &recovery);
}

}  // namespace

void register_cpu(torch::Library& m) {
  m.impl("fwd", fwd_cpu);
  m.impl("bwd", bwd_cpu);
  m.impl("norm", norm_cpu);
  m.impl("norm_quant", norm_quant_cpu);
  m.impl("add_norm_quant", add_norm_quant_cpu);
  m.impl("fwd_y", fwd_y_cpu);
  m.impl("bwd_y", bwd_y_cpu);
}

}  // namespace layernorm::op
