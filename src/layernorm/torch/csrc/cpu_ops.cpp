// The CPU kernels of the ops layernorm::fwd, layernorm::bwd and layernorm::norm, and of the
// memory-efficient pair layernorm::fwd_y and layernorm::bwd_y.
//
// The arithmetic is the CPU engine's (engine.h: forward.cpp, backward.cpp). This file checks,
// allocates, converts the parameters to the compute dtype, and splits rows over torch's own
// threads with at::parallel_for: a call costs about what one of torch's own operators does,
// follows torch.set_num_threads, runs small work on the calling thread, and survives fork as
// torch's operators do. Python sets the output pool's cap and the recovery's margin (_setup).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <limits>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.h"

namespace {

namespace engine = layernorm::engine;

using at::ScalarType;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Work below this many elements runs on the calling thread: torch's threads wake in a few
// microseconds, a row of 4096 float32 is about half a microsecond of arithmetic (eight such
// rows took 8.5 us on 2 threads against 9.8 us on one).
constexpr int64_t kSerialElements = int64_t(1) << 14;

// The recovery rule's margin (layernorm.recovery.MARGIN), set by _setup.
double g_margin = 4.0;

// Where the kernels compute: float64 for float64, else float32.
ScalarType compute(ScalarType t) {
  return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

ScalarType widest(ScalarType a, ScalarType b, ScalarType c) {
  return compute(a) == ScalarType::Double || compute(b) == ScalarType::Double ||
                 compute(c) == ScalarType::Double
             ? ScalarType::Double
             : ScalarType::Float;
}

// (D,) the backward's scale in the compute dtype, read only: the weight itself where it already
// is one, else a new tensor (plus one when zero-centred; ones without a weight).
Tensor scale_of(const OptTensor& p, int64_t d, ScalarType cdt, bool plus_one) {
  if (!p.has_value()) return at::ones({d}, at::dtype(cdt));
  if (p->scalar_type() == cdt && !plus_one && p->is_contiguous()) return *p;
  Tensor s = p->to(cdt, /*non_blocking=*/false, /*copy=*/true).contiguous();
  return plus_one ? s.add_(1) : s;
}

// (D,) the shift in the compute dtype: the bias itself where it already is one, else a new
// tensor (zeros without a bias).
Tensor shift_of(const OptTensor& p, int64_t d, ScalarType cdt) {
  if (!p.has_value()) return at::zeros({d}, at::dtype(cdt));
  if (p->scalar_type() == cdt && p->is_contiguous()) return *p;
  return p->to(cdt, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

// (D,) a parameter in the compute dtype for one call on this thread: its own memory where it
// already is one (contiguous, no plus one), else a conversion into a buffer of this thread's
// (slot 0 or 1: two parameters a call), `fill` where absent, plus one where zero-centred. No
// allocation after a thread's first calls, and nothing kept between calls: a decode step's
// call costs the conversion of D elements, and a parameter changed in any way (through
// .data included) is read anew.
const void* param_row(const OptTensor& p, int64_t d, ScalarType cdt, bool plus_one,
                      double fill, int slot) {
  if (p.has_value() && p->scalar_type() == cdt && !plus_one && p->is_contiguous()) {
    return p->const_data_ptr();
  }
  thread_local std::vector<double> buffers[2];
  std::vector<double>& buf = buffers[slot];
  buf.resize(static_cast<size_t>(d));
  auto fill_as = [&](auto zero) {
    using T = decltype(zero);
    T* out = reinterpret_cast<T*>(buf.data());
    if (!p.has_value()) {
      std::fill(out, out + d, static_cast<T>(fill));
      return;
    }
    const Tensor pc = p->contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pc.scalar_type(), "param", [&] {
      const scalar_t* in = pc.const_data_ptr<scalar_t>();
      for (int64_t j = 0; j < d; ++j) out[j] = static_cast<T>(static_cast<double>(in[j]));
      if (plus_one) {
        for (int64_t j = 0; j < d; ++j) out[j] = out[j] + T(1);
      }
    });
  };
  if (cdt == ScalarType::Double) {
    fill_as(0.0);
  } else {
    fill_as(0.0f);
  }
  return buf.data();
}

engine::Dtype dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return engine::Dtype::f32;
    case ScalarType::Double: return engine::Dtype::f64;
    case ScalarType::Half: return engine::Dtype::f16;
    case ScalarType::BFloat16: return engine::Dtype::bf16;
    default: TORCH_CHECK_TYPE(false, "layernorm: no CPU kernel for dtype ", t);
  }
}

Tensor in_dtype(const Tensor& t, ScalarType cdt) {
  return compute(t.scalar_type()) == cdt ? t.contiguous() : t.to(cdt).contiguous();
}

// --- outputs -----------------------------------------------------------------------------
// A fresh large output costs its first touch: the kernel faults in and zeroes every page
// (64 MB of float32 took 18 ms to fill where a copy into touched memory took 1.7 ms). So
// large outputs come from a pool of blocks that earlier outputs' owners have freed: a block
// returns to the pool only when the last tensor on it is gone, and the pool keeps at most
// g_pool_cap bytes (the rest is freed at once). New blocks are 2 MiB aligned and advised to
// use huge pages, so even their first touch faults 512 times less often.

constexpr size_t kPoolMin = size_t(1) << 20;  // smaller outputs: torch's allocator
constexpr size_t kHuge = size_t(2) << 20;
std::mutex g_pool_mutex;
std::unordered_multimap<size_t, void*> g_pool;  // free blocks by size
size_t g_pool_bytes = 0;
size_t g_pool_cap = 0;  // set by _setup

void give_back(void* p, size_t n) {
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (g_pool_bytes + n <= g_pool_cap) {
      g_pool.emplace(n, p);
      g_pool_bytes += n;
      return;
    }
  }
  std::free(p);
}

void* take(size_t n) {
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    auto it = g_pool.find(n);
    if (it != g_pool.end()) {
      void* p = it->second;
      g_pool.erase(it);
      g_pool_bytes -= n;
      return p;
    }
  }
  void* p = std::aligned_alloc(kHuge, n);
  TORCH_CHECK(p != nullptr, "layernorm: out of memory allocating ", n, " bytes");
  madvise(p, n, MADV_HUGEPAGE);  // a hint: ignored where huge pages are off
  return p;
}

// An output of `sizes`: from the pool when large, else torch's allocator.
Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t nbytes = c10::multiply_integers(sizes) * c10::elementSize(
      c10::typeMetaToScalarType(options.dtype()));
  if (nbytes < kPoolMin || g_pool_cap == 0) return at::empty(sizes, options);
  const size_t n = (nbytes + kHuge - 1) / kHuge * kHuge;
  return at::from_blob(take(n), sizes, [n](void* p) { give_back(p, n); }, options);
}

void setup(int64_t pool_bytes, double margin) {
  g_margin = margin;
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool_cap = static_cast<size_t>(std::max<int64_t>(pool_bytes, 0));
  while (g_pool_bytes > g_pool_cap) {  // a smaller cap frees what no longer fits
    auto it = g_pool.begin();
    g_pool_bytes -= it->first;
    std::free(it->second);
    g_pool.erase(it);
  }
}

// Bytes the output pool holds now.
int64_t pool_bytes() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  return static_cast<int64_t>(g_pool_bytes);
}

// A mutex held by another thread at fork stays held in the child: the child starts afresh.
void reset_after_fork() {
  new (&g_pool_mutex) std::mutex();
}
const int g_atfork = pthread_atfork(nullptr, nullptr, reset_after_fork);

// The ops are called by layernorm.torch's functions, which check the caller's arguments; a
// direct call of an op gets these checks, so that no shape reads or writes out of bounds.
void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "layernorm: ", name, " must be a CPU tensor");
}

void check_param(const OptTensor& p, int64_t d, const char* name) {
  if (!p.has_value()) return;
  check_cpu(*p, name);
  TORCH_CHECK_VALUE(p->numel() == d, "layernorm: ", name, " must have D = ", d,
                    " elements, got shape ", p->sizes());
}

void check_like(const Tensor& t, const Tensor& like, const char* name, const char* like_name) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), "layernorm: ", name, " must have ", like_name,
                    "'s shape ", like.sizes(), ", got ", t.sizes());
}

// Rows per task: a task with fewer than serial_elements elements is not worth waking a
// thread for.
int64_t grain(int64_t d, int64_t serial_elements = kSerialElements) {
  return std::max<int64_t>(1, (serial_elements + d - 1) / std::max<int64_t>(d, 1));
}

// The engine's forward of `a` over torch's threads.
void run_forward(const engine::Forward& a, int64_t serial_elements) {
  if (a.m == 0) return;
  at::parallel_for(0, a.m, grain(a.d, serial_elements),
                   [&](int64_t i0, int64_t i1) { engine::forward_rows(a, i0, i1); });
}

// The engine's backward of `a` over its row chunks on torch's threads (one chunk a task; all on
// the calling thread when the call has fewer than serial_elements elements), the chunks'
// partials then added in chunk order into sums (2, D) float64: dgamma, dbeta.
void run_chunks(engine::Backward a, const Tensor& sums, int64_t serial_elements) {
  const int64_t c = engine::n_chunks(a.m);
  double* out = sums.mutable_data_ptr<double>();
  if (a.m == 0) {
    std::fill(out, out + 2 * a.d, 0.0);
    return;
  }
  Tensor partial = at::empty({c, 2, a.d}, at::dtype(at::kDouble));
  a.partial = partial.mutable_data_ptr<double>();
  std::atomic<bool> ran{true};
  at::parallel_for(0, c, a.m * a.d < serial_elements ? c : 1, [&](int64_t c0, int64_t c1) {
    if (!engine::backward_chunks(a, c0, c1)) ran = false;
  });
  TORCH_CHECK(ran, "layernorm: no CPU kernel for these dtypes: dy must compute in scale's dtype, "
              "and in the default mode the rows too");
  engine::reduce_chunks(a.partial, out, c, a.d);
}

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

// x (..., D), normalized over its last axis as M = numel / D rows: y and h of x's shape (h
// an empty (0,) without residual) and stats ((M, NSTATS) float64, or (0, NSTATS) when the
// caller keeps none).
std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& x, const OptTensor& residual,
                                           const OptTensor& weight, const OptTensor& bias,
                                           double eps, bool centred, bool zero_centered_gamma,
                                           std::optional<ScalarType> h_dtype, bool keep) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "layernorm: x must be (..., D) with D >= 1, got ",
              x.sizes());
  const int64_t d = x.size(-1), m = x.numel() / d;
  const bool add = residual.has_value();
  check_cpu(x, "x");
  if (add) check_like(*residual, x, "residual", "x");
  check_param(weight, d, "weight");
  check_param(bias, d, "bias");
  const ScalarType xdt = x.scalar_type(), hdt = h_dtype.value_or(xdt);
  const ScalarType cdt = compute(add ? hdt : xdt);
  const Tensor xc = x.contiguous();
  Tensor y = output(x.sizes(), x.options());
  Tensor rc, h;
  if (add) {
    rc = residual->contiguous();
    h = output(x.sizes(), x.options().dtype(hdt));
  } else {
    h = at::empty({0}, x.options());
  }
  Tensor stats = at::empty({keep ? m : 0, engine::kStats}, x.options().dtype(at::kDouble));
  if (m == 0) return {y, h, stats};
  // the parameters in the compute dtype, once a call (no copy where they already are)
  // the parameters in the compute dtype for this call (no copy where they already are)
  const void* scale = param_row(weight, d, cdt, zero_centered_gamma, 1.0, 0);
  const void* shift = param_row(bias, d, cdt, false, 0.0, 1);
  const engine::Forward a{xc.const_data_ptr(),
                          add ? rc.const_data_ptr() : nullptr,
                          add ? h.mutable_data_ptr() : nullptr,
                          y.mutable_data_ptr(),
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
  run_forward(a, kSerialElements);
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

// The two backwards after their own checks: dx (and dresidual, when residual_dtype is given)
// allocated, dy and dh in their compute dtypes, the engine's backward over the row chunks on
// torch's threads (src is xn, or y with `recovery`), the partials reduced in chunk order, and
// dweight, dbias in the parameters' dtypes. d: the row length (check_backward's).
std::tuple<Tensor, Tensor, Tensor, Tensor> run_backward(
    const Tensor& src, int64_t d, const Tensor& dy, const OptTensor& dh, const Tensor& scale,
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
                           scale.const_data_ptr(),
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
  const Tensor scale = scale_of(weight, d, cdt, zero_centered_gamma);
  return run_backward(xn, d, dy, dh, scale, stats0.contiguous(), weight, bias, centred, cdt,
                      x_dtype.value_or(ndt), residual_dtype, nullptr);
}

// --- the memory-efficient pair -----------------------------------------------------------
// fwd_y: the forward, then keep, kept, rows and xrows. keep (k,) int64 is layernorm.recovery's
// rule on the scale and shift as the kernel formed them in T (weight, or 1 + weight, ones
// without it; bias, zeros without it), compared in float64 against y's dtype's smallest normal
// (tiny) and largest numbers:
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
  const double margin = g_margin;
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
    const Tensor s = weight.has_value() ? scale_of(weight, d, cdt, zero_centered_gamma)
                                        : Tensor();
    const Tensor b = bias.has_value() ? bias->to(cdt).contiguous() : Tensor();
    auto scan = [&](auto zero) {
      using T = decltype(zero);
      const T* sp = s.defined() ? s.const_data_ptr<T>() : nullptr;
      const T* bp = b.defined() ? b.const_data_ptr<T>() : nullptr;
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

// (n, c) in cdt: xhat of the rows `rows` (n of them, or every row where null) and the channels
// `cols` (c of them, or every channel where null) of xn (M, D), from the statistics, in float64
// rounded once to cdt. kept is (M, k) of the channels keep, xrows (r, D) of the rows kept whole.
Tensor xhat_of(const Tensor& xn, const Tensor& stats, const int64_t* rows, int64_t n,
               const int64_t* cols, int64_t c, ScalarType cdt) {
  const int64_t d = xn.size(-1);
  Tensor out = at::empty({n, c}, xn.options().dtype(cdt));
  if (n == 0 || c == 0) return out;
  const Tensor xc = xn.contiguous();
  const double* st = stats.const_data_ptr<double>();
  const int64_t ns = engine::kStats;
  const int64_t chi = engine::kHi, clo = engine::kLo, cr = engine::kRstd, cs = engine::kScale;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "xhat", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    auto fill = [&](auto* op) {
      using T = std::remove_pointer_t<decltype(op)>;
      at::parallel_for(0, n, grain(c), [&](int64_t i0, int64_t i1) {
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
      });
    };
    if (cdt == ScalarType::Double) {
      fill(out.mutable_data_ptr<double>());
    } else {
      fill(out.mutable_data_ptr<float>());
    }
  });
  return out;
}

// The indices t (n,) int64 must be ascending and in [0, top): the kernel indexes rows or
// channels by them, and meets rows in order.
void check_ascending(const Tensor& t, int64_t top, const char* name, const char* what) {
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < t.numel(); ++j) {
    TORCH_CHECK_VALUE(p[j] >= 0 && p[j] < top && (j == 0 || p[j] > p[j - 1]), "layernorm: ",
                      name, " must hold ascending ", what, " in [0, ", top, "), got ", p[j],
                      " at ", j);
  }
}

using Tensors8 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Tensors8 fwd_y_cpu(const Tensor& x, const OptTensor& residual, const OptTensor& weight,
                   const OptTensor& bias, double eps, bool centred, bool zero_centered_gamma,
                   std::optional<ScalarType> h_dtype) {
  auto [y, h, stats] = forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                               h_dtype, true);
  const bool add = residual.has_value();
  const ScalarType cdt = compute(add ? h_dtype.value_or(x.scalar_type()) : x.scalar_type());
  const int64_t d = x.size(-1), m = stats.size(0);
  auto [keep, shifted] =
      keep_of(weight, bias, zero_centered_gamma, cdt, x.scalar_type(), d, x.options());
  const Tensor& xn = add ? h : x;
  Tensor kept = xhat_of(xn, stats, nullptr, m, keep.const_data_ptr<int64_t>(), keep.numel(),
                        cdt);
  Tensor rows = shifted ? rows_of(stats, eps, x.options())
                        : at::empty({0}, x.options().dtype(at::kLong));
  Tensor xrows = xhat_of(xn, stats, rows.const_data_ptr<int64_t>(), rows.numel(), nullptr, d,
                         cdt);
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
  const Tensor scale = scale_of(weight, d, cdt, zero_centered_gamma);
  // the kernel reads the shift in T, as the scale (a half bias is widened here)
  const Tensor shift = bias.has_value() ? bias->to(cdt).contiguous()
                                        : at::zeros({d}, y.options().dtype(cdt));
  const engine::Recovery recovery{shift.const_data_ptr(),
                                  k > 0 ? keepc.const_data_ptr<int64_t>() : nullptr,
                                  k > 0 ? keptc.const_data_ptr() : nullptr,
                                  k,
                                  r > 0 ? rowsc.const_data_ptr<int64_t>() : nullptr,
                                  r > 0 ? xrowsc.const_data_ptr() : nullptr,
                                  r};
  return run_backward(yc, d, dy, dh, scale, stats, weight, bias, centred, cdt,
                      x_dtype.value_or(y.scalar_type()), residual_dtype, &recovery);
}

// --- autograd ------------------------------------------------------------------------------
// The ops' autograd on CPU tensors in C++, as layernorm/torch/_ops.py has it in Python for
// CUDA (and for the CPU where this operator cannot be built): a training step's call then
// costs no Python. The forward saves what the backward reads (x, or h for an add-norm, the
// parameters and the statistics); the backward is layernorm::bwd, or, when it is itself
// differentiated (create_graph), the same formulas from ATen operations, which autograd
// differentiates (composite_backward in _ops.py).

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, double, bool, bool,
    std::optional<ScalarType>);
using BwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const OptTensor&,
    const Tensor&, const Tensor&, bool, bool, std::optional<ScalarType>,
    std::optional<ScalarType>);

OptTensor given(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The gradients of an add-norm whose y is unused (no dy): h = x + residual is all that is
// differentiated, so dx = dresidual = dh in their dtypes and the parameters get none. No kernel
// runs: a zero dy through the norm would form 0 * inf on a row whose rstd is inf (eps = 0,
// var = 0), where torch's x + r then F.layer_norm passes dh through (_h_only in _ops.py).
variable_list h_only(const Tensor& dh, ScalarType x_dtype, ScalarType r_dtype) {
  variable_list out(8);
  out[0] = dh.to(x_dtype);
  out[1] = dh.to(r_dtype);
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> composite_backward(
    const Tensor& dy, const Tensor& dh, const Tensor& xn, const Tensor& weight,
    const Tensor& bias, double eps, bool centred, bool zero_centered_gamma, ScalarType x_dtype,
    std::optional<ScalarType> residual_dtype) {
  const ScalarType cdt = compute(xn.scalar_type());
  const int64_t d = xn.size(-1);
  const Tensor x = xn.to(cdt);
  const Tensor xc = centred ? x - x.mean(-1, true) : x;
  const Tensor rstd = at::rsqrt((xc * xc).mean(-1, true) + eps);
  const Tensor xhat = xc * rstd;
  const Tensor dyc = dy.to(cdt);  // defined: without dy the backward is h_only
  Tensor g = dyc;
  if (weight.defined()) g = g * (zero_centered_gamma ? weight.to(cdt) + 1 : weight.to(cdt));
  const Tensor proj = xhat * (g * xhat).mean(-1, true);
  const Tensor dnorm = rstd * ((centred ? g - g.mean(-1, true) : g) - proj);
  Tensor dw, db;
  if (weight.defined()) dw = (dyc * xhat).reshape({-1, d}).sum(0).to(weight.scalar_type());
  if (bias.defined()) db = dyc.reshape({-1, d}).sum(0).to(bias.scalar_type());
  if (!residual_dtype.has_value()) return {dnorm.to(x_dtype), Tensor(), dw, db};
  const Tensor total = dh.defined() ? dnorm + dh.to(cdt) : dnorm;
  return {total.to(x_dtype), total.to(*residual_dtype), dw, db};
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& residual,
                               const OptTensor& weight, const OptTensor& bias, double eps,
                               bool centred, bool zero_centered_gamma,
                               std::optional<ScalarType> h_dtype) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("layernorm::fwd", "")
                         .typed<FwdSig>();
    Tensor y, h, s0, s1;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, h, s0, s1) =
          op.call(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype);
    }
    const bool add = residual.has_value();
    ctx->save_for_backward({add ? h : x, weight.value_or(Tensor()), bias.value_or(Tensor()),
                            s0, s1});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["centred"] = centred;
    ctx->saved_data["zcg"] = zero_centered_gamma;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["r_dtype"] = add ? static_cast<int64_t>(residual->scalar_type()) : -1;
    ctx->mark_non_differentiable({s0, s1});
    ctx->set_materialize_grads(false);  // an unused y or h costs nothing in the backward
    return {y, h, s0, s1};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("layernorm::bwd", "")
                         .typed<BwdSig>();
    const auto saved = ctx->get_saved_variables();
    const Tensor &xn = saved[0], &weight = saved[1], &bias = saved[2];
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool centred = ctx->saved_data["centred"].toBool();
    const bool zcg = ctx->saved_data["zcg"].toBool();
    const auto x_dtype = static_cast<ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const int64_t r = ctx->saved_data["r_dtype"].toInt();
    const std::optional<ScalarType> r_dtype =
        r < 0 ? std::nullopt : std::optional<ScalarType>(static_cast<ScalarType>(r));
    const Tensor& dy = grads[0];
    const Tensor dh = r_dtype.has_value() ? grads[1] : Tensor();
    variable_list out(8);
    if (!dy.defined() && !dh.defined()) return out;
    if (!dy.defined()) return h_only(dh, x_dtype, *r_dtype);
    Tensor dx, dres, dw, db;
    // an add-norm's dresidual equals dx where the two share a dtype: one tensor serves both,
    // as autograd's own x + residual does, so the kernel writes one gradient instead of two
    const bool shared = r_dtype.has_value() && *r_dtype == x_dtype;
    if (at::GradMode::is_enabled()) {  // the backward is being differentiated
      std::tie(dx, dres, dw, db) =
          composite_backward(dy, dh, xn, weight, bias, eps, centred, zcg, x_dtype, r_dtype);
    } else {
      std::tie(dx, dres, dw, db) =
          op.call(dy, given(dh), xn, given(weight), given(bias), saved[3], saved[4], centred,
                  zcg, x_dtype, shared ? std::nullopt : r_dtype);
      if (shared) dres = dx;
    }
    out[0] = dx;
    if (r_dtype.has_value()) out[1] = dres;
    if (weight.defined()) out[2] = dw;
    if (bias.defined()) out[3] = db;
    return out;
  }
};

// The memory-efficient forward's autograd, as _setup_context_y and _backward_y in _ops.py: it
// saves y (the output itself, watched by its version counter), the parameters, the statistics,
// keep, kept, rows and xrows, never x or h; its backward is layernorm::bwd_y, and cannot be
// differentiated.
using FwdYSig = Tensors8(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                         double, bool, bool, std::optional<ScalarType>);
using BwdYSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const OptTensor&,
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    bool, bool, std::optional<ScalarType>, std::optional<ScalarType>);

struct NormYFunction : public torch::autograd::Function<NormYFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& residual,
                               const OptTensor& weight, const OptTensor& bias, double eps,
                               bool centred, bool zero_centered_gamma,
                               std::optional<ScalarType> h_dtype) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("layernorm::fwd_y", "")
                         .typed<FwdYSig>();
    Tensor y, h, s0, s1, keep, kept, rows, xrows;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, h, s0, s1, keep, kept, rows, xrows) =
          op.call(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype);
    }
    const bool add = residual.has_value();
    ctx->save_for_backward({y, weight.value_or(Tensor()), bias.value_or(Tensor()), s0, s1, keep,
                            kept, rows, xrows});
    ctx->saved_data["centred"] = centred;
    ctx->saved_data["zcg"] = zero_centered_gamma;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["r_dtype"] = add ? static_cast<int64_t>(residual->scalar_type()) : -1;
    ctx->mark_non_differentiable({s0, s1, keep, kept, rows, xrows});
    ctx->set_materialize_grads(false);
    return {y, h, s0, s1, keep, kept, rows, xrows};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("layernorm::bwd_y", "")
                         .typed<BwdYSig>();
    const auto saved = ctx->get_saved_variables();
    const Tensor &y = saved[0], &weight = saved[1], &bias = saved[2];
    const bool centred = ctx->saved_data["centred"].toBool();
    const bool zcg = ctx->saved_data["zcg"].toBool();
    const auto x_dtype = static_cast<ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const int64_t r = ctx->saved_data["r_dtype"].toInt();
    const std::optional<ScalarType> r_dtype =
        r < 0 ? std::nullopt : std::optional<ScalarType>(static_cast<ScalarType>(r));
    const Tensor& dy = grads[0];
    const Tensor dh = r_dtype.has_value() ? grads[1] : Tensor();
    variable_list out(8);
    if (!dy.defined() && !dh.defined()) return out;
    // without dy there is no norm term: dh's derivative is exact, and differentiable
    if (!dy.defined()) return h_only(dh, x_dtype, *r_dtype);
    // the second derivative needs rstd's and the kept xhat's dependence on x, which is not kept
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "layernorm: the backward of a memory_efficient=True norm cannot be "
                "differentiated (create_graph=True, double backward): it "
                "keeps y, not the input whose statistics the second derivative "
                "differentiates; use memory_efficient=False");
    const bool shared = r_dtype.has_value() && *r_dtype == x_dtype;
    Tensor dx, dres, dw, db;
    std::tie(dx, dres, dw, db) =
        op.call(dy, given(dh), y, given(weight), given(bias), saved[3], saved[4], saved[5],
                saved[6], saved[7], saved[8], centred, zcg, x_dtype,
                shared ? std::nullopt : r_dtype);
    if (shared) dres = dx;
    out[0] = dx;
    if (r_dtype.has_value()) out[1] = dres;
    if (weight.defined()) out[2] = dw;
    if (bias.defined()) out[3] = db;
    return out;
  }
};

Tensors8 fwd_y_autograd(const Tensor& x, const OptTensor& residual, const OptTensor& weight,
                        const OptTensor& bias, double eps, bool centred,
                        bool zero_centered_gamma, std::optional<ScalarType> h_dtype) {
  auto out = NormYFunction::apply(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                                  h_dtype);
  return {out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_autograd(
    const Tensor& x, const OptTensor& residual, const OptTensor& weight,
    const OptTensor& bias, double eps, bool centred, bool zero_centered_gamma,
    std::optional<ScalarType> h_dtype) {
  auto out = NormFunction::apply(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                                 h_dtype);
  return {out[0], out[1], out[2], out[3]};
}

// --- the NumPy API's entry points ----------------------------------------------------------
// layernorm.cpu hands its arrays over as tensors (torch.from_numpy: no copy) and gets the
// engine's results written into them, on torch's threads: the same kernels and split as the
// ops above. serial_elements: calls with fewer elements run on the calling thread.

void check_rows(const Tensor& t, int64_t m, int64_t d, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == m && t.size(1) == d && t.is_contiguous(),
                    "layernorm: ", name, " must be a C-contiguous (", m, ", ", d,
                    ") tensor, got ", t.sizes());
}

void check_vector(const Tensor& t, int64_t n, ScalarType dtype, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.is_contiguous() &&
                        t.scalar_type() == dtype,
                    "layernorm: ", name, " must be a C-contiguous (", n, ",) ", dtype,
                    " tensor, got ", t.sizes(), " ", t.scalar_type());
}

void check_stats(const Tensor& t, int64_t m, const char* name) {
  check_rows(t, m, engine::kStats, name);
  TORCH_CHECK_VALUE(t.scalar_type() == ScalarType::Double, "layernorm: ", name,
                    " must be float64, got ", t.scalar_type());
}

void forward_into(const Tensor& x, const OptTensor& residual, const Tensor& scale,
                  const Tensor& shift, double eps, bool centred, const Tensor& y,
                  const OptTensor& h, const OptTensor& stats, const OptTensor& checksum,
                  int64_t serial_elements) {
  TORCH_CHECK_VALUE(x.dim() == 2, "layernorm: x must be (M, D), got ", x.sizes());
  const int64_t m = x.size(0), d = x.size(1);
  const bool add = residual.has_value();
  TORCH_CHECK_VALUE(add == h.has_value(), "layernorm: residual and h go together");
  check_rows(x, m, d, "x");
  check_rows(y, m, d, "y");
  TORCH_CHECK_VALUE(y.scalar_type() == x.scalar_type(), "layernorm: y must have x's dtype");
  if (add) {
    check_rows(*residual, m, d, "residual");
    check_rows(*h, m, d, "h");
  }
  const ScalarType cdt = compute(add ? h->scalar_type() : x.scalar_type());
  check_vector(scale, d, cdt, "scale");
  check_vector(shift, d, cdt, "shift");
  if (stats.has_value()) check_stats(*stats, m, "stats");
  if (checksum.has_value()) check_vector(*checksum, m, ScalarType::UInt64, "checksum");
  const engine::Forward a{x.const_data_ptr(),
                          add ? residual->const_data_ptr() : nullptr,
                          add ? h->mutable_data_ptr() : nullptr,
                          y.mutable_data_ptr(),
                          scale.const_data_ptr(),
                          shift.const_data_ptr(),
                          eps,
                          centred,
                          stats.has_value() ? stats->mutable_data_ptr<double>() : nullptr,
                          checksum.has_value()
                              ? static_cast<uint64_t*>(checksum->mutable_data_ptr())
                              : nullptr,
                          m,
                          d,
                          dtype_of(x.scalar_type()),
                          add ? dtype_of(residual->scalar_type()) : engine::Dtype::none,
                          add ? dtype_of(h->scalar_type()) : engine::Dtype::none};
  run_forward(a, serial_elements);
}

void backward_into(const Tensor& src, const Tensor& dy, const OptTensor& dh, const Tensor& scale,
                   const Tensor& stats, const OptTensor& checksum, const OptTensor& shift,
                   const OptTensor& keep, const OptTensor& kept, const OptTensor& rows,
                   const OptTensor& xrows, bool centred, const Tensor& dx,
                   const OptTensor& dres, const Tensor& sums, const OptTensor& ok,
                   int64_t serial_elements) {
  TORCH_CHECK_VALUE(src.dim() == 2, "layernorm: src must be (M, D), got ", src.sizes());
  const int64_t m = src.size(0), d = src.size(1);
  check_rows(src, m, d, "src");
  check_rows(dy, m, d, "dy");
  check_rows(dx, m, d, "dx");
  if (dh.has_value()) check_rows(*dh, m, d, "dh");
  if (dres.has_value()) check_rows(*dres, m, d, "dres");
  const ScalarType cdt = scale.scalar_type();
  TORCH_CHECK_VALUE(cdt == ScalarType::Float || cdt == ScalarType::Double,
                    "layernorm: scale must be float32 or float64, got ", cdt);
  check_vector(scale, d, cdt, "scale");
  check_stats(stats, m, "stats");
  check_rows(sums, 2, d, "sums");
  TORCH_CHECK_VALUE(sums.scalar_type() == ScalarType::Double, "layernorm: sums must be float64");
  TORCH_CHECK_VALUE(checksum.has_value() == ok.has_value(),
                    "layernorm: checksum and ok go together");
  if (checksum.has_value()) {
    check_vector(*checksum, m, ScalarType::UInt64, "checksum");
    check_vector(*ok, m, ScalarType::Bool, "ok");
  }
  std::optional<engine::Recovery> recovery;
  if (shift.has_value()) {
    TORCH_CHECK_VALUE(keep.has_value() && kept.has_value() && rows.has_value() &&
                          xrows.has_value() && !checksum.has_value(),
                      "layernorm: the backward from y takes shift, keep, kept, rows and xrows, "
                      "and no checksum");
    check_vector(*shift, d, cdt, "shift");
    const int64_t k = keep->numel(), r = rows->numel();
    check_vector(*keep, k, ScalarType::Long, "keep");
    check_ascending(*keep, d, "keep", "channels");
    check_rows(*kept, m, k, "kept");
    check_vector(*rows, r, ScalarType::Long, "rows");
    check_ascending(*rows, m, "rows", "rows");
    check_rows(*xrows, r, d, "xrows");
    TORCH_CHECK_VALUE(kept->scalar_type() == cdt && xrows->scalar_type() == cdt,
                      "layernorm: kept and xrows must have scale's dtype");
    recovery = engine::Recovery{shift->const_data_ptr(),
                                k > 0 ? keep->const_data_ptr<int64_t>() : nullptr,
                                k > 0 ? kept->const_data_ptr() : nullptr,
                                k,
                                r > 0 ? rows->const_data_ptr<int64_t>() : nullptr,
                                r > 0 ? xrows->const_data_ptr() : nullptr,
                                r};
  }
  const engine::Backward a{src.const_data_ptr(),
                           dy.const_data_ptr(),
                           dh.has_value() ? dh->const_data_ptr() : nullptr,
                           dx.mutable_data_ptr(),
                           dres.has_value() ? dres->mutable_data_ptr() : nullptr,
                           scale.const_data_ptr(),
                           stats.const_data_ptr<double>(),
                           checksum.has_value()
                               ? static_cast<const uint64_t*>(checksum->const_data_ptr())
                               : nullptr,
                           ok.has_value() ? ok->mutable_data_ptr<bool>() : nullptr,
                           nullptr,
                           recovery ? &*recovery : nullptr,
                           centred,
                           m,
                           d,
                           dtype_of(src.scalar_type()),
                           dtype_of(dy.scalar_type()),
                           dh.has_value() ? dtype_of(dh->scalar_type()) : engine::Dtype::none,
                           dtype_of(dx.scalar_type()),
                           dres.has_value() ? dtype_of(dres->scalar_type()) : engine::Dtype::none,
                           dtype_of(cdt)};
  run_chunks(a, sums, serial_elements);
}

// dst = src (C-contiguous, one shape and dtype) over torch's threads, in blocks of
// engine::kCopyBlock items: the bandwidth yardstick of layernorm.bench.
void copy_into(const Tensor& src, const Tensor& dst) {
  check_cpu(src, "src");
  check_cpu(dst, "dst");
  TORCH_CHECK_VALUE(src.sizes() == dst.sizes() && src.scalar_type() == dst.scalar_type(),
                    "layernorm: src and dst must match: ", src.sizes(), " ", src.scalar_type(),
                    " vs ", dst.sizes(), " ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(),
                    "layernorm: src and dst must be C-contiguous");
  const int64_t n = src.numel(), blocks = (n + engine::kCopyBlock - 1) / engine::kCopyBlock;
  const void* sp = src.const_data_ptr();
  void* dp = dst.mutable_data_ptr();
  const int64_t itemsize = src.element_size();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    engine::copy_blocks(sp, dp, n, itemsize, b0, b1);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(layernorm_cpu, m) {
  m.def("copy_into(Tensor src, Tensor(a!) dst) -> ()", copy_into);
  m.def("forward_into(Tensor x, Tensor? residual, Tensor scale, Tensor shift, float eps, "
        "bool centred, Tensor(a!) y, Tensor(b!)? h, Tensor(c!)? stats, Tensor(d!)? checksum, "
        "int serial_elements) -> ()",
        forward_into);
  m.def("backward_into(Tensor src, Tensor dy, Tensor? dh, Tensor scale, Tensor stats, "
        "Tensor? checksum, Tensor? shift, Tensor? keep, Tensor? kept, Tensor? rows, "
        "Tensor? xrows, bool centred, Tensor(a!) dx, Tensor(b!)? dres, Tensor(c!) sums, "
        "Tensor(d!)? ok, int serial_elements) -> ()",
        backward_into);
  m.def("_setup(int pool_bytes, float margin) -> ()", setup);
  m.def("_pool_bytes() -> int", pool_bytes);
  m.def("_n_chunks(int m) -> int", engine::n_chunks);
}

TORCH_LIBRARY_IMPL(layernorm, CPU, m) {
  m.impl("fwd", fwd_cpu);
  m.impl("bwd", bwd_cpu);
  m.impl("norm", norm_cpu);
  m.impl("fwd_y", fwd_y_cpu);
  m.impl("bwd_y", bwd_y_cpu);
}

TORCH_LIBRARY_IMPL(layernorm, AutogradCPU, m) {
  m.impl("fwd", fwd_autograd);
  m.impl("fwd_y", fwd_y_autograd);
}
