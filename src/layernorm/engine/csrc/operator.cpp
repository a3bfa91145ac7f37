// The operator's shared parts (operator.h): dtypes, parameters, the output pool, checks, and
// the engine's kernels over torch's threads.

#include "operator.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <atomic>
#include <functional>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace layernorm::op {
namespace {
double g_margin = 4.0;
QuantLimits g_quant[2] = {{0.0, 0.0}, {0.0, 0.0}};  // int8, float8_e4m3fn: set by _setup
const engine::Kernels* g_kernels = nullptr;         // set once by select_kernels
}  // namespace

// --- the kernel set ----------------------------------------------------------------------
// The instruction sets the engine is built for, the widest first, each with the test of the
// CPU (and its operating system) that it may run: x86-64-v3 has AVX2, FMA, F16C, BMI2;
// x86-64-v4 adds AVX-512 F, BW, CD, DQ and VL. A CPU with neither (x86-64-v2) would round
// mul_add twice where the kernels fuse it, and get other bits: it gets no kernel set.
struct KernelSet {
  const char* name;
  bool (*runs_here)();
};
const KernelSet kSets[] = {
    {"x86-64-v4", [] { return __builtin_cpu_supports("x86-64-v4") != 0; }},
    {"x86-64-v3", [] { return __builtin_cpu_supports("x86-64-v3") != 0; }},
};

const engine::Kernels& kernels() {
  TORCH_CHECK(g_kernels != nullptr, "layernorm: the engine's kernel set is not loaded");
  return *g_kernels;
}

std::string select_kernels(const std::string& folder, const std::string& forced) {
  static std::mutex once;
  std::lock_guard<std::mutex> lock(once);
  if (g_kernels != nullptr) {
    TORCH_CHECK_VALUE(forced.empty() || forced == g_kernels->set, "layernorm: the kernel set ",
                      g_kernels->set, " is loaded already; ", forced, " cannot replace it");
    return g_kernels->set;
  }
  __builtin_cpu_init();
  const KernelSet* chosen = nullptr;
  std::string names;
  for (const KernelSet& s : kSets) {
    names += (names.empty() ? "" : ", ") + std::string(s.name);
    if (forced.empty() ? s.runs_here() : forced == s.name) {
      chosen = &s;
      break;
    }
  }
  TORCH_CHECK_VALUE(chosen != nullptr || forced.empty(), "LAYERNORM_ISA=", forced,
                    " names no kernel set of the engine (", names, ")");
  TORCH_CHECK_VALUE(chosen != nullptr, "this CPU has neither AVX-512 (x86-64-v4) nor AVX2 "
                    "with FMA (x86-64-v3), which the engine's kernels need");
  TORCH_CHECK_VALUE(chosen->runs_here(), "LAYERNORM_ISA=", forced, " asks for a kernel set "
                    "this CPU cannot run");
  const std::string path = folder + "/kernels-" + chosen->name + ".so";
  // Loaded alone and locally: its symbols (all hidden but the table's entry) resolve nothing
  // outside it, and it is never unloaded.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "layernorm: cannot load ", path, ": ", dlerror());
  auto entry = reinterpret_cast<engine::KernelsEntry>(dlsym(handle, engine::kKernelsSymbol));
  TORCH_CHECK(entry != nullptr, "layernorm: ", path, " has no ", engine::kKernelsSymbol);
  const engine::Kernels* table = entry();
  TORCH_CHECK(table->size == sizeof(engine::Kernels) && std::string(table->set) == chosen->name,
              "layernorm: ", path, " holds another engine's kernels");
  g_kernels = table;
  // The ops' CPU and autograd kernels, registered now that there is a set to run them (kept
  // for the life of the process, as TORCH_LIBRARY_IMPL's registrations are).
  static auto* cpu = new torch::Library(torch::Library::IMPL, "layernorm",
                                        c10::DispatchKey::CPU, __FILE__, __LINE__);
  static auto* autograd = new torch::Library(torch::Library::IMPL, "layernorm",
                                             c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
  register_cpu(*cpu);
  register_autograd(*autograd);
  return g_kernels->set;
}

double margin() { return g_margin; }

QuantLimits quant_limits(bool float8) { return g_quant[float8 ? 1 : 0]; }

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
  if (!p.has_value()) {
    if (cdt == ScalarType::Double) {
      std::fill(buf.begin(), buf.end(), fill);
    } else {
      float* out = reinterpret_cast<float*>(buf.data());
      std::fill(out, out + d, static_cast<float>(fill));
    }
    return buf.data();
  }
  const Tensor pc = p->contiguous();
  kernels().compute_row(pc.const_data_ptr(), dtype_of(pc.scalar_type()), buf.data(),
                        dtype_of(cdt), d, plus_one);
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

void setup(int64_t pool_bytes, double margin, at::ArrayRef<double> qmax,
           at::ArrayRef<double> min_scale) {
  TORCH_CHECK_VALUE(qmax.size() == 2 && min_scale.size() == 2,
                    "layernorm: _setup takes int8's and float8_e4m3fn's qmax and min_scale");
  g_margin = margin;
  for (size_t k = 0; k < 2; ++k) g_quant[k] = {qmax[k], min_scale[k]};
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
// A forked child runs the kernels on its calling thread: the OpenMP runtime torch's threads
// live in cannot start a team in a child of a process that used one (the child waits forever
// on the parent's threads, which it does not have).
std::atomic<bool> g_forked{false};

void reset_after_fork() {
  new (&g_pool_mutex) std::mutex();
  g_forked = true;
}
const int g_atfork = pthread_atfork(nullptr, nullptr, reset_after_fork);

void parallel(int64_t begin, int64_t end, int64_t grain_size,
              const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end) return;
  if (g_forked) {
    f(begin, end);
    return;
  }
  at::parallel_for(begin, end, grain_size, f);
}

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
int64_t grain(int64_t d, int64_t serial_elements) {
  return std::max<int64_t>(1, (serial_elements + d - 1) / std::max<int64_t>(d, 1));
}

// The engine's forward of `a` over torch's threads; with `after`, in steps of rows, each
// step's hook called by the task that wrote them.
void run_forward(const engine::Forward& a, int64_t serial_elements, const RowsHook& after) {
  if (a.m == 0) return;
  const int64_t step = std::max<int64_t>(1, kHookBytes / (8 * a.d));
  parallel(0, a.m, grain(a.d, serial_elements), [&](int64_t i0, int64_t i1) {
    if (!after) {
      kernels().forward_rows(a, i0, i1);
      return;
    }
    for (int64_t s = i0; s < i1; s += step) {
      const int64_t e = std::min(i1, s + step);
      kernels().forward_rows(a, s, e);
      after(a, s, e);
    }
  });
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
  const engine::Kernels& k = kernels();
  parallel(0, c, a.m * a.d < serial_elements ? c : 1, [&](int64_t c0, int64_t c1) {
    if (!k.backward_chunks(a, c0, c1)) ran = false;
  });
  TORCH_CHECK(ran, "layernorm: no CPU kernel for these dtypes: dy must compute in scale's dtype, "
              "and in the default mode the rows too");
  k.reduce_chunks(a.partial, out, c, a.d);
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

}  // namespace layernorm::op
