// The dcmha operators for PyTorch (TORCH_LIBRARY(dcmha)), their CPU kernels and the autograd
// kernel, so that the same ops serve Python (dcmha_torch) and libtorch C++ programs:
//
//   dcmha::attention           (q, k, v, compose, causal, window, scale, query_lengths,
//                               key_lengths) -> out; differentiable in q, k, v and every compose
//                               entry
//   dcmha::attention_forward   the same arguments -> (out, lse)
//   dcmha::attention_backward  (..., lse, dout) -> (dq, dk, dv, dcompose): dcompose holds the
//                               gradients of the given compose entries, in their order
//
// `compose` is empty (multi-head attention) or 14 optional tensors: pre (sw, qw1, qw2, kw1, kw2,
// qdd, kdd), then post, in the official layouts ((N, N), (B, L, R, N), (B, L, N)) or dcmha's
// ((G, M, M), (B, L, G, R, M), (B, L, G, M)).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "call.hpp"
#include "views.hpp"

namespace dcmha_torch {

namespace {

constexpr const char* kEntryNames[kSideEntries] = {"sw", "qw1", "qw2", "kw1", "kw2", "qdd", "kdd"};

OptionalTensorList list_of(const ComposeEntries& e) {
  OptionalTensorList list;
  for (const at::Tensor& t : e)
    list.push_back(t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt);
  return list;
}

Settings settings_of(bool causal, int64_t window, double scale,
                     const c10::optional<at::Tensor>& query_lengths,
                     const c10::optional<at::Tensor>& key_lengths, bool storage_type_products) {
  Settings s;
  s.causal = causal, s.window = window, s.scale = scale;
  s.storage_type_products = storage_type_products;
  if (query_lengths) s.query_lengths = *query_lengths;
  if (key_lengths) s.key_lengths = *key_lengths;
  return s;
}

/// The defined tensors, in order (a Tensor[] result holds no undefined tensors: they would not
/// survive a trip through Python, as torch.compile's tracing makes).
std::vector<at::Tensor> given(const ComposeEntries& e) {
  std::vector<at::Tensor> defined;
  for (const at::Tensor& t : e)
    if (t.defined()) defined.push_back(t);
  return defined;
}

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

void check_tensor(const char* fn, const std::string& name, const at::Tensor& t,
                  at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " is on ", t.device(),
              "; this build of dcmha_torch has CPU kernels only");
  TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", name, " has dtype ", t.scalar_type(),
              ", expected ", dtype, " (q's)");
}

}  // namespace

const char* entry_name(int entry) { return kEntryNames[entry % kSideEntries]; }

void check_arguments(const char* fn, const ForwardArgs& a) {
  const at::ScalarType dtype = a.q.scalar_type();
  const char* names[] = {"q", "k", "v"};
  const at::Tensor* qkv[] = {&a.q, &a.k, &a.v};
  for (int i = 0; i < 3; ++i) {
    check_tensor(fn, names[i], *qkv[i], dtype);
    TORCH_CHECK(qkv[i]->dim() == 4, fn, ": ", names[i], ": expected 4 dims (",
                i == 0 ? "B, H, T, D" : "B, Hk, S, D", "), got ", qkv[i]->dim());
  }
  for (int e = 0; e < kComposeEntries; ++e) {
    const at::Tensor& t = a.compose[e];
    if (!t.defined()) continue;
    const std::string name =
        std::string("compose ") + (e < kSideEntries ? "pre " : "post ") + entry_name(e);
    check_tensor(fn, name, t, dtype);
    const int rank = dcmha_rank(e);
    static const char* official[] = {"(N, N)", "(B, L, R, N)", "(B, L, N)"};
    static const char* grouped[] = {"(G, M, M)", "(B, L, G, R, M)", "(B, L, G, M)"};
    const int kind = rank == 3 ? 0 : rank == 5 ? 1 : 2;
    TORCH_CHECK(t.dim() == rank || t.dim() == rank - 1, fn, ": ", name, ": expected ", rank - 1,
                " dims ", official[kind], " or ", rank, " ", grouped[kind], ", got ", t.dim());
  }
  check_lengths(fn, "query_lengths", a.settings.query_lengths);
  check_lengths(fn, "key_lengths", a.settings.key_lengths);
  TORCH_CHECK(a.settings.scale >= 0.0, fn, ": scale: expected > 0 (0 for 1/sqrt(D)), got ",
              a.settings.scale);
}

namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensorList& compose, bool causal, int64_t window, double scale,
    const c10::optional<at::Tensor>& query_lengths, const c10::optional<at::Tensor>& key_lengths,
    bool storage_type_products) {
  const char* fn = "dcmha.attention_forward";
  const ComposeEntries entries = entries_of(fn, "compose", compose);
  const Settings s =
      settings_of(causal, window, scale, query_lengths, key_lengths, storage_type_products);
  const ForwardArgs args{q, k, v, entries, s};
  check_arguments(fn, args);
  const ForwardResult r =
      typed(fn, "q", q.scalar_type(), [&](auto type) { return forward_cpu<decltype(type)>(args); });
  return {r.out, r.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>> attention_backward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensorList& compose, const at::Tensor& lse, const at::Tensor& dout, bool causal,
    int64_t window, double scale, const c10::optional<at::Tensor>& query_lengths,
    const c10::optional<at::Tensor>& key_lengths, bool storage_type_products) {
  const char* fn = "dcmha.attention_backward";
  const ComposeEntries entries = entries_of(fn, "compose", compose);
  const Settings s =
      settings_of(causal, window, scale, query_lengths, key_lengths, storage_type_products);
  const ForwardArgs inputs{q, k, v, entries, s};
  check_arguments(fn, inputs);
  check_tensor(fn, "dout", dout, q.scalar_type());
  const at::ScalarType lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == lse_type && lse.device().is_cpu(), fn, ": lse: expected a CPU ",
              lse_type, " tensor (attention_forward's), got ", lse.scalar_type(), " on ",
              lse.device());
  TORCH_CHECK(dout.dim() == 4 && lse.dim() == 3, fn, ": dout: expected 4 dims, lse 3; got ",
              dout.dim(), " and ", lse.dim());
  // Upstream gradients are often expanded (zero strides) or permuted; the kernels need unit
  // stride along the head dim only.
  const at::Tensor d = dout.stride(3) == 1 || dout.size(3) == 1 ? dout : dout.contiguous();
  const BackwardArgs args{inputs, lse, d};
  const BackwardResult r = typed(fn, "q", q.scalar_type(),
                                 [&](auto type) { return backward_cpu<decltype(type)>(args); });
  return {r.dq, r.dk, r.dv, given(r.dcompose)};
}

/// The differentiable op: the forward op, its lse kept for the backward op.
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  /// The compose entries come last, one optional tensor each: autograd tracks those present.
  template <class... Entries>
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const Settings& s,
                            const Entries&... compose) {
    static_assert(sizeof...(Entries) == kComposeEntries);
    at::AutoDispatchBelowADInplaceOrView guard;
    const ComposeEntries entries = {compose.value_or(at::Tensor())...};
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dcmha::attention_forward", "")
                         .typed<decltype(attention_forward_cpu)>();
    auto [out, lse] =
        op.call(q, k, v, list_of(entries), s.causal, s.window, s.scale,
                optional_of(s.query_lengths), optional_of(s.key_lengths), s.storage_type_products);
    std::vector<at::Tensor> saved = {q, k, v, lse, s.query_lengths, s.key_lengths};
    saved.insert(saved.end(), entries.begin(), entries.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["causal"] = s.causal;
    ctx->saved_data["window"] = s.window;
    ctx->saved_data["scale"] = s.scale;
    ctx->saved_data["storage_type_products"] = s.storage_type_products;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    ComposeEntries entries;
    for (int e = 0; e < kComposeEntries; ++e) entries[e] = saved[6 + e];
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dcmha::attention_backward", "")
                         .typed<decltype(attention_backward_cpu)>();
    auto [dq, dk, dv, dcompose] =
        op.call(saved[0], saved[1], saved[2], list_of(entries), saved[3], grads[0],
                ctx->saved_data["causal"].toBool(), ctx->saved_data["window"].toInt(),
                ctx->saved_data["scale"].toDouble(), optional_of(saved[4]), optional_of(saved[5]),
                ctx->saved_data["storage_type_products"].toBool());
    torch::autograd::variable_list result = {dq, dk, dv};
    result.emplace_back();  // the settings
    size_t next = 0;
    for (int e = 0; e < kComposeEntries; ++e)
      result.push_back(entries[e].defined() ? dcompose.at(next++) : at::Tensor());
    return result;
  }
};

template <size_t... Entry>
at::Tensor apply_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const Settings& s, const ComposeEntries& e,
                           std::index_sequence<Entry...>) {
  return AttentionFunction::apply(q, k, v, s, optional_of(e[Entry])...);
}

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const OptionalTensorList& compose, bool causal, int64_t window,
                              double scale, const c10::optional<at::Tensor>& query_lengths,
                              const c10::optional<at::Tensor>& key_lengths,
                              bool storage_type_products) {
  const ComposeEntries entries = entries_of("dcmha.attention", "compose", compose);
  return apply_attention(
      q, k, v,
      settings_of(causal, window, scale, query_lengths, key_lengths, storage_type_products),
      entries, std::make_index_sequence<kComposeEntries>());
}

/// Without autograd (inference mode, or below the autograd kernel): the forward op's output.
at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const OptionalTensorList& compose, bool causal, int64_t window,
                         double scale, const c10::optional<at::Tensor>& query_lengths,
                         const c10::optional<at::Tensor>& key_lengths, bool storage_type_products) {
  return std::get<0>(attention_forward_cpu(q, k, v, compose, causal, window, scale, query_lengths,
                                           key_lengths, storage_type_products));
}

/// Shapes only (the Meta backend: torch.compile's fake tensors, opcheck), checked as the CPU
/// kernels check them wherever a shape decides the outputs' shapes.
std::tuple<at::Tensor, at::Tensor> attention_forward_meta(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const OptionalTensorList& compose, bool,
                                                          int64_t, double,
                                                          const c10::optional<at::Tensor>&,
                                                          const c10::optional<at::Tensor>&, bool) {
  const char* fn = "dcmha.attention_forward";
  entries_of(fn, "compose", compose);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn,
              ": q, k, v: expected 4 dims each, got ", q.dim(), ", ", k.dim(), ", ", v.dim());
  const at::ScalarType lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options()),
          at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(lse_type))};
}

at::Tensor attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const OptionalTensorList& compose, bool causal, int64_t window,
                          double scale, const c10::optional<at::Tensor>& query_lengths,
                          const c10::optional<at::Tensor>& key_lengths,
                          bool storage_type_products) {
  return std::get<0>(attention_forward_meta(q, k, v, compose, causal, window, scale, query_lengths,
                                            key_lengths, storage_type_products));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>> attention_backward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensorList& compose, const at::Tensor&, const at::Tensor&, bool, int64_t, double,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, bool) {
  const ComposeEntries entries = entries_of("dcmha.attention_backward", "compose", compose);
  std::vector<at::Tensor> dcompose;
  for (const at::Tensor& e : entries)
    if (e.defined()) dcompose.push_back(at::empty(e.sizes(), e.options()));
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()),
          at::empty(v.sizes(), v.options()), dcompose};
}

}  // namespace

#define DCMHA_TORCH_ATTENTION_ARGS                                                    \
  "Tensor q, Tensor k, Tensor v, Tensor?[] compose, bool causal=True, int window=0, " \
  "float scale=0., Tensor? query_lengths=None, Tensor? key_lengths=None, "            \
  "bool storage_type_products=False"

TORCH_LIBRARY(dcmha, m) {
  m.def("attention(" DCMHA_TORCH_ATTENTION_ARGS ") -> Tensor");
  m.def("attention_forward(" DCMHA_TORCH_ATTENTION_ARGS ") -> (Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor q, Tensor k, Tensor v, Tensor?[] compose, Tensor lse, "
      "Tensor dout, bool causal, int window, float scale, Tensor? query_lengths, "
      "Tensor? key_lengths, bool storage_type_products=False) -> "
      "(Tensor, Tensor, Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(dcmha, CPU, m) {
  m.impl("attention", attention_cpu);
  m.impl("attention_forward", attention_forward_cpu);
  m.impl("attention_backward", attention_backward_cpu);
}

TORCH_LIBRARY_IMPL(dcmha, Meta, m) {
  m.impl("attention", attention_meta);
  m.impl("attention_forward", attention_forward_meta);
  m.impl("attention_backward", attention_backward_meta);
}

TORCH_LIBRARY_IMPL(dcmha, Autograd, m) { m.impl("attention", attention_autograd); }

}  // namespace dcmha_torch
