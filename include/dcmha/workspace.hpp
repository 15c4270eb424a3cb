#pragma once
// Workspace: the attention kernels' scratch memory, kept between calls.
#include <cstddef>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "tensor.hpp"

namespace dcmha {

/// Memory the attention kernels work in (the DCMHA score panels, per-thread tiles and partial
/// sums), kept between calls. forward() and backward() given a Workspace take their buffers from
/// it, growing them when a call needs more, and leave them there for the next call; without one
/// a call allocates its own and frees them on return. Freshly allocated memory costs a page
/// fault per page on first touch (5% of a DCMHA forward at H32/D128/T1024 here), so code that
/// calls attention again and again (a training loop, layer after layer) should keep one.
///
/// One call at a time: the buffers are not shared between concurrent calls, so a program that
/// calls dcmha from several threads at once keeps one Workspace per calling thread. The memory
/// held is about what the largest call needed: bytes() tells, release() frees it.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&& o) noexcept : blocks_(std::move(o.blocks_)) {}
  Workspace& operator=(Workspace&& o) noexcept {
    if (this != &o) {
      release();
      blocks_ = std::move(o.blocks_);
    }
    return *this;
  }
  ~Workspace() { release(); }

  /// Bytes held now.
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const Block& b : blocks_) n += b.bytes;
    return n;
  }
  /// Frees all memory held; the next call allocates again.
  void release() {
    for (Block& b : blocks_) b.free();
    blocks_.clear();
  }

  // The kernels' side. A call first reserves its slots (one thread, before any parallel region),
  // then each thread asks only for its own: shared slots by the thread that set the team up,
  // per-thread slots by their owner, so no two threads touch one slot's block.

  /// Buffers per owner: the most any kernel keeps in a workspace at once.
  static constexpr int kSlotsPerOwner = 4;

  /// Makes room for kSlotsPerOwner shared slots and as many for each of `threads` threads.
  void reserve_slots(int threads) {
    const std::size_t n = std::size_t(1 + threads) * kSlotsPerOwner;
    if (blocks_.size() < n) blocks_.resize(n);
  }
  /// Shared buffer k (< kSlotsPerOwner) of at least `count` values of S.
  template <class S>
  S* shared(int k, index_t count) {
    return blocks_[k].template get<S>(count);
  }
  /// Buffer k of thread `thread` (< the threads reserved), at least `count` values of S.
  template <class S>
  S* per_thread(int thread, int k, index_t count) {
    return blocks_[std::size_t(1 + thread) * kSlotsPerOwner + k].template get<S>(count);
  }

 private:
  /// Cache-line aligned (the kernels' vector loads and false sharing between threads' buffers).
  static constexpr std::size_t kAlign = 64;

  struct Block {
    void* p = nullptr;
    std::size_t bytes = 0;

    template <class S>
    S* get(index_t count) {
      const std::size_t need = (std::size_t(count > 0 ? count : 1) * sizeof(S) + kAlign - 1) / kAlign * kAlign;
      if (need > bytes) {
        free();
        p = ::operator new(need, std::align_val_t(kAlign));
        bytes = need;
      }
      S* s = static_cast<S*>(p);
#ifdef DCMHA_POISON_WORKSPACE
      // Tests: stale values must never be read, so a reused block starts as NaN like a new one.
      for (index_t i = 0; i < count; ++i) s[i] = std::numeric_limits<S>::quiet_NaN();
#endif
      return s;
    }
    void free() {
      if (p) ::operator delete(p, std::align_val_t(kAlign));
      p = nullptr;
      bytes = 0;
    }
  };
  // Blocks are moved when the vector grows, which only reserve_slots does (single-threaded).
  std::vector<Block> blocks_;
};

}  // namespace dcmha
