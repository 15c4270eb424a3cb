// A libtorch C++ program using dcmha's registered operators (no Python): forward and backward of
// MHA and of DCMHA through torch's autograd, checked against the same math written with torch's
// own ops (MHA) and against the backward operator called directly (DCMHA). Exits non-zero on a
// mismatch. Usage: libtorch_attention (linked to libdcmha_torch_ops).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <vector>

namespace {

using OptionalTensors = c10::List<c10::optional<at::Tensor>>;

int failures = 0;

void expect_close(const char* what, const at::Tensor& got, const at::Tensor& expected,
                  double tolerance) {
  const double error = (got - expected).abs().max().item<double>() /
                       std::max(expected.abs().max().item<double>(), 1e-30);
  const bool ok = error <= tolerance;
  failures += !ok;
  std::printf("%-40s relative error %.3g %s\n", what, error, ok ? "ok" : "FAILED");
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const OptionalTensors& compose, bool causal) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dcmha::attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const OptionalTensors&, bool, int64_t, double,
                                         const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&, bool)>();
  return op.call(q, k, v, compose, causal, 0, 0.0, c10::nullopt, c10::nullopt, false);
}

void mha() {
  const auto options = torch::dtype(torch::kFloat64);
  at::Tensor q = torch::randn({2, 3, 5, 8}, options).requires_grad_();
  at::Tensor k = torch::randn({2, 3, 5, 8}, options).requires_grad_();
  at::Tensor v = torch::randn({2, 3, 5, 8}, options).requires_grad_();
  const at::Tensor out = attention(q, k, v, OptionalTensors(), true);
  const at::Tensor mask = torch::ones({5, 5}, torch::kBool).tril();
  const at::Tensor scores =
      (torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(8.0)).masked_fill(~mask, -INFINITY);
  const at::Tensor expected = torch::matmul(torch::softmax(scores, -1), v);
  expect_close("MHA out", out, expected, 1e-12);
  const at::Tensor dout = torch::randn_like(out);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {dout});
  const auto expected_grads = torch::autograd::grad({expected}, {q, k, v}, {dout});
  const char* names[] = {"MHA dq", "MHA dk", "MHA dv"};
  for (int i = 0; i < 3; ++i) expect_close(names[i], grads[i], expected_grads[i], 1e-10);
}

void dcmha_compose() {
  const int64_t B = 2, H = 4, T = 6, D = 8, R = 2;
  const auto options = torch::dtype(torch::kFloat64);
  at::Tensor q = torch::randn({B, H, T, D}, options).requires_grad_();
  at::Tensor k = torch::randn({B, H, T, D}, options).requires_grad_();
  at::Tensor v = torch::randn({B, H, T, D}, options).requires_grad_();
  // pre and post: query-wise and key-wise terms in the official layouts, no static W.
  std::vector<at::Tensor> leaves;
  OptionalTensors compose;
  for (int side = 0; side < 2; ++side) {
    compose.push_back(c10::nullopt);  // sw
    for (int i = 0; i < 4; ++i) {
      leaves.push_back((0.3 * torch::randn({B, T, R, H}, options)).requires_grad_());
      compose.push_back(leaves.back());
    }
    for (int i = 0; i < 2; ++i) {
      leaves.push_back((0.3 * torch::randn({B, T, H}, options)).requires_grad_());
      compose.push_back(leaves.back());
    }
  }
  const at::Tensor out = attention(q, k, v, compose, true);
  const at::Tensor dout = torch::randn_like(out);
  std::vector<at::Tensor> inputs = {q, k, v};
  inputs.insert(inputs.end(), leaves.begin(), leaves.end());
  const auto grads = torch::autograd::grad({out}, inputs, {dout});

  static auto forward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dcmha::attention_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensors&, bool,
              int64_t, double, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
              bool)>();
  static auto backward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dcmha::attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensors&,
              const at::Tensor&, const at::Tensor&, bool, int64_t, double,
              const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, bool)>();
  torch::NoGradGuard no_grad;
  const auto [out_direct, lse] =
      forward.call(q, k, v, compose, true, 0, 0.0, c10::nullopt, c10::nullopt, false);
  expect_close("DCMHA out, autograd op = forward op", out, out_direct, 0.0);
  const auto [dq, dk, dv, dcompose] =
      backward.call(q, k, v, compose, lse, dout, true, 0, 0.0, c10::nullopt, c10::nullopt, false);
  expect_close("DCMHA dq", grads[0], dq, 0.0);
  expect_close("DCMHA dk", grads[1], dk, 0.0);
  expect_close("DCMHA dv", grads[2], dv, 0.0);
  // The backward op returns the given entries' gradients, in their order.
  if (dcompose.size() != leaves.size()) {
    std::printf("expected %zu compose gradients, got %zu\n", leaves.size(), dcompose.size());
    ++failures;
  }
  for (size_t i = 0; i < std::min(dcompose.size(), leaves.size()); ++i)
    expect_close("DCMHA compose entry gradient", grads[3 + i], dcompose[i], 0.0);
}

}  // namespace

int main() {
  torch::manual_seed(0);
  mha();
  dcmha_compose();
  std::printf("%s\n", failures ? "libtorch_attention: FAILED" : "libtorch_attention: all passed");
  return failures ? 1 : 0;
}
