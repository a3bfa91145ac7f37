// The CPU engine: the kernels of every norm of the family, each call a range of rows (or of
// row chunks) of one tensor, which the caller splits over its threads. The arithmetic is
// stated in docs/cpu-kernels.md; this header names each kernel's arguments.
//
// The kernel files (forward.cpp, backward.cpp, kernels.cpp) include this header and element.h
// only (no torch headers), so that each compiles in seconds. They are compiled once per
// instruction set (x86-64-v3: AVX2 and FMA; x86-64-v4: AVX-512), each set into a shared object
// of its own, in a namespace of its own (LAYERNORM_ISA), with every symbol hidden but the one
// that hands out its table of kernels (Kernels): no inline or template instance compiled for
// one set can serve another. The operator (cpu_ops.cpp) fills the structures from tensors and
// calls the kernels of the set chosen at load (operator.cpp, select_kernels).
#pragma once

#include <cstdint>

namespace layernorm::engine {

// The stored dtypes the kernels read and write.
enum class Dtype : int8_t { none, f32, f64, f16, bf16 };

// Elements of a row summed in T (16 to a lane of element.h's fixed-order sums) before the
// block's lanes are added in double; also the blocks of channels the memory-efficient backward
// masks where one holds a kept channel.
constexpr int64_t kBlock = 512;
// Elements of an output sweep between prefetch bursts (16 cache lines of float32).
constexpr int64_t kSpan = 256;
// The forward's output sweep prefetches the next row only for rows of at least this many bytes.
constexpr int64_t kPrefetchRowBytes = 16384;
constexpr int64_t kLineBytes = 64;
// Elements of a row whose mean is the first guess at the row's mean.
constexpr int64_t kSamples = 16;
// A row is centred again on the mean the first sweep found where c^2 > kRecentre var.
constexpr double kRecentre = 1.0 / 8;
// Rows of a backward chunk (at least), chunks of a backward (at most), rows of a tile.
constexpr int64_t kRowsPerChunk = 32;
constexpr int64_t kMaxChunks = 16;
constexpr int64_t kTile = 4;

// The forward's statistics, one row of (M, kStats) float64 per row: the mean as the
// unevaluated sum kHi + kLo of two T numbers, kRstd, and kScale, the power of two the row was
// scaled by (1 except on rows whose T sums overflow: their statistics belong to x * kScale).
constexpr int64_t kHi = 0, kLo = 1, kRstd = 2, kScale = 3, kStats = 4;

// Chunks of the backward's dgamma/dbeta partials for m rows: a power of two set by m alone, at
// most kMaxChunks, each at least kRowsPerChunk rows where m allows.
inline int64_t n_chunks(int64_t m) {
  int64_t c = 1;
  while (c * 2 <= kMaxChunks && c * 2 * kRowsPerChunk <= m) c *= 2;
  return c;
}

// One forward: y (M, D) of x, or of h = x + residual rounded once to h's dtype (an add-norm,
// which writes h). scale and shift are (D,) in the compute dtype T of the normalized rows
// (h's, else x's): gamma (or 1 + gamma) and beta, ones and zeros where absent. y has x's dtype.
struct Forward {
  const void* x;
  const void* residual;  // null for a plain norm
  void* h;               // null for a plain norm
  void* y;
  const void* scale;
  const void* shift;
  double eps;
  bool centred;        // LayerNorm; else RMSNorm
  double* stats;       // (M, kStats), or null to keep none
  uint64_t* checksum;  // (M,): each row's checksum of the normalized row's bits; or null
  int64_t m, d;
  Dtype x_dtype, residual_dtype, h_dtype;  // residual_dtype and h_dtype none for a plain norm
};


// The quantized dtypes of a norm's output.
enum class QDtype : int8_t { int8, float8_e4m3fn };

// A forward whose y is quantized instead of stored (docs/derivation.md, "Quantized output"):
// each row's y in the compute dtype T (kept in a buffer of the thread's while the row is in
// cache), then per group of `group` consecutive channels (group = D: per token) q = y / s
// rounded to nearest even and saturated to +-qmax, s the static `scale`, or with `scales`
// float32(max(min(max|y|, scale_ub) / qmax, min_scale)) written to scales (M, D / group).
struct Quantize {
  void* q;         // (M, D) int8, or float8_e4m3fn bits
  float* scales;   // (M, D / group), or null for the static scale
  float scale;     // the static scale (with scales null)
  float scale_ub;  // the bound on a group's finite max|y|; +inf: none
  double qmax, min_scale;
  int64_t group;
  QDtype dtype;
};


// What the memory-efficient backward reads in place of x: xhat_j = (y_j - shift_j) / scale_j on
// the recovered channels, the forward's xhat on the k channels `keep` names (kept, (M, k) T)
// and on the r rows `rows` names (xrows, (r, D) T); keep and rows ascending.
struct Recovery {
  const void* shift;  // (D,) T
  const int64_t* keep;
  const void* kept;
  int64_t k;
  const int64_t* rows;
  const void* xrows;
  int64_t r;
};

// One backward over row chunks: dx (M, D) (and dres, a second copy of it in another dtype, for
// an add-norm whose residual's dtype differs from x's), dh added where given, and each chunk's
// float64 partial sums (dgamma, dbeta) in partial (C, 2, D), C = n_chunks(M). src is x (or h)
// in the default mode, y with `recovery` in the memory-efficient one. scale (D,) in the
// compute dtype T (gamma, 1 + gamma, or ones); dy and dh are in dtypes that compute in T and
// in the widest compute dtype of dx's, dres's and T.
struct Backward {
  const void* src;
  const void* dy;
  const void* dh;  // null without
  void* dx;
  void* dres;  // null unless kept apart from dx
  const void* scale;
  const double* stats;        // the forward's (M, kStats)
  const uint64_t* checksum;   // (M,) the forward's checksums to verify, or null
  bool* ok;                   // (M,) whether each row matched its checksum (with checksum)
  double* partial;
  const Recovery* recovery;   // null for the default mode
  bool centred;
  int64_t m, d;
  Dtype src_dtype, dy_dtype, dh_dtype, dx_dtype, dres_dtype, t_dtype;
};


// The items of a copy's block (Kernels::copy_blocks).
constexpr int64_t kCopyBlock = 1 << 14;

// The kernels of one instruction set.
struct Kernels {
  uint32_t size;    // sizeof(Kernels) where the set was built: a table of another layout is refused
  const char* set;  // the instruction set, as -march names it ("x86-64-v3")
  // Rows i0 <= i < i1 of a forward.
  void (*forward_rows)(const Forward& a, int64_t i0, int64_t i1);
  // Rows i0 <= i < i1 of a forward (its y null) with their y quantized as `q` says.
  void (*quantize_rows)(const Forward& a, const Quantize& q, int64_t i0, int64_t i1);
  // Chunks c0 <= c < c1 of a backward; false (nothing done) for dtypes it has no kernel for:
  // dy's must compute in T, and in the default mode src's too.
  bool (*backward_chunks)(const Backward& a, int64_t c0, int64_t c1);
  // out (2, D) = the sum over chunks of partial (C, 2, D), in chunk order.
  void (*reduce_chunks)(const double* partial, double* out, int64_t c, int64_t d);
  // dst (n,) in the compute dtype t (f32 or f64) = src (n,) of dtype `from`, each value rounded
  // once to t, then plus one (in t) where asked: a parameter's row for one call (gamma, or
  // 1 + gamma for zero-centred gamma; beta).
  void (*compute_row)(const void* src, Dtype from, void* dst, Dtype t, int64_t n,
                      bool plus_one);
  // dst = src, n items of `itemsize` bytes, [b0, b1) of its blocks of kCopyBlock items: the
  // bandwidth yardstick, with ordinary stores as the kernels' (each written line is read
  // first).
  void (*copy_blocks)(const void* src, void* dst, int64_t n, int64_t itemsize, int64_t b0,
                      int64_t b1);
};

// The one symbol a kernel set's shared object exports: `const Kernels* layernorm_kernels()`.
constexpr const char* kKernelsSymbol = "layernorm_kernels";
using KernelsEntry = const Kernels* (*)();

}  // namespace layernorm::engine

#ifdef LAYERNORM_ISA
// In a kernel set's files: the kernels, in the set's own namespace (kernels.cpp tables them).
namespace layernorm::engine::LAYERNORM_ISA {
void forward_rows(const Forward& a, int64_t i0, int64_t i1);
void quantize_rows(const Forward& a, const Quantize& q, int64_t i0, int64_t i1);
bool backward_chunks(const Backward& a, int64_t c0, int64_t c1);
void reduce_chunks(const double* partial, double* out, int64_t c, int64_t d);
void compute_row(const void* src, Dtype from, void* dst, Dtype t, int64_t n, bool plus_one);
void copy_blocks(const void* src, void* dst, int64_t n, int64_t itemsize, int64_t b0,
                 int64_t b1);
}  // namespace layernorm::engine::LAYERNORM_ISA
#endif
