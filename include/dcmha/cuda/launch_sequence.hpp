#pragma once
// The kernels a planned call launches, in the order its stream runs them: one definition that
// the device (attention.hpp), the emulator (emulate.hpp) and the cost model walk, so that the
// sequence the emulated tests run is the one the device runs.
#include "launch_plan.hpp"

namespace dcmha::cuda {

/// A kernel of a call's sequence; kernel_name() is the name the emulator logs it under.
enum class Kernel : int {
  forward,                   // the whole forward (keys not split)
  forward_split_statistics,  // split keys: each split's row statistics,
  combine_split_statistics,  //   their combination into the lse,
  forward_split_values,      //   each split's P'V with that lse,
  sum_split_outputs,         //   and the splits' outputs summed
  backward_row_dots,         // MHA's one pass: D = rowsum(dO * O), dQ's sums zeroed,
  backward_one_pass,         //   a round of key blocks (key_rounds launches),
  backward_query_grads,      //   dQ from its sums
  backward_query,            // two sides: the query side,
  backward_key,              //   the key side
  sum_static_grads,          // a static W's gradient, summed from the query side's partials
  sum_head_grads,            // GQA: dK and dV summed over each kv head's query heads
};

inline const char* kernel_name(Kernel k) {
  static constexpr const char* kNames[] = {"forward",
                                           "forward_split_statistics",
                                           "combine_split_statistics",
                                           "forward_split_values",
                                           "sum_split_outputs",
                                           "backward_row_dots",
                                           "backward_one_pass",
                                           "backward_query_grads",
                                           "backward_query",
                                           "backward_key",
                                           "sum_static_grads",
                                           "sum_head_grads"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == int(Kernel::sum_head_grads) + 1);
  return kNames[int(k)];
}

/// The phase a forward kernel's blocks run (`whole` for the kernels that are not the forward's
/// blocks: the split combination and sum).
inline ForwardPhase phase_of(Kernel k) {
  return k == Kernel::forward_split_statistics ? ForwardPhase::split_statistics
         : k == Kernel::forward_split_values   ? ForwardPhase::split_values
                                               : ForwardPhase::whole;
}

/// Whether a forward launch's blocks run the kept-scores kernel (ForwardKernel's kKeptScores:
/// one 16-row tile a warp, its statistics launch storing the composed scores that its values
/// launch reads) rather than the plan's warps. Only a Compose kernel can be asked to.
inline bool runs_kept_scores(const ForwardLaunch& l, Kernel k) {
  return l.geo.scores_kept && phase_of(k) != ForwardPhase::whole;
}

/// Calls f(kernel, 0) for each of a forward's launches (a decode step's too), in stream order.
template <class F>
void for_each_launch(const ForwardLaunch& l, F&& f) {
  if (l.geo.splits == 1) {
    f(Kernel::forward, 0);
    return;
  }
  f(Kernel::forward_split_statistics, 0);
  f(Kernel::combine_split_statistics, 0);
  f(Kernel::forward_split_values, 0);
  f(Kernel::sum_split_outputs, 0);
}

/// Calls f(kernel, round) for each of a backward's launches, in stream order; `round` numbers
/// the one pass's launches (0 elsewhere). `sizes`: the call's scratch (its static partials).
template <class F>
void for_each_launch(const BackwardLaunch& l, const BackwardScratchSizes& sizes, F&& f) {
  if (l.one_pass) {
    f(Kernel::backward_row_dots, 0);
    for (int round = 0; round < l.key_rounds; ++round) f(Kernel::backward_one_pass, round);
    f(Kernel::backward_query_grads, 0);
  } else {
    f(Kernel::backward_query, 0);
    f(Kernel::backward_key, 0);
  }
  if (sizes.static_partials > 0) f(Kernel::sum_static_grads, 0);
  if (l.key.dkv_per_head) f(Kernel::sum_head_grads, 0);
}

/// The number of launches for_each_launch walks.
template <class... Plan>
int launch_count(const Plan&... plan) {
  int n = 0;
  for_each_launch(plan..., [&n](Kernel, int) { ++n; });
  return n;
}

}  // namespace dcmha::cuda
