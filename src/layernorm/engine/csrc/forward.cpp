// The engine's forward (docs/cpu-kernels.md, "The sweeps"), for one row of length D with T the
// compute dtype and scale, shift the parameters in T:
//
//   [add]  h_j = x_j + r_j in the widest compute dtype of the three, rounded once to h; the
//          row below is h
//   A  m0 = T(mean of the row's first kSamples elements)                    (LayerNorm only)
//   B  s1 = sum_j (x_j - m0), s2 = sum_j (x_j - m0)^2, c = s1 / D
//      if c^2 > kRecentre (s2 / D - c^2): m0 = T(m0 + c), B again
//      hi + lo = m0 + c (two T numbers), var = s2 / D - c^2, rstd = 1 / sqrt(var + eps)
//      RMSNorm: s2 = sum_j x_j^2 (in double for float32 rows), var = s2 / D, hi = lo = 0
//   C  y_j = fma(fma(x_j - hi, rstd, -lo rstd), scale_j, shift_j)   (RMSNorm: x_j rstd scale_j)
//
// Rows whose T sums overflow or hold inf or NaN are normalized as xs = x 2^-e in double, with
// eps 4^-e (a power-of-two scaling is exact and leaves xhat unchanged); a constant LayerNorm
// row is caught first (xhat = 0, rstd = 1/sqrt(eps)).

#include <algorithm>
#include <cmath>
#include <vector>

#include "element.h"
#include "engine.h"
#include "quantize.h"

namespace layernorm::engine::LAYERNORM_ISA {
namespace {

// dst[j0:j1] = src[j0:j1] by an element loop (never turned into a call of memcpy, whose large
// copies may bypass the cache).
template <typename U>
__attribute__((optimize("no-tree-loop-distribute-patterns"))) void copy_items(
    const U* __restrict src, U* __restrict dst, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) dst[j] = src[j];
}

template <typename S>
void prefetch_span(const S* row, int64_t d, int64_t j0, int64_t j1) {
  constexpr int64_t step = std::max<int64_t>(1, kLineBytes / static_cast<int64_t>(sizeof(S)));
  for (int64_t k = j0; k < std::min(j1, d); k += step) __builtin_prefetch(row + k, 0, 2);
}

// T(mean of the row's first kSamples elements): a first guess at the mean that costs no sweep.
template <typename S, typename T = compute_t<S>>
T sample_mean(const S* row, int64_t d) {
  const int64_t n = std::min(kSamples, d);
  double s = 0.0;
  for (int64_t k = 0; k < n; ++k) s += static_cast<double>(load(row[k]));
  return static_cast<T>(s / static_cast<double>(n));
}

struct Sums {
  double s1 = 0.0, s2 = 0.0;
  uint64_t checksum = 0;
};

// (sum_j d_j, sum_j d_j^2) with d = row - m0 in T, blocks of kBlock joined in double; with
// kHash, the row's checksum from the same loads (integers beside the sums: the sums have the
// same bits with it or without).
template <bool kHash, typename S, typename T = compute_t<S>>
Sums sum_centred(const S* row, int64_t d, T m0) {
  constexpr int L = kLanes<T>;
  Sums out;
  for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
    const int64_t n = std::min(kBlock, d - j0);
    const S* blk = row + j0;
    Lanes<T> a1, a2;
    BlockHash hash(word_of<S>(j0));
    int64_t j = 0;
    for (; j + L <= n; j += L) {
      for (int k = 0; k < kGroups<T>; ++k) {
        const wide_t<T> v = load_wide<T>(blk + j + k * kWidth<T>) - m0;
        a1.g[k] += v;
        a2.g[k] += v * v;
      }
      if constexpr (kHash) {
        for (int q = 0; q < kHashVectors<S, L>; ++q) {
          hash.add(reinterpret_cast<const char*>(blk + j) + q * kVectorBytes);
        }
      }
    }
    if constexpr (kHash) out.checksum += hash.finish(blk + j, (n - j) * sizeof(S));
    T t1[L], t2[L];
    int r = 0;
    for (; j < n; ++j, ++r) {
      t1[r] = static_cast<T>(load(blk[j])) - m0;
      t2[r] = t1[r] * t1[r];
    }
    out.s1 += static_cast<double>(a1.fold(t1, r));
    out.s2 += static_cast<double>(a2.fold(t2, r));
  }
  return out;
}

// sum_j row_j^2 in s2: in double for float32 rows (each square exact there, so the sum keeps
// y within its own roundings on rows of one magnitude, docs/numerics.md), in T joined in
// double for the others.
template <bool kHash, typename S, typename T = compute_t<S>>
Sums sum_squares(const S* row, int64_t d) {
  using W = std::conditional_t<std::is_same_v<S, float>, double, T>;
  constexpr int L = kLanes<W>;
  Sums out;
  for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
    const int64_t n = std::min(kBlock, d - j0);
    const S* blk = row + j0;
    Lanes<W> a;
    BlockHash hash(word_of<S>(j0));
    int64_t j = 0;
    for (; j + L <= n; j += L) {
      for (int k = 0; k < kGroups<W>; ++k) {
        const wide_t<W> v = load_wide<W>(blk + j + k * kWidth<W>);
        a.g[k] += v * v;
      }
      if constexpr (kHash) {
        for (int q = 0; q < kHashVectors<S, L>; ++q) {
          hash.add(reinterpret_cast<const char*>(blk + j) + q * kVectorBytes);
        }
      }
    }
    if constexpr (kHash) out.checksum += hash.finish(blk + j, (n - j) * sizeof(S));
    W t[L];
    int r = 0;
    for (; j < n; ++j, ++r) {
      const W v = static_cast<W>(load(blk[j]));
      t[r] = v * v;
    }
    out.s2 += static_cast<double>(a.fold(t, r));
  }
  return out;
}

template <typename T>
struct RowStats {
  T hi, lo;
  double rstd;
  bool finite;
  uint64_t checksum;
};

// (hi, lo): two T numbers with hi + lo = m0 + c to about u_T^2, m0 + c formed exactly as
// s + err (two-sum) first: for double T one double would lose c, below an ulp of m0.
template <typename T>
std::pair<T, T> split_mean(double m0, double c) {
  const double s = m0 + c;
  const double bb = s - m0;
  const double err = (m0 - (s - bb)) + (c - bb);
  const T hi = static_cast<T>(s);
  return {hi, static_cast<T>((s - static_cast<double>(hi)) + err)};
}

// One row's statistics, the first pass skipped where a sample of the row stands in for it.
// IEEE division: eps = 0 on a constant row gives rstd = inf.
template <typename S, typename T = compute_t<S>>
RowStats<T> row_stats(const S* row, int64_t d, double eps, bool centred, bool with_checksum) {
  const double n = static_cast<double>(d);
  if (!centred) {
    const Sums s = with_checksum ? sum_squares<true>(row, d) : sum_squares<false>(row, d);
    const double ms = s.s2 / n;
    return {T(0), T(0), 1.0 / std::sqrt(ms + eps),
            std::isfinite(static_cast<double>(static_cast<T>(ms))), s.checksum};
  }
  T m0 = sample_mean(row, d);
  Sums s = with_checksum ? sum_centred<true>(row, d, m0) : sum_centred<false>(row, d, m0);
  double c = s.s1 / n;
  double var = s.s2 / n - c * c;
  if (c * c > var * kRecentre) {  // the sample missed the mean: centre on the mean just found
    m0 = static_cast<T>(static_cast<double>(m0) + c);
    const uint64_t checksum = s.checksum;  // of the same bits: taken once
    s = sum_centred<false>(row, d, m0);
    s.checksum = checksum;
    c = s.s1 / n;
    var = s.s2 / n - c * c;
  }
  var = var < 0.0 ? 0.0 : var;  // a variance: rounding must not take it below 0 (NaN stays)
  const auto [hi, lo] = split_mean<T>(static_cast<double>(m0), c);
  return {hi, lo, 1.0 / std::sqrt(var + eps),
          std::isfinite(static_cast<double>(m0) + c) && std::isfinite(var), s.checksum};
}

// y = fma(fma(x - hi, rc, -lo rc), scale, shift) (RMSNorm: (x rc) scale), in V (T, or double
// on a scaled row), rounded once to Y; prefetches the next row `next` where rows are long.
template <typename V, typename S, typename Y, typename T, typename N>
void write_y(const S* row, int64_t d, V hi, V lo, V rc, const T* scale, const T* shift, Y* y,
             const N* next, bool centred) {
  const V nlr = -lo * rc;
  const bool fetch = d * static_cast<int64_t>(sizeof(N)) >= kPrefetchRowBytes;
  for (int64_t j0 = 0; j0 < d; j0 += kSpan) {
    const int64_t j1 = std::min(d, j0 + kSpan);
    if (centred) {
      for (int64_t j = j0; j < j1; ++j) {
        const V t = mul_add(static_cast<V>(load(row[j])) - hi, rc, nlr);
        y[j] = store<Y>(mul_add(t, static_cast<V>(scale[j]), static_cast<V>(shift[j])));
      }
    } else {
      for (int64_t j = j0; j < j1; ++j) {
        y[j] = store<Y>((static_cast<V>(load(row[j])) * rc) * static_cast<V>(scale[j]));
      }
    }
    if (fetch) prefetch_span(next, d, j0, j1);
  }
}

// A row whose T sums overflow: st filled for x * kScale in double, the scaled row in xs (or xs
// left empty for a constant LayerNorm row, which keeps the T path and kScale = 1).
template <typename S>
void scaled_stats(const S* row, int64_t d, double eps, bool centred, double* st,
                  std::vector<double>& xs) {
  const double x0 = static_cast<double>(load(row[0]));
  double amax = 0.0;
  bool constant = centred;
  for (int64_t j = 0; j < d; ++j) {
    const double v = static_cast<double>(load(row[j]));
    amax = std::max(amax, std::abs(v));  // NaN is passed over
    constant = constant && v == x0;
  }
  xs.clear();
  if (constant && std::isfinite(x0)) {
    st[kHi] = x0, st[kLo] = 0.0, st[kRstd] = 1.0 / std::sqrt(eps), st[kScale] = 1.0;
    return;
  }
  int e = 0;
  if (std::isfinite(amax)) std::frexp(amax, &e);
  const double scale = std::ldexp(1.0, -e);
  xs.resize(d);
  for (int64_t j = 0; j < d; ++j) xs[j] = static_cast<double>(load(row[j])) * scale;
  const RowStats<double> s = row_stats(xs.data(), d, std::ldexp(eps, -2 * e), centred, false);
  st[kHi] = s.hi, st[kLo] = s.lo, st[kRstd] = s.rstd, st[kScale] = scale;
}

// y of one row; fills st (kStats,); returns the row's checksum (0 without one).
template <typename S, typename Y, typename N, typename T = compute_t<S>>
uint64_t forward_row(const S* row, int64_t d, double eps, bool centred, const T* scale,
                     const T* shift, Y* y, double* st, const N* next, bool with_checksum,
                     std::vector<double>& xs) {
  const RowStats<T> s = row_stats(row, d, eps, centred, with_checksum);
  if (s.finite) {
    st[kHi] = s.hi, st[kLo] = s.lo, st[kRstd] = s.rstd, st[kScale] = 1.0;
    write_y<T>(row, d, s.hi, s.lo, static_cast<T>(s.rstd), scale, shift, y, next, centred);
    return s.checksum;
  }
  scaled_stats(row, d, eps, centred, st, xs);
  if (xs.empty()) {  // a constant row: xhat = 0
    write_y<T>(row, d, static_cast<T>(st[kHi]), T(0), static_cast<T>(st[kRstd]), scale, shift,
               y, next, true);
  } else {  // double arithmetic on the scaled row, y rounded once
    write_y<double>(xs.data(), d, st[kHi], st[kLo], st[kRstd], scale, shift, y, next, true);
  }
  return s.checksum;
}

using AddRow = void (*)(const Forward& a, int64_t i);

// Row i of h = x + residual in A (the widest compute dtype of the three), rounded once to H.
template <typename X, typename R, typename H>
void add_row(const Forward& a, int64_t i) {
  using A = std::conditional_t<std::is_same_v<X, double> || std::is_same_v<R, double> ||
                                   std::is_same_v<H, double>,
                               double, float>;
  const X* x = static_cast<const X*>(a.x) + i * a.d;
  const R* r = static_cast<const R*>(a.residual) + i * a.d;
  H* h = static_cast<H*>(a.h) + i * a.d;
  for (int64_t j = 0; j < a.d; ++j) {
    h[j] = store<H>(static_cast<A>(load(x[j])) + static_cast<A>(load(r[j])));
  }
}

// Where rows' y goes: y itself (X, x's dtype), row by row.
template <typename X>
struct StoreY {
  using Y = X;
  X* y;
  int64_t d;
  Y* row(int64_t i) { return y + i * d; }
  void done(int64_t, const Y*) {}
};

// Where a quantized forward's rows' y goes: a buffer of the thread's in the compute dtype T,
// quantized from there while it is in cache (quantize.h).
template <typename T>
struct QuantizeY {
  using Y = T;
  const Quantize& q;
  int64_t d;
  Y* buffer;
  Y* row(int64_t) { return buffer; }
  void done(int64_t i, const Y* y) { quantize_row(q, i, y, d); }
};

// Rows [i0, i1) of a forward whose normalized rows are S (x, or h) and whose input x is X,
// each row's y written where `out` says.
template <typename S, typename X, typename Out>
void rows(const Forward& a, AddRow add, int64_t i0, int64_t i1, Out out) {
  using T = compute_t<S>;
  const T* scale = static_cast<const T*>(a.scale);
  const T* shift = static_cast<const T*>(a.shift);
  const X* x = static_cast<const X*>(a.x);
  S* h = static_cast<S*>(a.h);
  const int64_t d = a.d;
  const bool with_checksum = a.checksum != nullptr;
  // eps as the compute dtype's value, as torch and the reference add it (an eps that T rounds
  // to 0 or to inf is added as that), then in double with the row's sums
  const double eps = static_cast<double>(static_cast<T>(a.eps));
  double scratch[kStats];
  std::vector<double> xs;
  for (int64_t i = i0; i < i1; ++i) {
    const X* next = x + std::min(i + 1, a.m - 1) * d;
    double* st = a.stats ? a.stats + i * kStats : scratch;
    const S* row;
    if (add) {  // the norm of h as rounded: the backward reads the same
      add(a, i);
      row = h + i * d;
    } else {
      row = reinterpret_cast<const S*>(x + i * d);
    }
    auto* y = out.row(i);
    const uint64_t ck = forward_row(row, d, eps, a.centred, scale, shift, y, st, next,
                                    with_checksum, xs);
    if (with_checksum) a.checksum[i] = ck;
    out.done(i, y);
  }
}

// f(rows's instance, add) for the forward `a`: S the normalized rows' type (h's, else x's),
// X x's.
template <typename F>
void with_rows(const Forward& a, F&& f) {
  if (a.residual == nullptr) {
    with_dtype(a.x_dtype, [&](auto x) {
      using X = std::decay_t<decltype(x)>;
      f(X{}, X{}, AddRow{nullptr});
    });
    return;
  }
  with_dtype(a.x_dtype, [&](auto x) {
    using X = std::decay_t<decltype(x)>;
    with_dtype(a.h_dtype, [&](auto h) {
      using H = std::decay_t<decltype(h)>;
      AddRow add = nullptr;
      with_dtype(a.residual_dtype, [&](auto r) { add = add_row<X, std::decay_t<decltype(r)>, H>; });
      f(H{}, X{}, add);
    });
  });
}

}  // namespace

void forward_rows(const Forward& a, int64_t i0, int64_t i1) {
  with_rows(a, [&](auto s, auto x, AddRow add) {
    using S = decltype(s);
    using X = decltype(x);
    rows<S, X>(a, add, i0, i1, StoreY<X>{static_cast<X*>(a.y), a.d});
  });
}

void quantize_rows(const Forward& a, const Quantize& q, int64_t i0, int64_t i1) {
  thread_local std::vector<double> buffer;  // one row of y in T: no allocation after the first
  buffer.resize(static_cast<size_t>(a.d));
  with_rows(a, [&](auto s, auto x, AddRow add) {
    using S = decltype(s);
    using T = compute_t<S>;
    rows<S, decltype(x)>(a, add, i0, i1,
                         QuantizeY<T>{q, a.d, reinterpret_cast<T*>(buffer.data())});
  });
}

void compute_row(const void* src, Dtype from, void* dst, Dtype t, int64_t n, bool plus_one) {
  auto as = [&](auto zero) {
    using T = std::decay_t<decltype(zero)>;
    T* out = static_cast<T*>(dst);
    with_dtype(from, [&](auto s) {
      using S = std::decay_t<decltype(s)>;
      const S* in = static_cast<const S*>(src);
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(load(in[j]));
    });
    if (plus_one) {
      for (int64_t j = 0; j < n; ++j) out[j] = out[j] + T(1);
    }
  };
  if (t == Dtype::f64) {
    as(0.0);
  } else {
    as(0.0f);
  }
}

void copy_blocks(const void* src, void* dst, int64_t n, int64_t itemsize, int64_t b0,
                 int64_t b1) {
  auto run = [&](auto zero) {
    using U = std::decay_t<decltype(zero)>;
    const U* s = static_cast<const U*>(src);
    U* t = static_cast<U*>(dst);
    for (int64_t b = b0; b < b1; ++b) copy_items(s, t, b * kCopyBlock, std::min(n, (b + 1) * kCopyBlock));
  };
  switch (itemsize) {
    case 1: run(uint8_t{}); break;
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    default: run(uint64_t{}); break;
  }
}

}  // namespace layernorm::engine::LAYERNORM_ISA
