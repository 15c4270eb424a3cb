#pragma once
// Thread-team helpers. The kernels run one OpenMP team per call; inside it, every thread takes a
// contiguous share of the keys of the current query block (see forward.hpp for why).
#include <algorithm>

#include "../config.hpp"
#include "../tensor.hpp"
#include "convert.hpp"
#include "tile.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dcmha::cpu {

inline int thread_count(int requested) {
#ifdef _OPENMP
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

/// Share `part` of `parts` of [begin, end), boundaries rounded to multiples of `align` (relative
/// to begin) so that vector loops start aligned with the chunk grid. Deterministic in its inputs.
inline void split_range(index_t begin, index_t end, int part, int parts, index_t align,
                        index_t& b, index_t& e) {
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

/// Whether to give each thread whole (batch, group) items instead of splitting every item's keys
/// across the team: when there are enough items to keep all threads busy with even shares.
inline bool independent_items(index_t items, int threads) {
  return threads == 1 || items % threads == 0 || items >= 4 * index_t(threads);
}

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
