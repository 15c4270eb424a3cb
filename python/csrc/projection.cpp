// The dynamic weight projection as PyTorch operators (spec section 2), float32 and float64:
//
//   dcmha::dynamic_weights           (x, dw1, qkw, dd, gelu, eps) -> 12 tensors, differentiable
//   dcmha::dynamic_weights_forward   the same, without autograd
//   dcmha::dynamic_weights_backward  (x, dw1, qkw, dd, gelu, eps, douts) -> (dx, ddw1, dqkw, ddd)
//
// Parameters in the official layout: dw1 (E, G, 4, K), qkw (G, 4, K, 2R, M), dd (E, G, 4M); x
// (B, L, E). Outputs, pre then post: qw1, qw2, kw1, kw2 (B, L, G, R, M), qdd, kdd (B, L, G, M),
// which are compose entries 1..6 of each side as the attention op takes them.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <dcmha/dynamic_weights.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "arguments.hpp"
#include "views.hpp"

namespace dcmha_torch {

namespace {

constexpr int kOutputs = 12;  // per side: qw1, qw2, kw1, kw2, qdd, kdd

const char* kParameterNames[] = {"x", "dw1", "qkw", "dd"};

dcmha::ProjectionConfig projection_config(const char* fn, const std::string& gelu, double eps) {
  dcmha::ProjectionConfig cfg;
  TORCH_CHECK(gelu == "erf" || gelu == "tanh", fn, ": gelu: expected \"erf\" or \"tanh\", got \"",
              gelu, "\"");
  cfg.gelu = gelu == "erf" ? dcmha::Gelu::erf : dcmha::Gelu::tanh;
  cfg.eps = eps;
  cfg.num_threads = at::get_num_threads();
  return cfg;
}

void check_inputs(const char* fn, const at::Tensor* inputs[4]) {
  const int ranks[] = {3, 4, 5, 3};
  const char* shapes[] = {"(B, L, E)", "(E, G, 4, K)", "(G, 4, K, 2R, M)", "(E, G, 4M)"};
  const at::ScalarType dtype = inputs[0]->scalar_type();
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *inputs[i];
    TORCH_CHECK(t.device().is_cpu(), fn, ": ", kParameterNames[i], " is on ", t.device(),
                "; this build of dcmha_torch has CPU kernels only");
    TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", kParameterNames[i], " has dtype ",
                t.scalar_type(), ", expected ", dtype, " (x's)");
    TORCH_CHECK(t.dim() == ranks[i], fn, ": ", kParameterNames[i], ": expected ", ranks[i],
                " dims ", shapes[i], ", got ", t.dim());
  }
}

/// Output shapes from the parameters: R from qkw's 2R, M, G from qkw.
std::vector<at::Tensor> empty_outputs(const at::Tensor& x, const at::Tensor& qkw) {
  const int64_t B = x.size(0), L = x.size(1), G = qkw.size(0), R = qkw.size(3) / 2, M = qkw.size(4);
  std::vector<at::Tensor> out;
  for (int i = 0; i < kOutputs; ++i)
    out.push_back(i % 6 < 4 ? at::empty({B, L, G, R, M}, x.options())
                            : at::empty({B, L, G, M}, x.options()));
  return out;
}

template <class T, class Tensors>
dcmha::DynamicWeights<T> weights_of(const Tensors& t) {
  dcmha::DynamicWeights<T> w;
  dcmha::DynamicWeightsSide<T>* sides[] = {&w.pre, &w.post};
  for (int s = 0; s < 2; ++s) {
    const int o = 6 * s;
    sides[s]->qw1 = view_of<T, 5>(t[o + 0]);
    sides[s]->qw2 = view_of<T, 5>(t[o + 1]);
    sides[s]->kw1 = view_of<T, 5>(t[o + 2]);
    sides[s]->kw2 = view_of<T, 5>(t[o + 3]);
    sides[s]->qdd = view_of<T, 4>(t[o + 4]);
    sides[s]->kdd = view_of<T, 4>(t[o + 5]);
  }
  return w;
}

template <class T>
dcmha::DynamicWeightProjection<T> parameters_of(const at::Tensor& dw1, const at::Tensor& qkw,
                                                const at::Tensor& dd) {
  return {view_of<const T, 4>(dw1), view_of<const T, 5>(qkw), view_of<const T, 3>(dd)};
}

std::vector<at::Tensor> dynamic_weights_forward(const at::Tensor& x, const at::Tensor& dw1,
                                                const at::Tensor& qkw, const at::Tensor& dd,
                                                const std::string& gelu, double eps) {
  const char* fn = "dcmha.dynamic_weights";
  const at::Tensor* inputs[] = {&x, &dw1, &qkw, &dd};
  check_inputs(fn, inputs);
  const dcmha::ProjectionConfig cfg = projection_config(fn, gelu, eps);
  std::vector<at::Tensor> out = empty_outputs(x, qkw);
  typed(fn, "x", x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    translating_errors([&] {
      dcmha::dynamic_weights_forward(cfg, view_of<const T, 3>(x), parameters_of<T>(dw1, qkw, dd),
                                     weights_of<T>(out));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dynamic_weights_backward(
    const at::Tensor& x, const at::Tensor& dw1, const at::Tensor& qkw, const at::Tensor& dd,
    const std::string& gelu, double eps, at::TensorList douts) {
  const char* fn = "dcmha.dynamic_weights_backward";
  const at::Tensor* inputs[] = {&x, &dw1, &qkw, &dd};
  check_inputs(fn, inputs);
  TORCH_CHECK(douts.size() == kOutputs, fn, ": douts: expected ", kOutputs, " tensors, got ",
              douts.size());
  const dcmha::ProjectionConfig cfg = projection_config(fn, gelu, eps);
  // An output the loss does not use has no gradient: zeros.
  const std::vector<at::Tensor> shapes = empty_outputs(x, qkw);
  std::vector<at::Tensor> upstream;
  for (int i = 0; i < kOutputs; ++i) {
    upstream.push_back(douts[i].defined() ? douts[i] : at::zeros_like(shapes[i]));
    TORCH_CHECK(upstream[i].scalar_type() == x.scalar_type(), fn, ": douts[", i, "] has dtype ",
                upstream[i].scalar_type(), ", expected ", x.scalar_type());
  }
  at::Tensor dx = at::empty(x.sizes(), x.options()), ddw1 = at::empty(dw1.sizes(), x.options()),
             dqkw = at::empty(qkw.sizes(), x.options()), ddd = at::empty(dd.sizes(), x.options());
  typed(fn, "x", x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    const dcmha::DynamicWeightProjectionGrads<T> grads{view_of<T, 4>(ddw1), view_of<T, 5>(dqkw),
                                                       view_of<T, 3>(ddd)};
    translating_errors([&] {
      dcmha::dynamic_weights_backward(cfg, view_of<const T, 3>(x), parameters_of<T>(dw1, qkw, dd),
                                      weights_of<const T>(upstream), view_of<T, 3>(dx), grads);
    });
  });
  return {dx, ddw1, dqkw, ddd};
}

class ProjectionFunction : public torch::autograd::Function<ProjectionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& dw1,
                                                const at::Tensor& qkw, const at::Tensor& dd,
                                                const std::string& gelu, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dcmha::dynamic_weights_forward", "")
                         .typed<decltype(dynamic_weights_forward)>();
    ctx->save_for_backward({x, dw1, qkw, dd});
    ctx->saved_data["gelu"] = gelu;
    ctx->saved_data["eps"] = eps;
    return op.call(x, dw1, qkw, dd, gelu, eps);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dcmha::dynamic_weights_backward", "")
                         .typed<decltype(dynamic_weights_backward)>();
    auto [dx, ddw1, dqkw, ddd] =
        op.call(saved[0], saved[1], saved[2], saved[3], ctx->saved_data["gelu"].toStringRef(),
                ctx->saved_data["eps"].toDouble(), grads);
    return {dx, ddw1, dqkw, ddd, at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> dynamic_weights_autograd(const at::Tensor& x, const at::Tensor& dw1,
                                                 const at::Tensor& qkw, const at::Tensor& dd,
                                                 const std::string& gelu, double eps) {
  return ProjectionFunction::apply(x, dw1, qkw, dd, gelu, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dcmha, m) {
  m.def(
      "dynamic_weights(Tensor x, Tensor dw1, Tensor qkw, Tensor dd, str gelu=\"erf\", "
      "float eps=1e-6) -> Tensor[]");
  m.def(
      "dynamic_weights_forward(Tensor x, Tensor dw1, Tensor qkw, Tensor dd, str gelu=\"erf\", "
      "float eps=1e-6) -> Tensor[]");
  m.def(
      "dynamic_weights_backward(Tensor x, Tensor dw1, Tensor qkw, Tensor dd, str gelu, "
      "float eps, Tensor[] douts) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dcmha, CPU, m) {
  m.impl("dynamic_weights", dynamic_weights_forward);
  m.impl("dynamic_weights_forward", dynamic_weights_forward);
  m.impl("dynamic_weights_backward", dynamic_weights_backward);
}

TORCH_LIBRARY_IMPL(dcmha, Autograd, m) { m.impl("dynamic_weights", dynamic_weights_autograd); }

}  // namespace dcmha_torch
