// The CPU engine's elements: how each stored dtype is read into its compute dtype and
// rounded back, the fixed-order sums every row reduction uses, and a row checksum's hash.
//
// Storage types are float, double, Half (float16 bits) and BFloat16 (bfloat16 bits); the
// compute dtype T is double for double and float for the others. Every rounding to a stored
// dtype is one rounding to nearest even from the value computed, whether that is float or
// double (a double bound for a half type is first rounded to float to odd, which makes the
// second rounding the only one in effect), subnormals kept and NaN kept a NaN.
//
// The engine is compiled without -ffast-math and with -ffp-contract=off: every sum and
// product rounds where the source says, and a fused multiply-add is written as one
// (mul_add) where a kernel wants it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <utility>

#include "engine.h"

#ifndef LAYERNORM_ISA
#error "the kernel files are compiled once per instruction set, with -DLAYERNORM_ISA=<v3|v4>"
#endif

namespace layernorm::engine::LAYERNORM_ISA {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

template <typename S>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};
// The dtype a stored S computes in.
template <typename S>
using compute_t = typename Compute<S>::type;

template <typename To, typename From>
inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

// A stored element as its compute value, exactly.
inline float load(float v) { return v; }
inline double load(double v) { return v; }
inline float load(BFloat16 v) { return bit_cast<float>(static_cast<uint32_t>(v.bits) << 16); }
inline float load(Half v) { return static_cast<float>(bit_cast<_Float16>(v.bits)); }

// A double rounded to float to odd: toward zero, then the last bit set where inexact, so that
// rounding the result to a narrower type rounds the double once in effect.
inline float to_odd(double v) {
  const float f = static_cast<float>(v);  // to nearest
  const double back = f;
  uint32_t u = bit_cast<uint32_t>(f);
  const bool away = v > 0 ? back > v : back < v;  // rounded away from zero (false for NaN)
  if (away) u -= 1;
  if (back != v && !std::isnan(v)) u |= 1;
  return bit_cast<float>(u);
}

inline uint16_t bfloat16_bits(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  uint32_t r = u + 0x7FFFu + ((u >> 16) & 1u);  // to nearest even
  if (f != f) r = u | 0x00400000u;  // a NaN stays one, quiet
  return static_cast<uint16_t>(r >> 16);  // (one shift and one narrowing for both, in vectors)
}

// v (float or double) rounded once, to nearest even, to the stored type S.
template <typename S>
struct Store;
template <>
struct Store<float> {
  static float of(float v) { return v; }
  static float of(double v) { return static_cast<float>(v); }
};
template <>
struct Store<double> {
  static double of(float v) { return v; }
  static double of(double v) { return v; }
};
template <>
struct Store<BFloat16> {
  static BFloat16 of(float v) { return {bfloat16_bits(v)}; }
  static BFloat16 of(double v) { return {bfloat16_bits(to_odd(v))}; }
};
template <>
struct Store<Half> {
  static Half of(float v) { return {bit_cast<uint16_t>(static_cast<_Float16>(v))}; }
  static Half of(double v) { return {bit_cast<uint16_t>(static_cast<_Float16>(to_odd(v)))}; }
};
template <typename S, typename V>
inline S store(V v) {
  return Store<S>::of(v);
}

// a * b + c rounded once where the CPU has fused multiply-add, else rounded twice: what the
// kernels' output sweep computes (docs/cpu-kernels.md, "FMA").
template <typename V>
inline V mul_add(V a, V b, V c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// f(zero of the stored type named t): one instance of f per stored dtype. (Name the type as
// std::decay_t<decltype(parameter)>: in a lambda nested in f, g++ 12 takes the decltype of the
// captured parameter for a reference type.)
template <typename F>
void with_dtype(Dtype t, F&& f) {
  switch (t) {
    case Dtype::f32: f(float{}); return;
    case Dtype::f64: f(double{}); return;
    case Dtype::f16: f(Half{}); return;
    case Dtype::bf16: f(BFloat16{}); return;
    case Dtype::none: return;
  }
}

// --- fixed-order sums ------------------------------------------------------------------------
// A block's sum is formed in kLanes<T> partial sums in T: element j of the block goes to lane
// j % kLanes, in order (kBlock / kLanes = 16 elements a lane), and the lanes are then added in
// double in a fixed tree (lane l += lane l + w for w = kLanes/2, ..., 1). The order depends on the block's length only: not on the data's
// address, the thread, or the CPU's vector width, so every machine gets the same bits from the
// same inputs. The lanes are held as kGroups vectors of the CPU's width (the compiler's
// vector_size: two of 512 bits for float32 with AVX-512, four of 256 bits with AVX2), each a
// register, lane for lane the same arithmetic.
template <typename T>
constexpr int kLanes = sizeof(T) == 4 ? 32 : 16;

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

template <typename E, int N>
struct VectorOf {
  typedef E type __attribute__((vector_size(sizeof(E) * N)));
};
// N lanes of E.
template <typename E, int N>
using vec = typename VectorOf<E, N>::type;

// One vector register of T, and how many of them hold the lanes of a sum.
template <typename T>
constexpr int kWidth = kVectorBytes / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kGroups = kLanes<T> / kWidth<T>;
template <typename T>
using wide_t = vec<T, kWidth<T>>;

// kWidth<T> consecutive stored elements from p, each its compute value as T (exactly, or
// rounded once where T is narrower).
template <typename T, typename S>
inline wide_t<T> load_wide(const S* p) {
  constexpr int W = kWidth<T>;
  if constexpr (std::is_same_v<S, T>) {
    wide_t<T> v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else if constexpr (std::is_same_v<S, BFloat16>) {
    vec<uint16_t, W> u;
    std::memcpy(&u, p, sizeof u);
    const vec<uint32_t, W> w = __builtin_convertvector(u, vec<uint32_t, W>) << 16;
    vec<float, W> f;
    std::memcpy(&f, &w, sizeof f);
    return __builtin_convertvector(f, wide_t<T>);
  } else if constexpr (std::is_same_v<S, Half>) {
    vec<_Float16, W> h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, wide_t<T>);
  } else {
    vec<S, W> v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, wide_t<T>);
  }
}

// Elements Off .. Off + N/2 - 1 of a, as a vector of N/2: a register's half, kept in registers.
template <int Off, typename V, size_t... I>
inline auto elements(V a, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, a, (Off + static_cast<int>(I))...);
}
template <int Off, typename V>
inline auto half(V a) {
  constexpr size_t n = sizeof(V) / sizeof(a[0]);
  return elements<Off>(a, std::make_index_sequence<n / 2>{});
}

// The lanes' fixed tree: acc[l] += acc[l + N/2] for l < N/2, then N/4, ..., 1, returning acc[0].
// The N lanes are P vectors of the CPU's width (piece i holds lanes i * N/P onward): while the
// halves are whole vectors, a level adds piece i + P/2 to piece i, then the one vector's
// halves. Each level is one addition of lower and upper half, as in the scalar loops, so the
// order, and the bits, are theirs, on any vector width.
template <int N>
inline double tree(vec<double, N> acc) {
  if constexpr (N == 1) {
    return acc[0];
  } else {
    return tree<N / 2>(half<0>(acc) + half<N / 2>(acc));
  }
}
template <int P, int N>
inline double tree(vec<double, N>* piece) {
  if constexpr (P == 1) {
    return tree<N>(piece[0]);
  } else {
    for (int i = 0; i < P / 2; ++i) piece[i] = piece[i] + piece[i + P / 2];
    return tree<P / 2, N>(piece);
  }
}

// The kLanes<T> partial sums of a block.
template <typename T>
struct Lanes {
  wide_t<T> g[kGroups<T>] = {};

  // The lanes added in the fixed tree, in double, after the block's last elements (fewer than
  // kLanes, in `tail`, n of them) went to lanes 0, 1, ... in T: T rounds only within a lane.
  // (The other lanes add -0.0, which leaves every value as it is.) In vector registers: the
  // fold costs a few instructions, not a loop over the lanes. With no tail (a whole block, or a
  // row's last whose length is a multiple of kLanes) nothing is added: -0.0 would change no bit.
  double fold(const T* tail, int n) const {
    constexpr int W = kWidth<T>, G = kGroups<T>;
    constexpr int DW = kVectorBytes / static_cast<int>(sizeof(double));  // doubles a register
    wide_t<T> v[G];
    for (int k = 0; k < G; ++k) v[k] = g[k];
    if (n > 0) {
      T pad[kLanes<T>];
      for (T& e : pad) e = T(-0.0);
      std::memcpy(pad, tail, static_cast<size_t>(n) * sizeof(T));
      for (int k = 0; k < G; ++k) {
        wide_t<T> t;
        std::memcpy(&t, pad + k * W, sizeof t);
        v[k] = v[k] + t;
      }
    }
    constexpr int P = kLanes<T> / DW;
    vec<double, DW> piece[P];
    for (int k = 0; k < G; ++k) {
      if constexpr (std::is_same_v<T, double>) {
        piece[k] = v[k];
      } else {  // float: each register's halves, exactly in double
        piece[2 * k] = __builtin_convertvector(half<0>(v[k]), vec<double, DW>);
        piece[2 * k + 1] = __builtin_convertvector(half<W / 2>(v[k]), vec<double, DW>);
      }
    }
    return tree<P, DW>(piece);
  }
};

// The bits of v, zero-extended.
template <typename S>
inline uint64_t bits_of(S v) {
  if constexpr (sizeof(S) == 2) {
    return v.bits;
  } else if constexpr (sizeof(S) == 4) {
    return bit_cast<uint32_t>(v);
  } else {
    return bit_cast<uint64_t>(v);
  }
}

// --- a row's checksum --------------------------------------------------------------------
// Odd constants of the checksum's keys: word w of a row is keyed by kKey0 + w * kKeyStep.
constexpr uint32_t kKeyStep = 0x9E3779B9u, kKey0 = 0x7F4A7C15u;

// Lane for lane, the 64-bit product of the low 32-bit words of a and b: one instruction where
// the CPU has it (the compiler does not see that masked operands need no 64 x 64 multiply).
template <typename U>
inline U mul_low_words(U a, U b) {
#if defined(__AVX512F__)
  if constexpr (sizeof(U) == 64) return (U)_mm512_mul_epu32((__m512i)a, (__m512i)b);
#endif
#if defined(__AVX2__)
  if constexpr (sizeof(U) == 32) return (U)_mm256_mul_epu32((__m256i)a, (__m256i)b);
#endif
  return (a & 0xFFFFFFFFu) * (b & 0xFFFFFFFFu);
}

// The checksum of a block of a row, elements j0 .. j0 + n - 1 (j0 a multiple of kBlock): the
// block's bits as 32-bit words, each plus a key of its position in the row, the pairs (a, b) of
// words multiplied to 64 bits and the products summed (the NH hash). The products make every
// change that a sum of bits would cancel (a row negated or scaled by a power of two, |x|, a
// pattern of sign flips, a swap of elements) change the sum but by a chance near 2^-32. A last
// part pair of words is padded with zero bits. The sum of a row's blocks is the row's
// checksum, however the row is split into blocks.
//
// It is taken in the order of the block's bytes: add() hashes the next kVectorBytes (a vector
// of P pairs: each word keyed by one 32-bit addition, each 64-bit lane's two words multiplied),
// finish() the block's last bytes (what the sweep's vector steps leave, pair by pair) and
// returns the sum. A sweep that reads the block anyway calls add() on what it has just loaded,
// so the hash costs no pass of its own (integers: the sum is exact, in any order).
class BlockHash {
 public:
  static constexpr int P = kVectorBytes / 8;

  explicit BlockHash(int64_t word0) {  // word0: the block's first word's index in the row
    const uint32_t key = kKey0 + static_cast<uint32_t>(word0) * kKeyStep;
    for (int w = 0; w < 2 * P; ++w) keys_[w] = key + static_cast<uint32_t>(w) * kKeyStep;
  }

  void add(const void* p) {
    W v;
    std::memcpy(&v, p, sizeof v);
    const U s = (U)(v + keys_);
    acc_ += mul_low_words(s, s >> 32);
    keys_ += W{} + static_cast<uint32_t>(2 * P) * kKeyStep;
  }

  uint64_t finish(const void* p, int64_t bytes) const {
    uint64_t ck = 0;
    for (int l = 0; l < P; ++l) ck += acc_[l];
    uint32_t key = keys_[0];  // the next word's
    const char* c = static_cast<const char*>(p);
    for (int64_t b = 0; b < bytes; b += 8) {
      uint64_t v = 0;
      std::memcpy(&v, c + b, std::min<int64_t>(8, bytes - b));
      const uint32_t lo = static_cast<uint32_t>(v) + key;
      const uint32_t hi = static_cast<uint32_t>(v >> 32) + (key + kKeyStep);
      ck += static_cast<uint64_t>(lo) * hi;
      key += 2 * kKeyStep;
    }
    return ck;
  }

 private:
  using U = vec<uint64_t, P>;
  using W = vec<uint32_t, 2 * P>;
  W keys_;  // the keys of the next vector's words
  U acc_{};
};

// The index of element j's first word in its row of S.
template <typename S>
constexpr int64_t word_of(int64_t j) {
  return j * static_cast<int64_t>(sizeof(S)) / 4;
}

// How many of BlockHash's vectors a sweep's step of L elements of S holds: every sweep's step
// is a whole number of them (64 or 128 bytes against vectors of 32 or 64).
template <typename S, int L>
constexpr int hash_vectors() {
  static_assert(L * sizeof(S) % kVectorBytes == 0, "a sweep's step must be whole vectors");
  return L * static_cast<int>(sizeof(S)) / kVectorBytes;
}
template <typename S, int L>
constexpr int kHashVectors = hash_vectors<S, L>();

}  // namespace layernorm::engine::LAYERNORM_ISA
