// The quantization of one row's y (engine.h, Quantize; docs/derivation.md, "Quantized output"):
// per group, a = max|y| (NaN if the group holds one), a = min(a, scale_ub) where finite,
// s = float(max(a / qmax, min_scale)) in V, then q_j = encode(y_j / s), a true division in V.
// A group whose scale is not finite is filled with int8 0 or the float8 NaN.
//
// The encodings are branchless, so that each group's loop is vectorised:
//   int8   NaN -> 0; clamp to [-qmax, qmax]; round half to even by adding and subtracting
//          1.5 2^p (p the significand's stored bits: every |v| <= 127 then has its units in
//          the last place, and the sum rounds as the CPU does, to nearest even)
//   float8 NaN set aside first; clamp to [-448, 448]; |v| >= 2^-6: v's bits rounded to
//          nearest even at 3 stored significand bits (a carry moves the exponent, as it
//          should), rebiased; |v| < 2^-6: |v| 2^9 rounded to an integer, which is the
//          subnormal's code (8 is 2^-6's); NaN -> 0x7F; the sign bit last.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "element.h"
#include "engine.h"

namespace layernorm::engine::LAYERNORM_ISA {

template <typename V>
struct Bits {
  using U = std::conditional_t<sizeof(V) == 4, uint32_t, uint64_t>;
  static constexpr int kStored = sizeof(V) == 4 ? 23 : 52;  // stored significand bits
  static constexpr U kBias = sizeof(V) == 4 ? 127 : 1023;
  // 1.5 2^kStored: adding it rounds a small v to an integer
  static constexpr V kRound = V(3) * (V(U(1) << (kStored - 1)));
};

template <typename V>
inline int8_t int8_of(V v, V qmax) {
  v = v == v ? v : V(0);
  v = std::min(std::max(v, -qmax), qmax);
  return static_cast<int8_t>((v + Bits<V>::kRound) - Bits<V>::kRound);
}

// max |y_j| over [0, n), NaN where one is NaN: in vectors of the CPU's width (the compiler
// does not vectorise a maximum that must see NaN), then across their lanes.
template <typename V>
inline V group_amax(const V* y, int64_t n) {
  constexpr int W = kWidth<V>;
  using Vec = wide_t<V>;
  using Mask = decltype(Vec{} != Vec{});
  Vec vm = {};
  Mask vnan = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    Vec v;
    std::memcpy(&v, y + j, sizeof v);
    vnan |= v != v;
    v = v < 0 ? -v : v;
    vm = vm < v ? v : vm;
  }
  V m = 0;
  bool nan = false;
  for (int k = 0; k < W; ++k) {
    m = m < vm[k] ? vm[k] : m;
    nan |= vnan[k] != 0;
  }
  for (; j < n; ++j) {
    const V v = std::abs(y[j]);
    m = m < v ? v : m;
    nan |= v != v;
  }
  return nan ? std::numeric_limits<V>::quiet_NaN() : m;
}

// The float8_e4m3fn codes of v (a vector of the CPU's width), each rounded to nearest even and
// saturated to +-448, NaN to 0x7F (the header's comment). In g++'s vector types: left to the
// vectoriser, a scalar loop was unrolled to 64 outputs and spilled its masks.
template <typename V>
inline vec<uint8_t, kWidth<V>> float8_codes(wide_t<V> v) {
  using B = Bits<V>;
  using U = typename B::U;
  using Vec = wide_t<V>;
  using UVec = vec<U, kWidth<V>>;
  constexpr int drop = B::kStored - 3;
  constexpr U top = U(1) << (8 * sizeof(V) - 1);
  const auto nan = v != v;
  v = nan ? Vec{} : v;  // the code is set below; no NaN reaches the integer conversion
  v = v < V(-448) ? V(-448) : v;
  v = v > V(448) ? V(448) : v;
  UVec u;
  std::memcpy(&u, &v, sizeof u);
  const UVec mag = u & ~top;
  const UVec r = mag + ((U(1) << (drop - 1)) - 1) + ((mag >> drop) & 1);
  const UVec normal = (r >> drop) - U((B::kBias - 7) << 3);
  Vec a;
  std::memcpy(&a, &mag, sizeof a);
  const UVec sub = __builtin_convertvector((a * V(512) + B::kRound) - B::kRound, UVec);
  UVec code = a < V(1.0 / 64) ? sub : normal;
  code = nan ? UVec{} + U(0x7F) : code;
  code |= (u >> (8 * sizeof(V) - 1)) << 7;
  return __builtin_convertvector(code, vec<uint8_t, kWidth<V>>);
}

// q_j = the float8 code of y_j / s over [0, n), a vector at a time; the last n mod W values in
// a vector padded with zeros, so that one encoding serves every value.
template <typename V>
inline void encode_float8(const V* y, V s, int64_t n, uint8_t* q) {
  constexpr int W = kWidth<V>;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    wide_t<V> v;
    std::memcpy(&v, y + j, sizeof v);
    const vec<uint8_t, W> out = float8_codes<V>(v / s);
    std::memcpy(q + j, &out, sizeof out);
  }
  if (j < n) {
    wide_t<V> v = {};
    std::memcpy(&v, y + j, (n - j) * sizeof(V));
    const vec<uint8_t, W> out = float8_codes<V>(v / s);
    std::memcpy(q + j, &out, n - j);
  }
}

template <typename V>
inline void encode(const V* y, V s, int64_t n, QDtype dtype, V qmax, void* out) {
  if (dtype == QDtype::int8) {
    int8_t* q = static_cast<int8_t*>(out);
    for (int64_t j = 0; j < n; ++j) q[j] = int8_of(y[j] / s, qmax);
  } else {
    encode_float8(y, s, n, static_cast<uint8_t*>(out));
  }
}

// Row i of q (and of its scales) from the row's y (d,) in V.
template <typename V>
void quantize_row(const Quantize& a, int64_t i, const V* y, int64_t d) {
  const int64_t g = a.group, groups = d / g;
  const V qmax = static_cast<V>(a.qmax);
  uint8_t* qrow = static_cast<uint8_t*>(a.q) + i * d;  // one byte an element
  for (int64_t k = 0; k < groups; ++k) {
    const V* yk = y + k * g;
    V s = static_cast<V>(a.scale);
    if (a.scales != nullptr) {
      V amax = group_amax(yk, g);
      if (std::isfinite(amax)) amax = std::min(amax, static_cast<V>(a.scale_ub));
      const V t = amax / qmax;
      const V lo = static_cast<V>(a.min_scale);
      const float sf = static_cast<float>(t < lo ? lo : t);  // NaN stays
      a.scales[i * groups + k] = sf;
      s = static_cast<V>(sf);
      if (!std::isfinite(sf)) {
        std::fill(qrow + k * g, qrow + (k + 1) * g,
                  a.dtype == QDtype::int8 ? uint8_t(0) : uint8_t(0x7F));
        continue;
      }
    }
    encode(yk, s, g, a.dtype, qmax, qrow + k * g);
  }
}

}  // namespace layernorm::engine::LAYERNORM_ISA
