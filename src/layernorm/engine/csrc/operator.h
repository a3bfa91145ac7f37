// What the operator's files share: dtypes, the parameters in the compute dtype, outputs from
// the pool, argument checks, and the engine run over torch's threads (operator.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "engine.h"

namespace torch {
class Library;
}  // namespace torch

namespace layernorm::op {

namespace engine = layernorm::engine;

using at::ScalarType;
using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Tensors8 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// Work below this many elements runs on the calling thread: torch's threads wake in a few
// microseconds, a row of 4096 float32 is about half a microsecond of arithmetic (eight such
// rows took 8.5 us on 2 threads against 9.8 us on one).
constexpr int64_t kSerialElements = int64_t(1) << 14;

// The kernels of the instruction set chosen at load: the widest this CPU runs, or `forced`
// (LAYERNORM_ISA), from kernels-<set>.so in `folder`; its name. Once chosen, the ops' CPU
// kernels are registered (register_cpu, register_autograd). A CPU that runs no set, a set
// this CPU cannot run or an unknown one is a ValueError saying so; nothing is registered.
std::string select_kernels(const std::string& folder, const std::string& forced);
// The chosen set's kernels (an error before one is chosen).
const engine::Kernels& kernels();
void register_cpu(torch::Library& m);       // cpu_ops.cpp
void register_autograd(torch::Library& m);  // autograd.cpp

// Where the kernels compute: float64 for float64, else float32; and the widest of three.
ScalarType compute(ScalarType t);
ScalarType widest(ScalarType a, ScalarType b, ScalarType c);
engine::Dtype dtype_of(ScalarType t);
// t in a dtype that computes in cdt (t itself where it does), contiguous.
Tensor in_dtype(const Tensor& t, ScalarType cdt);

// (D,) the scale (gamma, 1 + gamma, or ones: fill 1) or the shift (beta, or zeros: fill 0) in
// the compute dtype for one call: the parameter's own memory where it already is one, else a
// buffer of the calling thread's (slot 0 or 1: two parameters a call).
const void* param_row(const OptTensor& p, int64_t d, ScalarType cdt, bool plus_one,
                      double fill, int slot);

// An output of `sizes`: from the pool when large, else torch's allocator.
Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options);
// The recovery rule's margin (layernorm.recovery.MARGIN), set by _setup with the pool's cap.
double margin();
// The quantized dtypes' qmax and min_scale (layernorm.reference.quant.QUANT_DTYPES), int8's
// or float8_e4m3fn's, set by _setup.
struct QuantLimits {
  double qmax, min_scale;
};
QuantLimits quant_limits(bool float8);
// _setup: the pool's cap, the recovery rule's margin, and the quantized dtypes' limits (int8's,
// then float8_e4m3fn's).
void setup(int64_t pool_bytes, double margin, at::ArrayRef<double> qmax,
           at::ArrayRef<double> min_scale);
int64_t pool_bytes();

void check_cpu(const Tensor& t, const char* name);
void check_param(const OptTensor& p, int64_t d, const char* name);
void check_like(const Tensor& t, const Tensor& like, const char* name, const char* like_name);
void check_ascending(const Tensor& t, int64_t top, const char* name, const char* what);

int64_t grain(int64_t d, int64_t serial_elements = kSerialElements);
// f over [begin, end) split over torch's threads (at::parallel_for), or on the calling thread
// in a forked child: the OpenMP runtime torch's threads live in cannot start a team in a child
// of a process that used one.
void parallel(int64_t begin, int64_t end, int64_t grain_size,
              const std::function<void(int64_t, int64_t)>& f);
// What a caller does with rows [i0, i1) of a forward right after the engine wrote them, while
// they are in cache (the memory-efficient forward's kept channels).
using RowsHook = std::function<void(const engine::Forward&, int64_t, int64_t)>;
// Rows of a forward between a hook's calls: about this many bytes of 8-byte elements.
constexpr int64_t kHookBytes = int64_t(1) << 18;
void run_forward(const engine::Forward& a, int64_t serial_elements, const RowsHook& after = {});
void run_chunks(engine::Backward a, const Tensor& sums, int64_t serial_elements);

}  // namespace layernorm::op
