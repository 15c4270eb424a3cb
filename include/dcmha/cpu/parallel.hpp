#pragma once
// Thread-team helpers. The kernels run one OpenMP team per call; inside it, every thread takes a
// contiguous share of the keys of the current query block (see forward.hpp for why), or, in the
// backward, key tiles from a TileQueue.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "../config.hpp"
#include "../tensor.hpp"
#include "convert.hpp"
#include "tile.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dcmha::cpu {

/// Threads a call plans its work for. Inside a parallel region that may not nest another
/// (OpenMP's default: one active level), the call's team will have one thread: plan for one, so
/// that the call does exactly what a one-thread call outside would do.
inline int thread_count(int requested) {
#ifdef _OPENMP
  if (omp_get_active_level() >= omp_get_max_active_levels()) return 1;
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline void barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/// An exception must not leave an OpenMP region (the program would terminate), and a thread that
/// stopped early would leave the others waiting at the next barrier. So a team's threads build
/// their buffers first, each in attempt(), then pass one barrier and all ask failed(): all go on
/// or all skip the work, and the call rethrows the first error after the region. The work itself
/// allocates nothing, so a failed allocation leaves every output as it was.
class RegionErrors {
 public:
  template <class F>
  void attempt(F&& f) noexcept {
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_release);
    }
  }
  /// The same answer on every thread once they have all passed a barrier after their attempts.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  /// After the region.
  void rethrow_first() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
};

/// Share `part` of `parts` of [begin, end), boundaries rounded to multiples of `align` (relative
/// to begin) so that vector loops start aligned with the chunk grid. Deterministic in its inputs.
inline void split_range(index_t begin, index_t end, int part, int parts, index_t align, index_t& b,
                        index_t& e) {
  const index_t n = std::max<index_t>(end - begin, 0);
  const index_t units = (n + align - 1) / align;
  const index_t u0 = units * part / parts, u1 = units * (part + 1) / parts;
  b = std::min(end, begin + u0 * align);
  e = std::min(end, begin + u1 * align);
  if (e < b) e = b;
}

}  // namespace dcmha::cpu

namespace dcmha::cpu {

/// The threads that share the keys of one (batch, group). Either the whole OpenMP team (few
/// groups: key-split with barriers) or a single thread (many groups: each thread takes whole
/// groups and never waits on another; barriers under oversubscription cost milliseconds).
struct Team {
  int rank = 0, size = 1;
  void sync() const {
    if (size > 1) barrier();
  }
};

/// Hands out a block's key tiles to a team. Each rank owns a contiguous run (its share of the
/// tiles) and takes from its front; a rank whose run is empty takes from the back of another's.
/// A static split would make the whole team wait at every barrier for its slowest thread, and
/// threads on shared or oversubscribed machines (a vCPU whose sibling hyperthread is busy on the
/// host) run at unequal speeds for tenths of a second. Who takes which tile varies from run to run,
/// so whatever sums over tiles must do so per tile, in tile order.
class TileQueue {
 public:
  /// Sized for `ranks` ranks, before the team starts.
  void resize(int ranks) { runs_ = std::vector<std::atomic<std::uint64_t>>(std::size_t(ranks)); }
  /// Rank `rank` of `ranks` sets its run for the next `tiles` tiles. Every rank does so, and a
  /// barrier separates it from the last take() before and the first take() after.
  void reset(int rank, int ranks, index_t tiles) {
    index_t b, e;
    split_range(0, tiles, rank, ranks, 1, b, e);
    runs_[std::size_t(rank)].store(pack(b, e), std::memory_order_relaxed);
  }
  /// The next tile for `rank`, or -1 once every tile has been taken.
  index_t take(int rank) {
    const int n = int(runs_.size());
    index_t t;
    if (pop(rank, true, t)) return t;
    for (int j = 1; j < n; ++j)
      if (pop((rank + j) % n, false, t)) return t;
    return -1;
  }

 private:
  // Front and end of a run in one word, so that a take is one compare-and-swap. Relaxed order:
  // the queue hands out indices only; the data a tile's work reads is ordered by barriers.
  static std::uint64_t pack(index_t b, index_t e) {
    return std::uint64_t(b) | std::uint64_t(e) << 32;
  }
  bool pop(int rank, bool front, index_t& t) {
    std::atomic<std::uint64_t>& run = runs_[std::size_t(rank)];
    std::uint64_t v = run.load(std::memory_order_relaxed);
    for (;;) {
      const index_t b = index_t(v & 0xffffffffu), e = index_t(v >> 32);
      if (b >= e) return false;
      if (run.compare_exchange_weak(v, front ? pack(b + 1, e) : pack(b, e - 1),
                                    std::memory_order_relaxed)) {
        t = front ? b : e - 1;
        return true;
      }
    }
  }
  std::vector<std::atomic<std::uint64_t>> runs_;
};

/// out[b, h0 + m, t0 + i, :] = the sum over team ranks j, in rank order, of
/// parts[((j * M + m) * rows_cap + i) * width + e]: the partial products of a key-split team, or
/// one thread's staged rows. Each thread writes a share of the rows, so the result is
/// deterministic for a fixed team size. Summed in A (into rank 0's row, which no other thread
/// reads again for this block), written to the caller once, rounded if T is narrower.
template <class T, class A>
void sum_team_parts(const Team& team, A* parts, index_t M, index_t rows_cap, index_t rows,
                    index_t width, const TensorView<T, 4>& out, index_t b, index_t h0, index_t t0) {
  index_t r0, r1;
  split_range(0, rows, team.rank, team.size, 1, r0, r1);
  for (index_t m = 0; m < M; ++m)
    for (index_t i = r0; i < r1; ++i) {
      A* p0 = parts + (m * rows_cap + i) * width;
      for (int j = 1; j < team.size; ++j) {
        const A* pj = parts + ((j * M + m) * rows_cap + i) * width;
        for (index_t e = 0; e < width; ++e) p0[e] += pj[e];
      }
      narrow_row(p0, row_ptr(out, b, h0 + m, t0 + i), width);
    }
}

}  // namespace dcmha::cpu
