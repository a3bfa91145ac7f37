// The ops' autograd on CPU tensors (AutogradCPU).

#include <torch/autograd.h>
#include <torch/library.h>

#include "operator.h"

namespace layernorm::op {
namespace {

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

// What both forwards record beside the tensors they save, and both backwards read back.
struct Flags {
  bool centred, zcg;
  ScalarType x_dtype;
  std::optional<ScalarType> r_dtype;  // the residual's dtype: an add-norm's only

  static void save(AutogradContext* ctx, bool centred, bool zcg, const Tensor& x,
                   const OptTensor& residual) {
    ctx->saved_data["centred"] = centred;
    ctx->saved_data["zcg"] = zcg;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["r_dtype"] =
        residual.has_value() ? static_cast<int64_t>(residual->scalar_type()) : -1;
  }

  static Flags load(AutogradContext* ctx) {
    const int64_t r = ctx->saved_data["r_dtype"].toInt();
    return {ctx->saved_data["centred"].toBool(), ctx->saved_data["zcg"].toBool(),
            static_cast<ScalarType>(ctx->saved_data["x_dtype"].toInt()),
            r < 0 ? std::nullopt : std::optional<ScalarType>(static_cast<ScalarType>(r))};
  }

  // An add-norm's dresidual equals dx where the two share a dtype: one tensor serves both, as
  // autograd's own x + residual does, so the kernel writes one gradient instead of two.
  bool shared() const { return r_dtype.has_value() && *r_dtype == x_dtype; }
};

// The gradients when no kernel runs: none without dy and dh, and dh's alone (h_only) without
// dy; nothing where dy is given.
std::optional<variable_list> without_dy(const Flags& f, const Tensor& dy, const Tensor& dh) {
  if (dy.defined()) return std::nullopt;
  if (!dh.defined()) return variable_list(8);
  return h_only(dh, f.x_dtype, *f.r_dtype);
}

// The op's inputs' gradients as autograd takes them: dresidual for an add-norm alone, dweight
// and dbias where the parameter was given.
variable_list gradients(const Flags& f, const Tensor& dx, const Tensor& dres, const Tensor& dw,
                        const Tensor& db, const Tensor& weight, const Tensor& bias) {
  variable_list out(8);
  out[0] = dx;
  if (f.r_dtype.has_value()) out[1] = dres;
  if (weight.defined()) out[2] = dw;
  if (bias.defined()) out[3] = db;
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
    ctx->save_for_backward({residual.has_value() ? h : x, weight.value_or(Tensor()),
                            bias.value_or(Tensor()), s0, s1});
    ctx->saved_data["eps"] = eps;
    Flags::save(ctx, centred, zero_centered_gamma, x, residual);
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
    const Flags f = Flags::load(ctx);
    const Tensor& dy = grads[0];
    const Tensor dh = f.r_dtype.has_value() ? grads[1] : Tensor();
    if (auto out = without_dy(f, dy, dh)) return *out;
    Tensor dx, dres, dw, db;
    if (at::GradMode::is_enabled()) {  // the backward is being differentiated
      std::tie(dx, dres, dw, db) = composite_backward(dy, dh, xn, weight, bias, eps, f.centred,
                                                      f.zcg, f.x_dtype, f.r_dtype);
    } else {
      std::tie(dx, dres, dw, db) =
          op.call(dy, given(dh), xn, given(weight), given(bias), saved[3], saved[4], f.centred,
                  f.zcg, f.x_dtype, f.shared() ? std::nullopt : f.r_dtype);
      if (f.shared()) dres = dx;
    }
    return gradients(f, dx, dres, dw, db, weight, bias);
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
    ctx->save_for_backward({y, weight.value_or(Tensor()), bias.value_or(Tensor()), s0, s1, keep,
                            kept, rows, xrows});
    Flags::save(ctx, centred, zero_centered_gamma, x, residual);
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
    const Flags f = Flags::load(ctx);
    const Tensor& dy = grads[0];
    const Tensor dh = f.r_dtype.has_value() ? grads[1] : Tensor();
    // without dy there is no norm term: dh's derivative is exact, and differentiable
    if (auto out = without_dy(f, dy, dh)) return *out;
    // the second derivative needs rstd's and the kept xhat's dependence on x, which is not kept
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "layernorm: the backward of a memory_efficient=True norm cannot be "
                "differentiated (create_graph=True, double backward): it "
                "keeps y, not the input whose statistics the second derivative "
                "differentiates; use memory_efficient=False");
    Tensor dx, dres, dw, db;
    std::tie(dx, dres, dw, db) =
        op.call(dy, given(dh), y, given(weight), given(bias), saved[3], saved[4], saved[5],
                saved[6], saved[7], saved[8], f.centred, f.zcg, f.x_dtype,
                f.shared() ? std::nullopt : f.r_dtype);
    if (f.shared()) dres = dx;
    return gradients(f, dx, dres, dw, db, weight, bias);
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

}  // namespace

void register_autograd(torch::Library& m) {
  m.impl("fwd", fwd_autograd);
  m.impl("fwd_y", fwd_y_autograd);
}

}  // namespace layernorm::op
