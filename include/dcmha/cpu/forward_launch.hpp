#pragma once
// The CPU forward's launch: the call's plan (launch_plan.hpp), its buffers carved from the
// Workspace, and the OpenMP region of the chosen mode running ForwardKernel.
//
//   independent_items  many (batch, group) items: each thread takes whole ones, a panel each
//   private_blocks     few items, many query blocks: the team loads an item's compose inputs,
//                      then each thread takes whole blocks with a private panel, largest causal
//                      blocks first, so the dynamic schedule ends on small ones
//   shared_keys        few rows (decoding, short prompts): the team shares each block's keys
#include <optional>
#include <type_traits>

#include "../params.hpp"
#include "../workspace.hpp"
#include "forward_kernel.hpp"
#include "launch_plan.hpp"
#include "parallel.hpp"

namespace dcmha::cpu {

/// What every mode of one forward call shares.
template <class T>
struct ForwardLaunch : LaunchBase<T, detail::ForwardParams<T>> {
  using A = acc_t<T>;
  index_t items, Bq, blocks;
  index_t private_size;  // Workspace values of one thread's own panel

  ForwardLaunch(const detail::ForwardParams<T>& p, int threads)
      : LaunchBase<T, detail::ForwardParams<T>>(p, threads),
        items(p.dims.B * p.dims.G),
        Bq(forward_block_rows<A>(p.dims, this->mask, threads)),
        blocks((p.dims.T + Bq - 1) / Bq),
        private_size(ForwardWorkspace<A>::memory_size(p.dims, this->mask, 1, Bq)) {}

  index_t batch_of(index_t item) const { return item / this->params.dims.G; }
  index_t group_of(index_t item) const { return item % this->params.dims.G; }
};

/// Each thread takes whole (batch, group) items and never waits on another.
template <class T>
void forward_independent_items(const ForwardLaunch<T>& launch, Workspace& mem,
                               RegionErrors& errors) {
  using A = acc_t<T>;
  const detail::ForwardParams<T>& p = launch.params;
  A* panels = launch.thread_panels(mem, launch.private_size);
#pragma omp parallel num_threads(launch.threads)
  {
    const Team one{0, 1};
    ForwardWorkspace<A> ws;
    ComposeSides<A> sides;
    std::optional<ForwardRows<A>> rows;
    errors.attempt([&] {
      ws.init(p.dims, launch.mask, 1, launch.Bq, panels + thread_id() * launch.private_size);
      sides.init(p.dims, p.compose, p.keys);
      rows.emplace(sides, ws, p.dims, launch.kNarrow, launch.bf16_products);
    });
    barrier();
    if (!errors.failed()) {
      ForwardKernel<T, A> kernel(p, launch.mask, one, ws, *rows, sides);
#pragma omp for schedule(dynamic, 1)
      for (index_t it = 0; it < launch.items; ++it) {
        sides.load(one, p.compose, p.dims.S, launch.batch_of(it), launch.group_of(it), p.keys);
        kernel.run(launch.batch_of(it), launch.group_of(it), 0, launch.blocks);
      }
    }
  }
}

/// The team loads each item's compose inputs together; each thread then takes whole query
/// blocks with a private panel (no barriers inside a block).
template <class T>
void forward_private_blocks(const ForwardLaunch<T>& launch, ComposeSides<acc_t<T>>& sides,
                            Workspace& mem, RegionErrors& errors) {
  using A = acc_t<T>;
  const detail::ForwardParams<T>& p = launch.params;
  A* panels = launch.thread_panels(mem, launch.private_size);
#pragma omp parallel num_threads(launch.threads)
  {
    const Team team{thread_id(), team_size()}, one{0, 1};
    ForwardWorkspace<A> ws;
    std::optional<ForwardRows<A>> rows;
    errors.attempt([&] {
      ws.init(p.dims, launch.mask, 1, launch.Bq, panels + team.rank * launch.private_size);
      rows.emplace(sides, ws, p.dims, launch.kNarrow, launch.bf16_products);
    });
    barrier();
    if (!errors.failed()) {
      ForwardKernel<T, A> kernel(p, launch.mask, one, ws, *rows, sides);
      for (index_t it = 0; it < launch.items; ++it) {
        sides.load(team, p.compose, p.dims.S, launch.batch_of(it), launch.group_of(it), p.keys);
#pragma omp for schedule(dynamic, 1)
        for (index_t blk = launch.blocks - 1; blk >= 0; --blk)
          kernel.run(launch.batch_of(it), launch.group_of(it), blk, blk + 1);
      }
    }
  }
}

/// The whole team shares each block's keys. The panel has one run of slabs per rank, each long
/// enough for a rank's share of the keys: sized for the team OpenMP really gave (fewer threads
/// than asked under OMP_THREAD_LIMIT or OMP_DYNAMIC).
template <class T>
void forward_shared_keys(const ForwardLaunch<T>& launch, ComposeSides<acc_t<T>>& sides,
                         Workspace& mem, RegionErrors& errors) {
  using A = acc_t<T>;
  const detail::ForwardParams<T>& p = launch.params;
  ForwardWorkspace<A> ws;
#pragma omp parallel num_threads(launch.threads)
  {
    const Team team{thread_id(), team_size()};
#pragma omp single
    errors.attempt([&] {
      const index_t size =
          ForwardWorkspace<A>::memory_size(p.dims, launch.mask, team.size, launch.Bq);
      ws.init(p.dims, launch.mask, team.size, launch.Bq,
              detail::WorkspaceAccess::shared<A>(mem, 0, size));
    });
    std::optional<ForwardRows<A>> rows;
    if (!errors.failed())
      errors.attempt(
          [&] { rows.emplace(sides, ws, p.dims, launch.kNarrow, launch.bf16_products); });
    barrier();
    if (!errors.failed()) {
      ForwardKernel<T, A> kernel(p, launch.mask, team, ws, *rows, sides);
      for (index_t it = 0; it < launch.items; ++it) {
        sides.load(team, p.compose, p.dims.S, launch.batch_of(it), launch.group_of(it), p.keys);
        kernel.run(launch.batch_of(it), launch.group_of(it), 0, launch.blocks);
        team.sync();  // the next item reloads the shared compose inputs
      }
    }
  }
}

/// The forward of one validated call. `mem`: where the panels go (a caller's Workspace kept
/// between calls, or a fresh one).
template <class T>
void forward(const detail::ForwardParams<T>& params, Workspace& mem) {
  const int threads = thread_count(params.num_threads);
  check_buffer_sizes(params.dims, params.compose, threads);
  const ForwardLaunch<T> launch(params, threads);
  detail::WorkspaceAccess::reserve_slots(mem, threads);
  RegionErrors errors;
  const LaunchMode mode = forward_launch_mode(launch.items, launch.blocks, threads);
  if (mode == LaunchMode::independent_items) {
    forward_independent_items(launch, mem, errors);
  } else {
    ComposeSides<acc_t<T>> sides;
    sides.init(params.dims, params.compose, params.keys);
    if (mode == LaunchMode::private_blocks)
      forward_private_blocks(launch, sides, mem, errors);
    else
      forward_shared_keys(launch, sides, mem, errors);
  }
  errors.rethrow_first();
}

}  // namespace dcmha::cpu
