#pragma once
// The CPU backward's launch: the call's plan (launch_plan.hpp), dK / dV accumulators and static
// weight gradient slots, and the OpenMP region of the chosen mode running BackwardKernel.
//
//   independent_items  many items (batch x kv-head clusters): each thread takes whole ones with
//                      a set of panels of its own
//   shared_keys        the team shares each block's key tiles (TileQueue), one set of panels
#include <optional>
#include <type_traits>

#include "../params.hpp"
#include "../workspace.hpp"
#include "backward_kernel.hpp"
#include "launch_plan.hpp"
#include "parallel.hpp"

namespace dcmha::cpu {

/// What both modes of one backward call share.
template <class T>
struct BackwardLaunch : LaunchBase<T, detail::BackwardParams<T>> {
  using A = acc_t<T>;
  using LaunchBase<T, detail::BackwardParams<T>>::params;
  BackwardItems items;
  index_t panel_set;  // Workspace values of one set of panels
  // Static weights' gradients: one M x M accumulator per (batch, group), summed over the batch in
  // a fixed order at the end, so the result does not depend on which thread ran which item.
  Buffer<A> dw_pre, dw_post;
  // dK and dV sum over every query block: with narrow storage, in float accumulators, rounded
  // once at the end (bf16 sums over hundreds of blocks would lose the gradient's low bits).
  KeyValueGrads<A> grads;

  BackwardLaunch(const detail::BackwardParams<T>& p, int threads, Workspace& mem)
      : LaunchBase<T, detail::BackwardParams<T>>(p, threads),
        items(p.dims),
        panel_set(BackwardWorkspace<A>::memory_size(p.dims, this->mask, p.compose, items.count)) {
    const detail::AttentionDims& d = p.dims;
    const index_t slots = d.B * d.G * d.M * d.M;
    dw_pre.assign(p.compose.pre.static_w ? slots : 0, A(0));
    dw_post.assign(p.compose.post.static_w ? slots : 0, A(0));
    if constexpr (!std::is_same_v<T, A>) {
      const index_t nk = d.B * d.Hk * d.S;
      A* acc = detail::WorkspaceAccess::shared<A>(mem, 1, nk * (d.D + d.Dv));
      grads.dk = bhtd(acc, d.B, d.Hk, d.S, d.D);
      grads.dv = bhtd(acc + nk * d.D, d.B, d.Hk, d.S, d.Dv);
    } else {
      grads.dk = p.dk;
      grads.dv = p.dv;
    }
  }

  A* dw_slot(Buffer<A>& buf, index_t b, index_t g) {
    const detail::AttentionDims& d = params.dims;
    return buf.empty() ? nullptr : buf.data() + (b * d.G + g) * d.M * d.M;
  }
  void run_group(BackwardKernel<T, A>& kernel, index_t b, index_t g) {
    kernel.run(b, g, dw_slot(dw_pre, b, g), dw_slot(dw_post, b, g));
  }

  /// The static weights' gradients summed over the batch into the caller's tensors.
  void store_static_grads() {
    const detail::AttentionDims& d = params.dims;
    for (const bool post : {false, true}) {
      Buffer<A>& parts = post ? dw_post : dw_pre;
      const TensorView<T, 3>& out = post ? params.dcompose.post.w : params.dcompose.pre.w;
      if (parts.empty()) continue;
      for (index_t g = 0; g < d.G; ++g)
        for (index_t m = 0; m < d.M; ++m)
          for (index_t n = 0; n < d.M; ++n) {
            A s = 0;
            for (index_t b = 0; b < d.B; ++b) s += dw_slot(parts, b, g)[m * d.M + n];
            out(g, m, n) = T(s);
          }
    }
  }
};

/// One item: its kv heads' dK and dV accumulators zeroed, its groups, and (narrow storage) its
/// dK and dV rounded into the caller's tensors.
template <class T>
void backward_item(BackwardLaunch<T>& launch, BackwardKernel<T, acc_t<T>>& kernel, index_t item) {
  const detail::AttentionDims& d = launch.params.dims;
  const index_t per_item = launch.items.groups_per_item, group_of_kv = d.H / d.Hk;
  const index_t b = item / (d.G / per_item), g0 = item % (d.G / per_item) * per_item;
  const index_t hk0 = g0 * d.M / group_of_kv, hk1 = (g0 + per_item) * d.M / group_of_kv;
  for (index_t hk = hk0; hk < hk1; ++hk)
    for (index_t s = 0; s < d.S; ++s) {
      mutable_rows_of(launch.grads.dk, b, hk, s, 1).setZero();
      mutable_rows_of(launch.grads.dv, b, hk, s, 1).setZero();
    }
  for (index_t g = g0; g < g0 + per_item; ++g) launch.run_group(kernel, b, g);
  if constexpr (BackwardLaunch<T>::kNarrow) {
    detail_bwd::narrow_rows(launch.grads.dk, launch.params.dk, (b * d.Hk + hk0) * d.S,
                            (b * d.Hk + hk1) * d.S);
    detail_bwd::narrow_rows(launch.grads.dv, launch.params.dv, (b * d.Hk + hk0) * d.S,
                            (b * d.Hk + hk1) * d.S);
  }
}

/// Each thread takes whole items with a set of panels of its own.
template <class T>
void backward_independent_items(BackwardLaunch<T>& launch, Workspace& mem, RegionErrors& errors) {
  using A = acc_t<T>;
  const detail::BackwardParams<T>& p = launch.params;
  A* panels = launch.thread_panels(mem, launch.panel_set);
#pragma omp parallel num_threads(launch.threads)
  {
    BackwardWorkspace<A> ws;
    std::optional<BackwardThreadBuffers<A>> buffers;
    const Team one{0, 1};
    errors.attempt([&] {
      ws.init(p.dims, launch.mask, p.compose, 1, launch.items.count,
              panels + thread_id() * launch.panel_set, launch.bf16_products);
      buffers.emplace(ws, p.dims, mem, thread_id());
    });
    barrier();
    if (!errors.failed()) {
      BackwardKernel<T, A> kernel(p, launch.mask, one, ws, *buffers, launch.grads);
#pragma omp for schedule(dynamic, 1)
      for (index_t it = 0; it < launch.items.count; ++it) backward_item(launch, kernel, it);
    }
  }
}

/// The team shares every group's key tiles.
template <class T>
void backward_shared_keys(BackwardLaunch<T>& launch, Workspace& mem, RegionErrors& errors) {
  using A = acc_t<T>;
  const detail::BackwardParams<T>& p = launch.params;
  BackwardWorkspace<A> ws;
  ws.init(p.dims, launch.mask, p.compose, launch.threads, launch.items.count,
          detail::WorkspaceAccess::shared<A>(mem, 0, launch.panel_set), launch.bf16_products);
#pragma omp parallel num_threads(launch.threads)
  {
    const Team team{thread_id(), team_size()};
    std::optional<BackwardThreadBuffers<A>> buffers;
    errors.attempt([&] { buffers.emplace(ws, p.dims, mem, thread_id()); });
    barrier();
    if (!errors.failed()) {
      detail_bwd::zero_rows(launch.grads.dk, team.rank, team.size);
      detail_bwd::zero_rows(launch.grads.dv, team.rank, team.size);
      team.sync();
      BackwardKernel<T, A> kernel(p, launch.mask, team, ws, *buffers, launch.grads);
      for (index_t b = 0; b < p.dims.B; ++b)
        for (index_t g = 0; g < p.dims.G; ++g) launch.run_group(kernel, b, g);
      if constexpr (BackwardLaunch<T>::kNarrow) {  // run() ends at a barrier: all blocks added
        index_t r0, r1;
        split_range(0, p.dims.B * p.dims.Hk * p.dims.S, team.rank, team.size, 1, r0, r1);
        detail_bwd::narrow_rows(launch.grads.dk, p.dk, r0, r1);
        detail_bwd::narrow_rows(launch.grads.dv, p.dv, r0, r1);
      }
    }
  }
}

/// The backward of one validated call. `mem`: where the panels go (see forward()).
template <class T>
void backward(const detail::BackwardParams<T>& params, Workspace& mem) {
  const int threads = thread_count(params.num_threads);
  check_buffer_sizes(params.dims, params.compose, threads);
  detail::WorkspaceAccess::reserve_slots(mem, threads);
  BackwardLaunch<T> launch(params, threads, mem);
  RegionErrors errors;
  if (independent_items(launch.items.count, threads))
    backward_independent_items(launch, mem, errors);
  else
    backward_shared_keys(launch, mem, errors);
  errors.rethrow_first();
  launch.store_static_grads();
}

}  // namespace dcmha::cpu
