// The engine's entry points on arrays: the NumPy API's forward and backward into its own
// arrays, and the bandwidth yardstick's copy; with the operator's settings (layernorm_cpu).

#include <torch/library.h>

#include "operator.h"

namespace layernorm::op {
namespace {

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
  const engine::Kernels& k = kernels();
  parallel(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    k.copy_blocks(sp, dp, n, itemsize, b0, b1);
  });
}

}  // namespace
}  // namespace layernorm::op

namespace {
using namespace layernorm::op;  // NOLINT: the entry points below
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
  m.def("_select(str folder, str forced) -> str", select_kernels);
  m.def("_setup(int pool_bytes, float margin, float[] qmax, float[] min_scale) -> ()", setup);
  m.def("_pool_bytes() -> int", pool_bytes);
  m.def("_n_chunks(int m) -> int", engine::n_chunks);
}

