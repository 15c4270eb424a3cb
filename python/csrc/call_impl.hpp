#pragma once
// The typed CPU calls: views of the torch tensors into dcmha::forward / dcmha::backward, outputs
// allocated here, one Workspace per calling thread kept between calls.
#include <ATen/Parallel.h>

#include <dcmha/attention.hpp>

#include "arguments.hpp"
#include "call.hpp"
#include "views.hpp"

namespace dcmha_torch {

namespace detail {

inline dcmha::AttentionConfig config_of(const Settings& s) {
  dcmha::AttentionConfig cfg;
  cfg.mask = s.causal ? dcmha::Mask::causal : dcmha::Mask::full;
  cfg.window = s.window;
  cfg.scale = s.scale;
  cfg.query_lengths = view_of<const dcmha::index_t, 1>(s.query_lengths);
  cfg.key_lengths = view_of<const dcmha::index_t, 1>(s.key_lengths);
  cfg.num_threads = at::get_num_threads();
  cfg.products = s.storage_type_products ? dcmha::Products::storage_type : dcmha::Products::exact;
  return cfg;
}

inline dcmha::Workspace& thread_workspace() {
  thread_local dcmha::Workspace workspace;
  return workspace;
}

inline at::ScalarType accumulator_type(at::ScalarType storage) {
  return storage == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace detail

template <class T>
ForwardResult forward_cpu(const ForwardArgs& a) {
  using Acc = dcmha::acc_t<T>;
  const int64_t B = a.q.size(0), H = a.q.size(1), T_len = a.q.size(2), Dv = a.v.size(3);
  ForwardResult r;
  r.out = at::empty({B, H, T_len, Dv}, a.q.options());
  r.lse =
      at::empty({B, H, T_len}, a.q.options().dtype(detail::accumulator_type(a.q.scalar_type())));
  const dcmha::ComposeWeights<T> compose = compose_weights<T>(a.compose);
  translating_errors([&] {
    dcmha::forward(detail::config_of(a.settings), view_of<const T, 4>(a.q),
                   view_of<const T, 4>(a.k), view_of<const T, 4>(a.v), view_of<T, 4>(r.out),
                   view_of<Acc, 3>(r.lse), compose, detail::thread_workspace());
  });
  return r;
}

template <class T>
BackwardResult backward_cpu(const BackwardArgs& a) {
  using Acc = dcmha::acc_t<T>;
  const ForwardArgs& in = a.inputs;
  BackwardResult r;
  r.dq = at::empty(in.q.sizes(), in.q.options());
  r.dk = at::empty(in.k.sizes(), in.k.options());
  r.dv = at::empty(in.v.sizes(), in.v.options());
  for (int e = 0; e < kComposeEntries; ++e)
    if (in.compose[e].defined()) r.dcompose[e] = at::empty(in.compose[e].sizes(), in.q.options());
  const dcmha::ComposeWeights<T> compose = compose_weights<T>(in.compose);
  const dcmha::ComposeGrads<T> dcompose = compose_grads<T>(r.dcompose);
  translating_errors([&] {
    dcmha::backward(detail::config_of(in.settings), view_of<const T, 4>(in.q),
                    view_of<const T, 4>(in.k), view_of<const T, 4>(in.v),
                    view_of<const Acc, 3>(a.lse), view_of<const T, 4>(a.dout), view_of<T, 4>(r.dq),
                    view_of<T, 4>(r.dk), view_of<T, 4>(r.dv), compose, dcompose,
                    detail::thread_workspace());
  });
  return r;
}

}  // namespace dcmha_torch

/// Explicit instances, inside namespace dcmha_torch.
#define DCMHA_TORCH_INSTANTIATE(T)                           \
  template ForwardResult forward_cpu<T>(const ForwardArgs&); \
  template BackwardResult backward_cpu<T>(const BackwardArgs&);
