#pragma once
// A kernel body (simt.hpp) executed on the host: each block's threads are real host threads that
// meet at a real barrier for sync() (and their warp's for sync_warp()), and the block's shared
// memory is one buffer they share, aligned as the device's is. The
// indexing, masking, synchronization and arithmetic of the CUDA kernels thus run, unchanged, on
// any machine; a missing sync() shows up as a race between threads that truly run concurrently.
// Shared memory is filled with NaN before each block, so a read of a value no thread wrote poisons
// the result instead of passing by luck.
//
// For tests and for CI without a GPU: one launch at a time, blocks in grid order.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "simt.hpp"

namespace dcmha::cuda::host {

/// A reusable barrier for a fixed number of threads (std::barrier is C++20). A block's host
/// threads far outnumber the cores, so waiting threads sleep rather than spin. On Linux they
/// sleep on the generation counter itself (a futex): the last arrival wakes them all with one
/// call, and none then queues for a lock as behind a condition variable (kept for other systems).
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
#ifdef __linux__
  void arrive_and_wait() {
    // The acq_rel increments chain every arrival's writes to the last arrival, whose release of
    // the next generation passes them on to every waiter's acquire.
    const std::uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      futex(FUTEX_WAKE_PRIVATE, std::numeric_limits<int>::max());
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation)
      futex(FUTEX_WAIT_PRIVATE, generation);  // returns at once if the generation moved on
  }

 private:
  void futex(int operation, std::uint32_t value) {
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&generation_), operation, value, nullptr,
            nullptr, 0);
  }
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                    std::atomic<std::uint32_t>::is_always_lock_free,
                "a futex word is a plain 32-bit integer");
  std::atomic<std::uint32_t> generation_{0};
  std::atomic<int> arrived_{0};
  const int count_;
#else
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      released_.notify_all();
      return;
    }
    released_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  const int count_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
#endif
};

struct Grid {
  index_t x = 1, y = 1, z = 1;
};

/// What one host thread sees of its block.
class HostBlock {
 public:
  HostBlock(int thread, int threads, Barrier& barrier, Barrier& warp_barrier, double* shared)
      : thread_(thread),
        threads_(threads),
        barrier_(&barrier),
        warp_barrier_(&warp_barrier),
        shared_(shared) {}
  int thread() const { return thread_; }
  int threads() const { return threads_; }
  index_t block(int axis) const { return index_[axis]; }
  void sync() const { barrier_->arrive_and_wait(); }
  void sync_warp() const { warp_barrier_->arrive_and_wait(); }
  void* shared() const { return shared_; }
  void at(index_t x, index_t y, index_t z) { index_[0] = x, index_[1] = y, index_[2] = z; }

 private:
  int thread_, threads_;
  Barrier *barrier_, *warp_barrier_;
  double* shared_;
  index_t index_[3] = {0, 0, 0};
};

/// The block's barrier and one per warp (the last warp may be partial).
struct BlockBarriers {
  explicit BlockBarriers(int threads) : block(threads) {
    for (int first = 0; first < threads; first += kWarpSize)
      warps.emplace_back(threads - first < kWarpSize ? threads - first : kWarpSize);
  }
  Barrier block;
  std::deque<Barrier> warps;  // a deque: barriers do not move
};

/// Runs body(blk) for every thread of every block of grid, `threads` threads per block and
/// `shared_bytes` of shared memory, as kernel<<<grid, threads, shared_bytes>>> would.
template <class Body>
void launch(Grid grid, int threads, std::size_t shared_bytes, Body body) {
  constexpr std::size_t kAlignment = 128;  // as DeviceBlock's shared memory
  const std::size_t doubles = (shared_bytes + sizeof(double) - 1) / sizeof(double);
  std::vector<double> memory(doubles + kAlignment / sizeof(double));
  double* const shared =
      memory.data() + (kAlignment - reinterpret_cast<std::uintptr_t>(memory.data()) % kAlignment) %
                          kAlignment / sizeof(double);
  BlockBarriers barriers(threads);
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto run = [&](int thread) {
    HostBlock blk(thread, threads, barriers.block,
                  barriers.warps[static_cast<std::size_t>(thread / kWarpSize)], shared);
    for (index_t z = 0; z < grid.z; ++z)
      for (index_t y = 0; y < grid.y; ++y)
        for (index_t x = 0; x < grid.x; ++x) {
          if (thread == 0) {  // NaN as a float and, in pairs, as a double
            auto* words = reinterpret_cast<std::uint32_t*>(shared);
            for (std::size_t i = 0; i < doubles * 2; ++i) words[i] = 0x7ff80000u;
          }
          blk.at(x, y, z);
          barriers.block.arrive_and_wait();
          try {
            body(blk);
          } catch (...) {
            std::lock_guard<std::mutex> lock(failure_mutex);
            if (!failure) failure = std::current_exception();
          }
          barriers.block.arrive_and_wait();
        }
  };
  std::vector<std::thread> team;
  team.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) team.emplace_back(run, t);
  for (auto& t : team) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace dcmha::cuda::host
