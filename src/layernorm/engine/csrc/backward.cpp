// The engine's backward (docs/cpu-kernels.md, "The sweeps" and "dgamma and dbeta"), for one
// row with u_j = dy_j scale_j, T the compute dtype:
//
//   1  su = sum_j u_j, sut = sum_j u_j xhat_j, mean(g) = su / D (LayerNorm; 0 for RMSNorm),
//      mean(g xhat) = sut / D (from x: rstd (sum_j u_j (x_j - hi) - lo su) / D)
//   2  dx_j = rstd ((u_j - mean(g)) - xhat_j mean(g xhat)) [+ dh_j], dgamma_j += dy_j xhat_j,
//      dbeta_j += dy_j (products rounded to T, partials in double per row chunk)
//
// xhat comes from one of three places: x, ((x - hi) - lo) rstd with the row's statistics
// (the default); y, (y - shift) / scale per channel (the memory-efficient mode: in float32 a
// product by 1 / scale rounded once, the chunk's dgamma partial then corrected by
// 1 / (scale (1 / scale)) in double; in double a division); or the forward's own xhat (the
// kept channels and the rows kept whole).
//
// Rows go kTile at a time: the tile's sweep 2 loads each partial once and adds the four rows'
// terms in row order, the same additions as row by row. Rows whose statistics were scaled, or
// whose T sums are not finite, take a double path on a power-of-two scaling of dy. dx is
// formed in T in a buffer of one span and then rounded to dx's dtype (with dh added, and a
// second copy to dresidual's dtype) by an epilogue chosen once per call.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "element.h"
#include "engine.h"

namespace layernorm::engine::LAYERNORM_ISA {
namespace {

struct None {};  // an absent array's type

// --- the epilogue: dx (and dresidual) from the norm's dx -------------------------------------
// v (V: T, or double on the double path) for elements [off, off + n) of the call's arrays.
using Epilogue = void (*)(const void* v, const void* dh, void* dx, void* dres, int64_t off,
                          int64_t n);

template <typename V, typename DX, typename DH, typename DR>
void epilogue(const void* vp, const void* dhp, void* dxp, void* drp, int64_t off, int64_t n) {
  constexpr bool wide = std::is_same_v<V, double> || std::is_same_v<DX, double> ||
                        std::is_same_v<DR, double>;
  using A = std::conditional_t<wide, double, float>;  // where dh joins dx
  const V* v = static_cast<const V*>(vp);
  DX* dx = static_cast<DX*>(dxp) + off;
  if constexpr (std::is_same_v<DH, None>) {
    if constexpr (std::is_same_v<DR, None>) {
      for (int64_t j = 0; j < n; ++j) dx[j] = store<DX>(v[j]);
    } else {
      DR* dr = static_cast<DR*>(drp) + off;
      for (int64_t j = 0; j < n; ++j) {
        dx[j] = store<DX>(v[j]);
        dr[j] = store<DR>(v[j]);
      }
    }
  } else {
    const DH* dh = static_cast<const DH*>(dhp) + off;
    if constexpr (std::is_same_v<DR, None>) {
      for (int64_t j = 0; j < n; ++j) {
        dx[j] = store<DX>(static_cast<A>(v[j]) + static_cast<A>(load(dh[j])));
      }
    } else {
      DR* dr = static_cast<DR*>(drp) + off;
      for (int64_t j = 0; j < n; ++j) {
        const A t = static_cast<A>(v[j]) + static_cast<A>(load(dh[j]));
        dx[j] = store<DX>(t);
        dr[j] = store<DR>(t);
      }
    }
  }
}

template <typename F>
void with_optional_dtype(Dtype t, F&& f) {
  if (t == Dtype::none) {
    f(None{});
  } else {
    with_dtype(t, f);
  }
}

template <typename V>
Epilogue epilogue_of(const Backward& a) {
  Epilogue out = nullptr;
  with_dtype(a.dx_dtype, [&](auto dx) {
    using DX = std::decay_t<decltype(dx)>;
    with_optional_dtype(a.dh ? a.dh_dtype : Dtype::none, [&](auto dh) {
      using DH = std::decay_t<decltype(dh)>;
      with_optional_dtype(a.dres ? a.dres_dtype : Dtype::none, [&](auto dr) {
        out = epilogue<V, DX, DH, std::decay_t<decltype(dr)>>;
      });
    });
  });
  return out;
}

// --- sweep 1 ---------------------------------------------------------------------------------

struct Sums {
  double su = 0.0, sut = 0.0;
  uint64_t checksum = 0;
};

// (sum_j u_j, sum_j u_j (x_j - hi)) with u = dy scale, in T blocks joined in double; with
// kHash, x's checksum from the same loads (the forward's, sum_centred).
template <bool kHash, typename T, typename S, typename DY>
Sums sum_grad(const S* x, const DY* dy, const T* scale, T hi, int64_t d) {
  constexpr int L = kLanes<T>;
  Sums out;
  for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
    const int64_t n = std::min(kBlock, d - j0);
    Lanes<T> a1, a2;
    BlockHash hash(word_of<S>(j0));
    int64_t j = 0;
    for (; j + L <= n; j += L) {
      for (int k = 0; k < kGroups<T>; ++k) {
        const int64_t o = j0 + j + k * kWidth<T>;
        const wide_t<T> u = load_wide<T>(dy + o) * load_wide<T>(scale + o);
        a1.g[k] += u;
        a2.g[k] += u * (load_wide<T>(x + o) - hi);
      }
      if constexpr (kHash) {
        for (int q = 0; q < kHashVectors<S, L>; ++q) {
          hash.add(reinterpret_cast<const char*>(x + j0 + j) + q * kVectorBytes);
        }
      }
    }
    if constexpr (kHash) out.checksum += hash.finish(x + j0 + j, (n - j) * sizeof(S));
    T t1[L], t2[L];
    int r = 0;
    for (; j < n; ++j, ++r) {
      t1[r] = static_cast<T>(load(dy[j0 + j])) * scale[j0 + j];
      t2[r] = t1[r] * (static_cast<T>(load(x[j0 + j])) - hi);
    }
    out.su += static_cast<double>(a1.fold(t1, r));
    out.sut += static_cast<double>(a2.fold(t2, r));
  }
  return out;
}

// The memory-efficient mode's per-channel values, in T: the scale; num, the shift (0 on the
// kept channels); den, 1 / scale rounded once in float32, scale in double (0 and inf on the
// kept channels, so that xhat is 0 there); w, 1 with 0 on the kept channels, read only in the
// blocks that hold a kept channel (masked).
template <typename T>
struct Channels {
  std::vector<T> num, den, w;
  std::vector<uint8_t> masked;
  bool shifted = false;  // whether the shift is non-zero (+0 bits) on a recovered channel
};

// (su, sut) of one block of a row of y over the recovered channels, sut's terms
// dy_j (y_j - shift_j) (= u_j xhat_j, two roundings fewer), times w in a masked block: the only
// place these block sums are formed, for a row alone and in a tile, so that a row's dx has the
// same bits in any batch.
template <bool kShifted, typename T, typename S, typename DY>
std::pair<double, double> block_grad_y(const S* y, const DY* dy, const T* scale, const Channels<T>& ch,
                             int64_t j0, int64_t n) {
  constexpr int L = kLanes<T>;
  const T* num = ch.num.data() + j0;
  const T* w = ch.w.data() + j0;
  const T* g = scale + j0;
  const bool masked = ch.masked[j0 / kBlock];
  y += j0;
  dy += j0;
  Lanes<T> a1, a2;
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    for (int k = 0; k < kGroups<T>; ++k) {
      const int64_t o = j + k * kWidth<T>;
      const wide_t<T> dv = load_wide<T>(dy + o);
      a1.g[k] += dv * load_wide<T>(g + o);
      const wide_t<T> dw = masked ? dv * load_wide<T>(w + o) : dv;
      const wide_t<T> yv = load_wide<T>(y + o);
      a2.g[k] += dw * (kShifted ? yv - load_wide<T>(num + o) : yv);
    }
  }
  T t1[L], t2[L];
  int r = 0;
  for (; j < n; ++j, ++r) {
    const T dv = static_cast<T>(load(dy[j]));
    t1[r] = dv * g[j];
    const T dw = masked ? dv * w[j] : dv;
    const T yv = static_cast<T>(load(y[j]));
    t2[r] = dw * (kShifted ? yv - num[j] : yv);
  }
  return {a1.fold(t1, r), a2.fold(t2, r)};
}

// --- the rows ----------------------------------------------------------------------------------

template <typename T>
struct Row {
  T hi, lo, rc, mg, mgx;
};

template <typename T>
T recover(T a, T den) {
  if constexpr (std::is_same_v<T, double>) {
    return a / den;
  } else {
    return a * den;
  }
}

// xhat of element j (sweep 2): Mode 0 from a row of x with the row's (hi, lo, rc); 1 from a row
// of y, (y - num) / scale as recover forms it; 2 the same without a shift; 3 a stored xhat.
template <int Mode, typename S, typename T>
inline T xhat_at(const S* row, int64_t j, const Row<T>& r, const T* num, const T* den) {
  if constexpr (Mode == 0) {
    return ((static_cast<T>(load(row[j])) - r.hi) - r.lo) * r.rc;
  } else if constexpr (Mode == 1) {
    return recover(static_cast<T>(load(row[j])) - num[j], den[j]);
  } else if constexpr (Mode == 2) {
    return recover(static_cast<T>(load(row[j])), den[j]);
  } else {
    return static_cast<T>(load(row[j]));
  }
}

// Sweep 2 of one row over [j0, j1): the norm's dx into v (v[j] for j in [j0, j1)), the terms
// added to pg, pb. Every array a restrict parameter, so that the loop vectorises without a
// runtime overlap test.
template <int Mode, typename S, typename DY, typename T>
void span_row(const S* __restrict x, const DY* __restrict dy, const T* __restrict g,
              const T* __restrict num, const T* __restrict den, const Row<T> r,
              T* __restrict v, double* __restrict pg, double* __restrict pb, int64_t j0,
              int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const T dv = static_cast<T>(load(dy[j]));
    const T h = xhat_at<Mode>(x, j, r, num, den);
    v[j] = r.rc * ((dv * g[j] - r.mg) - h * r.mgx);
    pg[j] += static_cast<double>(dv * h);
    pb[j] += static_cast<double>(dv);
  }
}

// span_row of kTile rows at once: each partial loaded once, the rows' terms added in row order
// (the same additions as four span_row calls).
template <int Mode, typename S, typename DY, typename T>
void span_tile(const S* __restrict x0, const S* __restrict x1, const S* __restrict x2,
               const S* __restrict x3, const DY* __restrict d0, const DY* __restrict d1,
               const DY* __restrict d2, const DY* __restrict d3, const T* __restrict g,
               const T* __restrict num, const T* __restrict den, const Row<T> r0,
               const Row<T> r1, const Row<T> r2, const Row<T> r3, T* __restrict v0,
               T* __restrict v1, T* __restrict v2, T* __restrict v3, double* __restrict pg,
               double* __restrict pb, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const T gj = g[j];
    const T e0 = static_cast<T>(load(d0[j])), h0 = xhat_at<Mode>(x0, j, r0, num, den);
    const T e1 = static_cast<T>(load(d1[j])), h1 = xhat_at<Mode>(x1, j, r1, num, den);
    const T e2 = static_cast<T>(load(d2[j])), h2 = xhat_at<Mode>(x2, j, r2, num, den);
    const T e3 = static_cast<T>(load(d3[j])), h3 = xhat_at<Mode>(x3, j, r3, num, den);
    v0[j] = r0.rc * ((e0 * gj - r0.mg) - h0 * r0.mgx);
    v1[j] = r1.rc * ((e1 * gj - r1.mg) - h1 * r1.mgx);
    v2[j] = r2.rc * ((e2 * gj - r2.mg) - h2 * r2.mgx);
    v3[j] = r3.rc * ((e3 * gj - r3.mg) - h3 * r3.mgx);
    pg[j] = (((pg[j] + static_cast<double>(e0 * h0)) + static_cast<double>(e1 * h1)) +
             static_cast<double>(e2 * h2)) +
            static_cast<double>(e3 * h3);
    pb[j] = (((pb[j] + static_cast<double>(e0)) + static_cast<double>(e1)) +
             static_cast<double>(e2)) +
            static_cast<double>(e3);
  }
}

// One call's kernel: src rows S, dy DY, compute dtype T; Mode 0 reads x, 1 y with a shift,
// 2 y whose recovered channels all have a zero shift (no shift read).
template <typename S, typename DY, typename T, int Mode>
struct Kernel {
  static constexpr bool kFromY = Mode != 0;
  const Backward& a;
  const S* src;
  const DY* dy;
  const T* scale;
  const Channels<T>* ch;  // from y
  Epilogue epi, epi64;
  int64_t d;
  bool verify;

  const S* src_row(int64_t i) const { return src + i * d; }
  const DY* dy_row(int64_t i) const { return dy + i * d; }

  static T xhat(const S* row, int64_t j, const Row<T>& r, const T* num, const T* den) {
    return xhat_at<Mode>(row, j, r, num, den);
  }
  const T* num() const { return ch ? ch->num.data() : nullptr; }
  const T* den() const { return ch ? ch->den.data() : nullptr; }

  // Sweep 1 of row i, its sums over the recovered channels given where formed (a tile);
  // returns (fast, same): whether the row may take the T sweep 2, and whether x matched the
  // forward's checksum.
  std::pair<bool, bool> row_sums(int64_t i, Row<T>& r,
                                 const std::pair<double, double>* pre) const {
    const double* s = a.stats + i * kStats;
    const double rstd = s[kRstd];
    const double n = static_cast<double>(d);
    double su, sut;
    bool same = true;
    if constexpr (!kFromY) {
      r.hi = static_cast<T>(s[kHi]);
      r.lo = static_cast<T>(s[kLo]);
      const Sums g = verify ? sum_grad<true>(src_row(i), dy_row(i), scale, r.hi, d)
                            : sum_grad<false>(src_row(i), dy_row(i), scale, r.hi, d);
      su = g.su;
      sut = g.sut;
      same = !verify || g.checksum == a.checksum[i];
      r.mgx = static_cast<T>(rstd * (sut - static_cast<double>(r.lo) * su) / n);
    } else {
      if (pre != nullptr) {
        su = pre->first;
        sut = pre->second;
      } else {
        su = sut = 0.0;
        for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
          const auto b = block_grad_y<Mode == 1>(src_row(i), dy_row(i), scale, *ch, j0,
                                                 std::min(kBlock, d - j0));
          su += static_cast<double>(b.first);
          sut += static_cast<double>(b.second);
        }
      }
      const Recovery& rec = *a.recovery;
      const T* kept = static_cast<const T*>(rec.kept) + i * rec.k;
      for (int64_t q = 0; q < rec.k; ++q) {  // the kept channels' terms
        const int64_t j = rec.keep[q];
        sut += static_cast<double>((static_cast<T>(load(dy_row(i)[j])) * scale[j]) * kept[q]);
      }
      r.hi = r.lo = T(0);
      r.mgx = static_cast<T>(sut / n);
    }
    r.rc = static_cast<T>(rstd);
    r.mg = a.centred ? static_cast<T>(su / n) : T(0);
    return {same && s[kScale] == 1.0 && std::isfinite(su) && std::isfinite(sut), same};
  }

  // Sweep 2 of row i: dx through the epilogue, its terms added to pg, pb; xhat from the row
  // of src (kStored false) or the stored xhat row `stored` (a row kept whole).
  template <bool kStored>
  void write_row(int64_t i, const Row<T>& r, const T* stored, double* pg, double* pb,
                 const S* next_src, const DY* next_dy) const {
    T v[kSpan];
    for (int64_t j0 = 0; j0 < d; j0 += kSpan) {
      const int64_t j1 = std::min(d, j0 + kSpan);
      if constexpr (kStored) {
        span_row<3>(stored, dy_row(i), scale, num(), den(), r, v - j0, pg, pb, j0, j1);
      } else {
        span_row<Mode>(src_row(i), dy_row(i), scale, num(), den(), r, v - j0, pg, pb, j0, j1);
      }
      epi(v, a.dh, a.dx, a.dres, i * d + j0, j1 - j0);
      prefetch(next_src, j0, j1);
      prefetch(next_dy, j0, j1);
    }
  }

  template <typename P>
  static void prefetch(const P* row, int64_t j0, int64_t j1) {
    constexpr int64_t step = std::max<int64_t>(1, kLineBytes / static_cast<int64_t>(sizeof(P)));
    for (int64_t k = j0; k < j1; k += step) __builtin_prefetch(row + k, 0, 2);
  }

  // Sweep 2 of the kTile rows from row i: each partial loaded once, the rows' terms added in
  // row order.
  void write_tile(int64_t i, const Row<T>* r, double* pg, double* pb) const {
    T v[kTile][kSpan];
    for (int64_t j0 = 0; j0 < d; j0 += kSpan) {
      const int64_t j1 = std::min(d, j0 + kSpan);
      span_tile<Mode>(src_row(i), src_row(i + 1), src_row(i + 2), src_row(i + 3), dy_row(i),
                      dy_row(i + 1), dy_row(i + 2), dy_row(i + 3), scale, num(), den(), r[0],
                      r[1], r[2], r[3], v[0] - j0, v[1] - j0, v[2] - j0, v[3] - j0, pg, pb, j0,
                      j1);
      for (int64_t k = 0; k < kTile; ++k) {
        epi(v[k], a.dh, a.dx, a.dres, (i + k) * d + j0, j1 - j0);
      }
    }
  }

  // Row i's dx on the kept channels, from their kept xhat, over what sweep 2 wrote there (it
  // took xhat = 0), and their dgamma terms (sweep 2 added dy 0 there: the same row order).
  void write_kept(int64_t i, const Row<T>& r, double* pg) const {
    const Recovery& rec = *a.recovery;
    const T* kept = static_cast<const T*>(rec.kept) + i * rec.k;
    const DY* dyr = dy_row(i);
    for (int64_t q = 0; q < rec.k; ++q) {
      const int64_t j = rec.keep[q];
      const T dv = static_cast<T>(load(dyr[j]));
      const T x = kept[q];
      const T v = r.rc * ((dv * scale[j] - r.mg) - x * r.mgx);
      epi(&v, a.dh, a.dx, a.dres, i * d + j, 1);
      pg[j] += static_cast<double>(dv * x);
    }
  }

  // Row i in double, xhat = ((xs - hi) - lo) rx from the double row xs, rstd = kRstd kScale;
  // dy scaled by 2^-k so that no sum overflows, dx by 2^k kScale at the end.
  void row_f64(int64_t i, const double* xs, double hi, double lo, double rx, double* pg,
               double* pb, std::vector<double>& buf) const {
    const double* s = a.stats + i * kStats;
    const double r = s[kRstd], scale_x = s[kScale];
    const DY* dyr = dy_row(i);
    std::vector<double> gs(d), dys(d);
    double umax = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      gs[j] = static_cast<double>(scale[j]);
      umax = std::max(umax, std::abs(static_cast<double>(load(dyr[j])) * gs[j]));
    }
    int k = 0;
    if (std::isfinite(umax)) {
      std::frexp(umax, &k);
      k = std::max(0, k);
    }
    const double down = std::ldexp(1.0, -k);
    for (int64_t j = 0; j < d; ++j) dys[j] = static_cast<double>(load(dyr[j])) * down;
    const Sums g = sum_grad<false>(xs, dys.data(), gs.data(), hi, d);
    const double n = static_cast<double>(d);
    const double mg = a.centred ? g.su / n : 0.0;
    const double mgx = rx * (g.sut - lo * g.su) / n;
    int e;
    std::frexp(scale_x, &e);
    const int shift = k + e - 1;  // scale_x = 2^(e - 1)
    buf.resize(d);
    for (int64_t j = 0; j < d; ++j) {
      const double x = ((xs[j] - hi) - lo) * rx;
      // the powers of two last, in one exact step: r kScale may be subnormal, 2^k overflow
      buf[j] = std::ldexp(r * ((dys[j] * gs[j] - mg) - x * mgx), shift);
      const T dv = static_cast<T>(load(dyr[j]));
      pg[j] += static_cast<double>(dv) * x;
      pb[j] += static_cast<double>(dv);
    }
    epi64(buf.data(), a.dh, a.dx, a.dres, i * d, d);
  }

  // Row i alone; q: its index among the rows kept whole, or -1. False where x changed since
  // the forward (nothing written then).
  bool row(int64_t i, int64_t q, double* pg, double* pb, std::vector<double>& buf) const {
    const int64_t nxt = std::min(i + 1, a.m - 1);
    Row<T> r;
    if constexpr (kFromY) {
      if (q >= 0) {
        whole_row(i, q, pg, pb, buf);
        return true;
      }
    }
    const auto [fast, same] = row_sums(i, r, nullptr);
    if (!same) return false;
    const S* xr = src_row(i);
    if (fast) {
      write_row<false>(i, r, nullptr, pg, pb, src_row(nxt), dy_row(nxt));
      if constexpr (kFromY) {
        if (a.recovery->k > 0) write_kept(i, r, pg);
      }
      return true;
    }
    buf.resize(d);
    std::vector<double> xs(d);
    const double* s = a.stats + i * kStats;
    if constexpr (!kFromY) {
      for (int64_t j = 0; j < d; ++j) xs[j] = static_cast<double>(load(xr[j])) * s[kScale];
      row_f64(i, xs.data(), s[kHi], s[kLo], s[kRstd], pg, pb, buf);
    } else {
      Row<T> zero{};
      for (int64_t j = 0; j < d; ++j) xs[j] = static_cast<double>(xhat(xr, j, zero, num(), den()));
      const Recovery& rec = *a.recovery;
      const T* kept = static_cast<const T*>(rec.kept) + i * rec.k;
      for (int64_t p = 0; p < rec.k; ++p) xs[rec.keep[p]] = static_cast<double>(kept[p]);
      row_f64(i, xs.data(), 0.0, 0.0, 1.0, pg, pb, buf);
    }
    return true;
  }

  // Row i kept whole by the forward: its stored xhat row on every channel, the default's
  // formulas on it.
  void whole_row(int64_t i, int64_t q, double* pg, double* pb, std::vector<double>& buf) const {
    const T* xr = static_cast<const T*>(a.recovery->xrows) + q * d;
    const double* s = a.stats + i * kStats;
    const Sums g = sum_grad<false>(xr, dy_row(i), scale, T(0), d);
    const double n = static_cast<double>(d);
    Row<T> r{T(0), T(0), static_cast<T>(s[kRstd]), a.centred ? static_cast<T>(g.su / n) : T(0),
             static_cast<T>(g.sut / n)};
    const int64_t nxt = std::min(i + 1, a.m - 1);
    if (s[kScale] == 1.0 && std::isfinite(g.su) && std::isfinite(g.sut)) {
      write_row<true>(i, r, xr, pg, pb, src_row(nxt), dy_row(nxt));
    } else {
      std::vector<double> xs(xr, xr + d);
      row_f64(i, xs.data(), 0.0, 0.0, 1.0, pg, pb, buf);
    }
  }

  // Sweep 1 of the kTile rows from row i; whether all may take the T sweep 2. From y, the
  // four rows' block sums are formed block by block (each block's per-channel values read by
  // the four rows while in L1), each by the one function a row alone uses.
  bool tile_sums(int64_t i, Row<T>* r) const {
    bool fast = true;
    if constexpr (!kFromY) {
      for (int64_t k = 0; k < kTile; ++k) fast = row_sums(i + k, r[k], nullptr).first && fast;
    } else {
      std::pair<double, double> sums[kTile] = {};
      for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
        const int64_t n = std::min(kBlock, d - j0);
        for (int64_t k = 0; k < kTile; ++k) {
          const auto b = block_grad_y<Mode == 1>(src_row(i + k), dy_row(i + k), scale, *ch, j0, n);
          sums[k].first += static_cast<double>(b.first);
          sums[k].second += static_cast<double>(b.second);
        }
      }
      for (int64_t k = 0; k < kTile; ++k) fast = row_sums(i + k, r[k], &sums[k]).first && fast;
    }
    return fast;
  }

  void chunks(int64_t c0, int64_t c1) const {
    const int64_t m = a.m, nc = n_chunks(m);
    const int64_t* rows = kFromY ? a.recovery->rows : nullptr;
    const int64_t nrows = kFromY ? a.recovery->r : 0;
    std::vector<double> buf;
    Row<T> r[kTile];
    for (int64_t c = c0; c < c1; ++c) {
      double* pg = a.partial + (2 * c) * d;
      double* pb = pg + d;
      std::fill(pg, pg + 2 * d, 0.0);
      int64_t i = c * m / nc;
      const int64_t end = (c + 1) * m / nc;
      // the chunk's next row kept whole is rows[p] = whole (m: none left)
      int64_t p = std::lower_bound(rows, rows + nrows, i) - rows;
      int64_t whole = p < nrows ? rows[p] : m;
      auto one = [&](int64_t k) {
        int64_t q = -1;
        if (k == whole) {
          q = p++;
          whole = p < nrows ? rows[p] : m;
        }
        const bool same = row(k, q, pg, pb, buf);
        if (verify) a.ok[k] = same;
      };
      for (; i + kTile <= end; i += kTile) {
        if (i + kTile <= whole && tile_sums(i, r)) {
          write_tile(i, r, pg, pb);
          if constexpr (kFromY) {
            if (a.recovery->k > 0) {
              for (int64_t k = 0; k < kTile; ++k) write_kept(i + k, r[k], pg);
            }
          }
          if (verify) std::fill(a.ok + i, a.ok + i + kTile, true);
        } else {
          for (int64_t k = 0; k < kTile; ++k) one(i + k);
        }
      }
      for (; i < end; ++i) one(i);
      if constexpr (kFromY && std::is_same_v<T, float>) unbias(pg);
    }
  }

  // pg *= 1 / (scale (1 / scale)) per channel in double (the kept channels, den = 0, as they
  // are): a chunk's dgamma partials from y, each channel's sum of dy (y - shift) r with r the
  // float32 reciprocal, made the sum with the exact 1 / scale. The reciprocal's rounding is
  // the same relative error on every term of a channel, so it would not average out.
  void unbias(double* pg) const {
    for (int64_t j = 0; j < d; ++j) {
      const float den = ch->den[j];
      const double c = 1.0 / (static_cast<double>(scale[j]) * static_cast<double>(den));
      pg[j] *= den == 0.0f ? 1.0 : c;
    }
  }
};

// 1 / g rounded once in float32 (clamped to the largest float32: a recovered |g| may be as small
// as 2^-128), g itself in double; 0 and inf for g = 0 (a kept channel), so that xhat is 0 there.
inline float den_of(float g) {
  constexpr float big = std::numeric_limits<float>::max();
  float r = 1.0f / g;
  r = r > big ? big : r;
  r = r < -big ? -big : r;
  return g == 0.0f ? 0.0f : r;
}
inline double den_of(double g) { return g != 0.0 ? g : std::numeric_limits<double>::infinity(); }

template <typename T>
Channels<T> channels(const Backward& a) {
  const Recovery& rec = *a.recovery;
  const int64_t d = a.d;
  const T* scale = static_cast<const T*>(a.scale);
  const T* shift = static_cast<const T*>(rec.shift);
  Channels<T> ch;
  ch.num.assign(shift, shift + d);
  ch.den.resize(d);
  for (int64_t j = 0; j < d; ++j) ch.den[j] = den_of(scale[j]);
  ch.w.assign(d, T(0));
  ch.masked.assign((d + kBlock - 1) / kBlock, 0);
  for (int64_t q = 0; q < rec.k; ++q) {
    const int64_t j = rec.keep[q];
    const int64_t b = j / kBlock;
    if (!ch.masked[b]) {  // w is read only in the blocks that hold kept channels
      ch.masked[b] = 1;
      std::fill(ch.w.begin() + b * kBlock, ch.w.begin() + std::min(d, (b + 1) * kBlock), T(1));
    }
    ch.num[j] = T(0);
    ch.den[j] = den_of(T(0));
    ch.w[j] = T(0);
  }
  // a shift other than +0 (-0 counts: y - -0 turns a -0 y into +0) on a recovered channel
  for (int64_t j = 0; j < d; ++j) ch.shifted = ch.shifted || bits_of(ch.num[j]) != 0;
  return ch;
}

template <typename S, typename DY, typename T, int Mode>
void run(const Backward& a, const Channels<T>* ch, int64_t c0, int64_t c1) {
  const Kernel<S, DY, T, Mode> k{a,       static_cast<const S*>(a.src),
                                 static_cast<const DY*>(a.dy), static_cast<const T*>(a.scale),
                                 ch,      epilogue_of<T>(a),
                                 epilogue_of<double>(a), a.d,
                                 a.checksum != nullptr};
  k.chunks(c0, c1);
}

}  // namespace

bool backward_chunks(const Backward& a, int64_t c0, int64_t c1) {
  bool ran = false;
  auto with_t = [&](auto t) {
    using T = std::decay_t<decltype(t)>;
    with_dtype(a.src_dtype, [&](auto s) {
      using S = std::decay_t<decltype(s)>;
      with_dtype(a.dy_dtype, [&](auto dy) {
        using DY = std::decay_t<decltype(dy)>;
        if constexpr (std::is_same_v<compute_t<DY>, T>) {
          if (a.recovery == nullptr) {
            if constexpr (std::is_same_v<compute_t<S>, T>) {
              run<S, DY, T, 0>(a, nullptr, c0, c1);
              ran = true;
            }
          } else {
            const Channels<T> ch = channels<T>(a);
            if (ch.shifted) {
              run<S, DY, T, 1>(a, &ch, c0, c1);
            } else {
              run<S, DY, T, 2>(a, &ch, c0, c1);
            }
            ran = true;
          }
        }
      });
    });
  };
  if (a.t_dtype == Dtype::f64) {
    with_t(double{});
  } else {
    with_t(float{});
  }
  return ran;
}

void reduce_chunks(const double* partial, double* out, int64_t c, int64_t d) {
  for (int64_t k = 0; k < 2; ++k) {
    double* acc = out + k * d;
    std::fill(acc, acc + d, 0.0);
    for (int64_t q = 0; q < c; ++q) {
      const double* p = partial + (2 * q + k) * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += p[j];
    }
  }
}

}  // namespace layernorm::engine::LAYERNORM_ISA
