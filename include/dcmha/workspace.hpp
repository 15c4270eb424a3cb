#pragma once
// Workspace: the attention kernels' scratch memory, kept between calls.
#include <atomic>
#include <cstddef>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "error.hpp"
#include "tensor.hpp"

namespace dcmha {

namespace detail {
struct WorkspaceAccess;
}

/// Memory the attention kernels work in (the DCMHA score panels, per-thread tiles and partial
/// sums), kept between calls. forward(), backward() and decode() given a Workspace take their
/// buffers from it, growing them when a call needs more, and leave them there for the next call;
/// without one a call allocates its own and frees them on return. Freshly allocated memory costs
/// a page fault per page on first touch, so code that calls attention again and again (a
/// training loop, layer after layer) should keep one.
///
/// One call at a time: a call that finds its Workspace in use by another call throws
/// dcmha::Error instead of sharing the buffers, so a program that calls dcmha from several
/// threads at once keeps one Workspace per calling thread. The memory held is about what the
/// largest call needed: bytes() tells, release() frees it.
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
    std::vector<Block>().swap(blocks_);  // the table too
  }

 private:
  friend struct detail::WorkspaceAccess;

  /// Cache-line aligned (the kernels' vector loads, and no false sharing between threads' blocks).
  static constexpr std::size_t kAlign = 64;
  /// Blocks per owner (the call's shared ones, then each thread's).
  static constexpr int kSlotsPerOwner = 4;

  struct Block {
    void* p = nullptr;
    std::size_t bytes = 0;

    template <class S>
    S* get(index_t count) {
      const std::size_t n = std::size_t(count > 0 ? count : 1);
      if (n > (std::numeric_limits<std::size_t>::max() - kAlign) / sizeof(S))
        throw AllocationError(detail::concat("a workspace block of ", n, " values of ", sizeof(S),
                                             " bytes exceeds the address space"));
      const std::size_t need = (n * sizeof(S) + kAlign - 1) / kAlign * kAlign;
      if (need > bytes) {
        free();  // first: the old block is not needed, and a failure must not leave both held
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
  // Resized only by reserve_slots, before a call's parallel region; Blocks are plain handles.
  std::vector<Block> blocks_;
  std::atomic<bool> busy_{false};
};

namespace detail {

/// The kernels' side of a Workspace. A call holds it (Use) for its whole duration, reserves its
/// slots before its parallel region, then each thread asks only for its own blocks: shared ones
/// by the thread that sets the team up, per-thread ones by their owner, so no two threads touch
/// one block and the table is never resized while threads read it.
struct WorkspaceAccess {
  /// Marks a Workspace in use for one call's lifetime.
  class Use {
   public:
    Use(const char* fn, Workspace& w) : w_(w) {
      if (w_.busy_.exchange(true, std::memory_order_acquire))
        fail(fn,
             ": workspace: expected a Workspace no other call is using (keep one per calling "
             "thread), got one in use");
    }
    ~Use() { w_.busy_.store(false, std::memory_order_release); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    Workspace& w_;
  };

  /// The memory of one public call: the caller's Workspace, held (Use) for the call, or a fresh
  /// one of the call's own.
  class CallMemory {
   public:
    CallMemory(const char* fn, Workspace* caller) : mem_(caller ? *caller : own_), use_(fn, mem_) {}
    Workspace& get() { return mem_; }

   private:
    Workspace own_;  // declared first: mem_ may refer to it
    Workspace& mem_;
    Use use_;
  };

  /// Makes room for the shared slots and as many for each of `threads` threads.
  static void reserve_slots(Workspace& w, int threads) {
    const std::size_t n = std::size_t(1 + threads) * Workspace::kSlotsPerOwner;
    if (w.blocks_.size() < n) w.blocks_.resize(n);
  }
  /// Shared block k (< Workspace::kSlotsPerOwner) of at least `count` values of S.
  template <class S>
  static S* shared(Workspace& w, int k, index_t count) {
    return w.blocks_[std::size_t(k)].template get<S>(count);
  }
  /// Block k (< Workspace::kSlotsPerOwner) of thread `thread` (< the threads reserved), at least
  /// `count` values of S.
  template <class S>
  static S* per_thread(Workspace& w, int thread, int k, index_t count) {
    return w.blocks_[std::size_t(1 + thread) * Workspace::kSlotsPerOwner + std::size_t(k)]
        .template get<S>(count);
  }
};

}  // namespace detail
}  // namespace dcmha
