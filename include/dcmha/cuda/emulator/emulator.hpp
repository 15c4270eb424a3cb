#pragma once
// The strict emulator: CUDA kernel bodies (written against the execution model of simt.hpp) run
// on the host, lane by lane. Every CUDA thread is a fiber (fiber.hpp); one host thread runs the
// lanes of one cluster of blocks in turn, each until it must wait for others. The warp-level
// instructions the kernels use are executed here with the PTX ISA's lane layouts: ldmatrix's
// rows and fragments, mma.m16n8k16's A, B, C fragments, shuffles. So a kernel that hands a lane
// the wrong elements gets wrong numbers, as on a GPU.
//
// What the emulator checks, beyond running the code:
//   - shared memory races (shadow.hpp): a read or write of shared memory another thread wrote or
//     read since their last common barrier (block, cluster, or the warp's sync) is reported;
//   - asynchronous copies land at their wait_group: until then the destination holds NaN, and
//     touching it is reported;
//   - collectives: every lane of a warp must reach the same one (same instruction, same call
//     site), every thread of a block the same barrier; a lane that exits while others wait, or a
//     schedule where nobody can go on, is an error;
//   - the alignment of ldmatrix, cp.async and global accesses, accesses outside the block's
//     shared memory, and accesses to a cluster peer's shared memory after all of its threads
//     have exited.
// Races are collected and thrown together (std::logic_error) after the launch; the other errors
// stop it at once.
//
// It also counts (counters.hpp) what a cost model needs, and can disable one synchronization
// site (Mutation), so that tests can show each barrier, warp sync and copy wait is needed.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../config.hpp"
#include "../../tensor.hpp"
#include "counters.hpp"
#include "fiber.hpp"
#include "shadow.hpp"

namespace dcmha::cuda::emulator {

constexpr int kLanes = 32;

/// Grid, block and cluster shape of one launch: blocks (x, y, z), clusters of `cluster` blocks
/// along x (grid.x a multiple of it), `threads` per block, `shared_bytes` of dynamic shared memory.
struct LaunchShape {
  index_t x = 1, y = 1, z = 1;
  int threads = 32;
  std::size_t shared_bytes = 0;
  int cluster = 1;
};

/// The kinds of synchronization a test may disable at one call site.
enum class SyncKind { block, warp, cluster, copy_wait };

/// A synchronization call site: kind and source location.
struct SyncSite {
  SyncKind kind;
  std::string file;
  int line;
  bool operator<(const SyncSite& o) const {
    return std::tie(kind, file, line) < std::tie(o.kind, o.file, o.line);
  }
  std::string str() const {
    static const char* names[] = {"sync", "sync_warp", "sync_cluster", "cp_async_wait"};
    return std::string(names[int(kind)]) + " at " + Site{file.c_str(), line}.str();
  }
};

/// Test hooks, process-wide: the synchronization sites seen, and one that is deleted (its calls
/// do nothing) for the next launches. Tests set it; the kernels do not know.
class Mutation {
 public:
  static Mutation& get() {
    static Mutation m;
    return m;
  }
  void disable(const SyncSite& s) {
    std::lock_guard<std::mutex> lock(mutex_);
    disabled_ = s;
    active_ = true;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    active_ = false;
  }
  std::set<SyncSite> seen() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }
  void forget_seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    seen_.clear();
  }
  /// Records the site; false where it is the disabled one.
  bool enabled(SyncKind kind, Site site) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (last_file_ != site.file || last_line_ != site.line || last_kind_ != kind) {
      seen_.insert({kind, site.file, site.line});
      last_file_ = site.file, last_line_ = site.line, last_kind_ = kind;
    }
    return !(active_ && disabled_.kind == kind && disabled_.line == site.line &&
             disabled_.file == site.file);
  }

 private:
  mutable std::mutex mutex_;
  std::set<SyncSite> seen_;
  SyncSite disabled_{SyncKind::block, "", 0};
  bool active_ = false;
  const char* last_file_ = nullptr;
  int last_line_ = 0;
  SyncKind last_kind_ = SyncKind::block;
};

/// Whether launches count memory traffic per warp instruction (counters.hpp): the cost model turns
/// it on; the tests leave it off, which saves most of the emulator's bookkeeping per access.
class Counting {
 public:
  static bool& enabled() {
    static bool on = false;
    return on;
  }
  /// Whether counting launches also break their counts down by call site (Counters::sites).
  static bool& sites() {
    static bool on = false;
    return on;
  }
};

/// What the tensor cores take: two bf16 or fp16 values in a 32-bit register.
enum class MmaType { bf16, f16 };

class ClusterRun;

/// A fatal emulation error (not a race): stops the launch.
struct EmulationError : std::logic_error {
  using std::logic_error::logic_error;
};

/// Per-lane state.
struct Lane {
  enum class Status { ready, waiting, done };
  Status status = Status::ready;
  std::unique_ptr<Fiber> fiber;
  int thread = 0, block_rank = 0;  // in its block; its block's rank in the cluster
  Site waiting_at;
  // Collective payload: inputs the lane brings, outputs it takes.
  const void* address = nullptr;
  std::uint32_t in[8] = {}, out[8] = {};
  float in_f[4] = {}, out_f[4] = {};
  int shuffle_mask = 0;
  // Asynchronous copies: not yet committed, and committed groups in order.
  struct Copy {
    void* dst;
    unsigned char data[16];
    Site site;
  };
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
  std::vector<LoggedAccess> log;  // since the warp last met
  Counters counters;              // the lane's own counts (fma, exp)
};

/// What one lane sees of its block (the Block of simt.hpp, on the host).
class HostBlock {
 public:
  HostBlock(ClusterRun& run, int lane) : run_(&run), lane_(lane) {}

  int thread() const;
  int threads() const;
  index_t block(int axis) const;
  int cluster_rank() const;
  int cluster_size() const;
  void* shared() const;
  /// The same offset in the shared memory of cluster block `block` (DSMEM).
  template <class U>
  U* peer_shared(U* local, int block) const;

  void sync(Site site = Site::here()) const;
  void sync_warp(Site site = Site::here()) const;
  void sync_cluster(Site site = Site::here()) const;

  float shfl_xor(float v, int lane_mask, Site site = Site::here()) const;
  void ldmatrix_x4(std::uint32_t (&r)[4], const void* row, Site site = Site::here()) const {
    ldmatrix(r, 4, false, row, site);
  }
  void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row, Site site = Site::here()) const {
    ldmatrix(r, 4, true, row, site);
  }
  void ldmatrix_x2(std::uint32_t (&r)[2], const void* row, Site site = Site::here()) const {
    ldmatrix(r, 2, false, row, site);
  }
  void ldmatrix_x2_trans(std::uint32_t (&r)[2], const void* row, Site site = Site::here()) const {
    ldmatrix(r, 2, true, row, site);
  }
  void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                Site site = Site::here()) const {
    mma(MmaType::bf16, d, a, b, site);
  }
  void mma_f16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
               Site site = Site::here()) const {
    mma(MmaType::f16, d, a, b, site);
  }

  /// cp.async.cg 16 bytes, global -> shared; `valid` false fills zeros (src-size 0).
  void cp_async_16(void* dst, const void* src, bool valid, Site site = Site::here()) const;
  void cp_async_commit() const;
  template <int N>
  void cp_async_wait(Site site = Site::here()) const {
    wait_copies(N, site);
  }

  template <class U>
  U load_shared(const U* p, Site site = Site::here()) const;
  template <class U>
  void store_shared(U* p, const U& v, Site site = Site::here()) const;
  template <class U>
  U load_global(const U* p, Site site = Site::here()) const;
  template <class U>
  void store_global(U* p, const U& v, Site site = Site::here()) const;
  /// The device's atomicAdd: the lanes run one at a time, so a read and a write (counted as one
  /// store: a reduction in L2).
  void atomic_add_global(float* p, float v, Site site = Site::here()) const;
  /// sm_90's red.global.add.v2.f32: one 8-byte access, p 8-byte aligned.
  void atomic_add_global_pair(float* p, float x, float y, Site site = Site::here()) const;

  void count_fma(index_t n) const;
  void count_exp(index_t n) const;

 private:
  void ldmatrix(std::uint32_t* r, int count, bool trans, const void* row, Site site) const;
  // Counts an atomic add to p by another block of the launch than the last (unordered_adds).
  void note_adder(const float* p) const;
  // A misaligned global access faults on the device: here it fails the launch.
  void check_global_alignment(const void* p, std::size_t bytes, std::size_t alignment,
                              Site site) const;
  void mma(MmaType type, float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
           Site site) const;
  void wait_copies(int n, Site site) const;
  ClusterRun* run_;
  int lane_;  // in the cluster
};

/// One cluster of blocks, run to completion by the host thread.
class ClusterRun {
 public:
  ClusterRun(const LaunchShape& shape, std::vector<Lane>& lanes);

  template <class Body>
  void run(index_t x0, index_t y, index_t z, Body& body);

  const Counters& counters() const { return counters_; }
  const Shadow& shadow() const { return shadow_; }

 private:
  friend class HostBlock;
  enum class Meeting { none, collective, block_barrier, cluster_barrier };

  int warp_of(int lane) const { return lane / kLanes; }
  int first_lane_of_warp(int warp) const { return warp * kLanes; }
  Lane& lane(int i) { return (*lanes_)[static_cast<std::size_t>(i)]; }
  const Lane& lane(int i) const { return (*lanes_)[static_cast<std::size_t>(i)]; }
  Accessor accessor(int lane_index) const;
  Generations now() const { return {&block_generation_, &warp_generation_, cluster_generation_}; }

  /// Blocks the calling lane until every lane of its warp (or block, or cluster) is there, the
  /// last arrival running `complete` first. Returns false where the site is disabled.
  template <class Complete>
  void meet(int lane_index, Meeting kind, const char* what, Site site, Complete&& complete);
  void wait_here(int lane_index, Site site);
  void release(int first, int count);
  void close_warp_log(int warp);
  // Adds one warp instruction's accesses (the lanes' n-th from one call site) to the counters.
  void count_instruction(const std::vector<LoggedAccess>& same);
  void fail(const std::string& what);

  // Shared memory: the blocks' regions at stride_ bytes from base_.
  std::size_t locate(const void* p, std::size_t n, int& block, Site site);
  void shared_access(int lane_index, const void* p, std::size_t n, bool store, Site site);

  void execute_ldmatrix(int warp, int count, bool trans, Site site);
  void execute_mma(int warp, MmaType type);
  void execute_shuffle(int warp, Site site);

  LaunchShape shape_;
  std::vector<Lane>* lanes_;
  int cluster_lanes_ = 0;
  index_t x0_ = 0, y_ = 0, z_ = 0;
  std::vector<unsigned char> memory_;
  unsigned char* base_ = nullptr;
  std::size_t stride_ = 0;
  Shadow shadow_;
  std::vector<std::uint32_t> block_generation_, warp_generation_;
  std::uint32_t cluster_generation_ = 0;
  // Meeting bookkeeping: arrivals per warp / block / cluster and what they arrived at.
  std::vector<int> warp_arrived_, block_arrived_, block_exited_;
  // Per block: the last cluster generation in which a peer touched its shared memory (-1: none).
  // A block may exit any time after its last cluster barrier, so a peer's access in that
  // generation (or later) is one to memory that may be gone.
  std::vector<std::int64_t> peer_access_generation_;
  int cluster_arrived_ = 0;
  std::vector<const char*> warp_what_;
  std::vector<Site> warp_site_;
  Counters counters_;
  std::unordered_map<const void*, index_t> last_adder_;  // atomic adds: address -> block
  std::string failure_;
  std::exception_ptr body_failure_;
  int current_ = -1;  // the lane running
  template <class Body>
  struct Start {
    ClusterRun* run;
    Body* body;
    int lane;
  };
  template <class Body>
  static void entry(void* p);
};

// ----------------------------------------------------------------------------------------------

inline ClusterRun::ClusterRun(const LaunchShape& shape, std::vector<Lane>& lanes)
    : shape_(shape), lanes_(&lanes) {
  cluster_lanes_ = shape.threads * shape.cluster;
  stride_ = (shape.shared_bytes + 127) / 128 * 128 + 128;  // a gap: off-by-one reads land nowhere
  memory_.resize(stride_ * std::size_t(shape.cluster) + 128);
  base_ = memory_.data() + (128 - reinterpret_cast<std::uintptr_t>(memory_.data()) % 128) % 128;
  block_generation_.assign(std::size_t(shape.cluster), 0);
  warp_generation_.assign(std::size_t(cluster_lanes_ / kLanes + 1), 0);
  warp_arrived_.assign(warp_generation_.size(), 0);
  warp_what_.assign(warp_generation_.size(), nullptr);
  warp_site_.assign(warp_generation_.size(), Site{});
  block_arrived_.assign(std::size_t(shape.cluster), 0);
  block_exited_.assign(std::size_t(shape.cluster), 0);
  peer_access_generation_.assign(std::size_t(shape.cluster), -1);
}

template <class Body>
void ClusterRun::entry(void* p) {
  auto* start = static_cast<Start<Body>*>(p);
  ClusterRun& run = *start->run;
  Lane& me = run.lane(start->lane);
  me.fiber->arrived();
  {
    const HostBlock blk(run, start->lane);
    try {
      (*start->body)(blk);
    } catch (...) {
      if (!run.body_failure_) run.body_failure_ = std::current_exception();
    }
  }
  me.status = Lane::Status::done;
  const std::size_t b = std::size_t(me.block_rank);
  if (++run.block_exited_[b] == run.shape_.threads &&
      run.peer_access_generation_[b] >= std::int64_t(run.cluster_generation_))
    run.fail("cluster block " + std::to_string(b) +
             " exits while a peer may still touch its shared memory (accessed after its last "
             "cluster barrier: a cluster barrier must keep it until its peers are done)");
  me.fiber->finish();
}

template <class Body>
void ClusterRun::run(index_t x0, index_t y, index_t z, Body& body) {
  x0_ = x0, y_ = y, z_ = z;
  std::memset(memory_.data(), 0xff, memory_.size());  // NaN in every float, bf16 and fp16
  std::fill(block_exited_.begin(), block_exited_.end(), 0);
  std::fill(peer_access_generation_.begin(), peer_access_generation_.end(), -1);
  shadow_.reset(stride_ * std::size_t(shape_.cluster));
  std::vector<Start<Body>> starts(static_cast<std::size_t>(cluster_lanes_));
  for (int i = 0; i < cluster_lanes_; ++i) {
    Lane& l = lane(i);
    l.status = Lane::Status::ready;
    l.thread = i % shape_.threads;
    l.block_rank = i / shape_.threads;
    l.open.clear();
    l.groups.clear();
    l.log.clear();
    starts[std::size_t(i)] = {this, &body, i};
    l.fiber->start(&ClusterRun::entry<Body>, &starts[std::size_t(i)]);
  }
  counters_.blocks += std::uint64_t(shape_.cluster);
  counters_.threads += std::uint64_t(cluster_lanes_);
  for (bool progress = true; progress && failure_.empty();) {
    progress = false;
    for (int i = 0; i < cluster_lanes_ && failure_.empty(); ++i) {
      if (lane(i).status != Lane::Status::ready) continue;
      progress = true;
      current_ = i;
      lane(i).fiber->resume();
    }
  }
  current_ = -1;
  if (failure_.empty())
    for (int i = 0; i < cluster_lanes_; ++i)
      if (lane(i).status != Lane::Status::done) {
        int exited = 0;
        for (int j = 0; j < cluster_lanes_; ++j) exited += lane(j).status == Lane::Status::done;
        fail("deadlock: thread " + std::to_string(i) + " waits at " + lane(i).waiting_at.str() +
             " and no thread can go on (" + std::to_string(exited) + " of " +
             std::to_string(cluster_lanes_) +
             " threads have exited; a barrier some threads skip, or a collective some lanes "
             "never reach)");
        break;
      }
  if (!failure_.empty()) throw EmulationError("dcmha::cuda::emulator: " + failure_);
  if (body_failure_) std::rethrow_exception(body_failure_);
  for (int w = 0; w < cluster_lanes_ / kLanes; ++w) close_warp_log(w);
  for (int i = 0; i < cluster_lanes_; ++i) {
    counters_ += lane(i).counters;
    lane(i).counters = Counters{};
  }
}

inline Accessor ClusterRun::accessor(int i) const {
  const Lane& l = (*lanes_)[std::size_t(i)];
  Accessor a;
  a.thread = i;
  a.warp = warp_of(i);
  a.block = l.block_rank;
  a.block_generation = block_generation_[std::size_t(a.block)];
  a.cluster_generation = cluster_generation_;
  a.warp_generation = warp_generation_[std::size_t(a.warp)];
  return a;
}

inline void ClusterRun::fail(const std::string& what) {
  if (failure_.empty()) failure_ = what;
}

inline void ClusterRun::wait_here(int i, Site site) {
  Lane& me = lane(i);
  me.waiting_at = site;
  if (me.status == Lane::Status::ready) return;  // released by its own arrival
  me.fiber->yield();
  if (!failure_.empty()) {
    // The launch is being abandoned: never return into kernel code.
    me.status = Lane::Status::done;
    me.fiber->finish();
  }
}

inline void ClusterRun::release(int first, int count) {
  for (int i = first; i < first + count; ++i)
    if (lane(i).status == Lane::Status::waiting) lane(i).status = Lane::Status::ready;
}

template <class Complete>
void ClusterRun::meet(int i, Meeting kind, const char* what, Site site, Complete&& complete) {
  Lane& me = lane(i);
  const int warp = warp_of(i);
  me.status = Lane::Status::waiting;
  me.waiting_at = site;
  if (kind == Meeting::collective) {
    const int first = first_lane_of_warp(warp);
    const int width = std::min(kLanes, cluster_lanes_ - first);
    if (width < kLanes) fail(std::string(what) + " at " + site.str() + " in a partial warp");
    if (warp_arrived_[std::size_t(warp)] == 0) {
      warp_what_[std::size_t(warp)] = what;
      warp_site_[std::size_t(warp)] = site;
    } else if (std::strcmp(warp_what_[std::size_t(warp)], what) != 0 ||
               warp_site_[std::size_t(warp)].line != site.line ||
               std::strcmp(warp_site_[std::size_t(warp)].file, site.file) != 0) {
      fail("divergent warp: lane " + std::to_string(i % kLanes) + " of warp " +
           std::to_string(warp) + " reached " + what + " at " + site.str() +
           " while another lane waits at " + warp_what_[std::size_t(warp)] + " at " +
           warp_site_[std::size_t(warp)].str());
    }
    if (++warp_arrived_[std::size_t(warp)] == width) {
      warp_arrived_[std::size_t(warp)] = 0;
      close_warp_log(warp);
      complete(warp);
      release(first, width);
    }
  } else {
    const bool cluster = kind == Meeting::cluster_barrier;
    int& arrived = cluster ? cluster_arrived_ : block_arrived_[std::size_t(me.block_rank)];
    const int first = cluster ? 0 : me.block_rank * shape_.threads;
    const int count = cluster ? cluster_lanes_ : shape_.threads;
    if (++arrived == count) {
      arrived = 0;
      for (int w = warp_of(first); w <= warp_of(first + count - 1); ++w) close_warp_log(w);
      complete(0);
      release(first, count);
    }
  }
  wait_here(i, site);
}

inline void ClusterRun::close_warp_log(int warp) {
  if (!Counting::enabled()) return;
  const int first = first_lane_of_warp(warp);
  const int width = std::min(kLanes, cluster_lanes_ - first);
  std::vector<const std::vector<LoggedAccess>*> lanes;
  for (int i = first; i < first + width; ++i) lanes.push_back(&lane(i).log);
  for (const std::vector<LoggedAccess>& same : instructions_of(lanes)) count_instruction(same);
  for (int i = first; i < first + width; ++i) lane(i).log.clear();
}

inline void ClusterRun::count_instruction(const std::vector<LoggedAccess>& same) {
  const LoggedAccess& a = same.front();
  std::uint64_t bytes = 0;
  for (const LoggedAccess& x : same) bytes += x.bytes;
  SiteCounts site;
  site.instructions = 1;
  if (a.shared) {
    site.shared_wavefronts = shared_wavefronts(same);
    site.peer_shared_bytes = peer_bytes_of(same);
    counters_.shared_bytes += bytes;
    counters_.shared_requests += 1;
    counters_.shared_wavefronts += site.shared_wavefronts;
    counters_.peer_shared_bytes += site.peer_shared_bytes;
  } else {
    site.global_sectors = sectors_of(same);
    (a.store ? counters_.global_store_bytes : counters_.global_load_bytes) += bytes;
    (a.store ? counters_.global_store_sectors : counters_.global_load_sectors) +=
        site.global_sectors;
  }
  if (!Counting::sites()) return;
  const char* kind = a.shared ? (a.store ? " shared store" : " shared load")
                              : (a.store ? " global store" : " global load");
  counters_.sites[Site{a.file, a.line}.str() + kind] += site;
}

inline std::size_t ClusterRun::locate(const void* p, std::size_t n, int& block, Site site) {
  const auto* c = static_cast<const unsigned char*>(p);
  const std::size_t offset = static_cast<std::size_t>(c - base_);
  if (c < base_ || offset + n > stride_ * std::size_t(shape_.cluster) ||
      offset % stride_ + n > shape_.shared_bytes) {
    fail("shared-memory access outside the block's " + std::to_string(shape_.shared_bytes) +
         " bytes at " + site.str());
    block = 0;
    return 0;
  }
  block = static_cast<int>(offset / stride_);
  return offset;
}

inline void ClusterRun::shared_access(int i, const void* p, std::size_t n, bool store, Site site) {
  int block = 0;
  const std::size_t offset = locate(p, n, block, site);
  if (!failure_.empty()) return;
  if (block != lane(i).block_rank) {
    if (block_exited_[std::size_t(block)] == shape_.threads)
      fail("access at " + site.str() + " to the shared memory of cluster block " +
           std::to_string(block) +
           ", whose threads have exited (a cluster barrier must keep it "
           "until its peers are done)");
    peer_access_generation_[std::size_t(block)] = std::int64_t(cluster_generation_);
  }
  const Accessor a = accessor(i);
  if (store)
    shadow_.write(offset, n, a, site, now());
  else
    shadow_.read(offset, n, a, site, now());
  if (Counting::enabled())
    lane(i).log.push_back(
        {p, std::uint32_t(n), true, store, block != lane(i).block_rank, site.file, site.line});
}

// --- HostBlock ---------------------------------------------------------------------------------

inline int HostBlock::thread() const { return run_->lane(lane_).thread; }
inline int HostBlock::threads() const { return run_->shape_.threads; }
inline index_t HostBlock::block(int axis) const {
  const ClusterRun& r = *run_;
  return axis == 0 ? r.x0_ + r.lane(lane_).block_rank : axis == 1 ? r.y_ : r.z_;
}
inline int HostBlock::cluster_rank() const { return run_->lane(lane_).block_rank; }
inline int HostBlock::cluster_size() const { return run_->shape_.cluster; }
inline void* HostBlock::shared() const {
  return run_->base_ + run_->stride_ * std::size_t(cluster_rank());
}
template <class U>
U* HostBlock::peer_shared(U* local, int block) const {
  const auto* c = reinterpret_cast<const unsigned char*>(local);
  const std::ptrdiff_t offset = c - static_cast<const unsigned char*>(shared());
  return reinterpret_cast<U*>(run_->base_ + run_->stride_ * std::size_t(block) + offset);
}

inline void HostBlock::sync(Site site) const {
  if (!Mutation::get().enabled(SyncKind::block, site)) return;
  ClusterRun& r = *run_;
  r.meet(lane_, ClusterRun::Meeting::block_barrier, "sync", site, [&](int) {
    const int b = cluster_rank();
    ++r.block_generation_[std::size_t(b)];
    r.counters_.block_barriers += 1;
  });
}

inline void HostBlock::sync_warp(Site site) const {
  if (!Mutation::get().enabled(SyncKind::warp, site)) return;
  ClusterRun& r = *run_;
  r.meet(lane_, ClusterRun::Meeting::collective, "sync_warp", site, [&](int warp) {
    ++r.warp_generation_[std::size_t(warp)];
    r.counters_.warp_syncs += 1;
  });
}

inline void HostBlock::sync_cluster(Site site) const {
  if (!Mutation::get().enabled(SyncKind::cluster, site)) return;
  ClusterRun& r = *run_;
  r.meet(lane_, ClusterRun::Meeting::cluster_barrier, "sync_cluster", site, [&](int) {
    ++r.cluster_generation_;
    for (auto& g : r.block_generation_) ++g;
    r.counters_.cluster_barriers += std::uint64_t(r.shape_.cluster);
  });
}

inline float HostBlock::shfl_xor(float v, int lane_mask, Site site) const {
  ClusterRun& r = *run_;
  Lane& me = r.lane(lane_);
  std::memcpy(&me.in[0], &v, 4);
  me.shuffle_mask = lane_mask;
  r.meet(lane_, ClusterRun::Meeting::collective, "shfl_xor", site,
         [&](int warp) { r.execute_shuffle(warp, site); });
  float out;
  std::memcpy(&out, &me.out[0], 4);
  return out;
}

inline void ClusterRun::execute_shuffle(int warp, Site site) {
  const int first = first_lane_of_warp(warp);
  for (int l = 0; l < kLanes; ++l) {
    Lane& me = lane(first + l);
    me.out[0] = lane(first + (l ^ (me.shuffle_mask & (kLanes - 1)))).in[0];
  }
  counters_.shuffles += 1;
  if (Counting::enabled() && Counting::sites()) {
    SiteCounts& counts = counters_.sites[site.str() + " shuffle"];
    counts.instructions += 1, counts.shuffles += 1;
  }
}

inline void HostBlock::ldmatrix(std::uint32_t* out, int count, bool trans, const void* row,
                                Site site) const {
  ClusterRun& r = *run_;
  Lane& me = r.lane(lane_);
  me.address = row;
  const char* what = trans ? (count == 4 ? "ldmatrix.x4.trans" : "ldmatrix.x2.trans")
                           : (count == 4 ? "ldmatrix.x4" : "ldmatrix.x2");
  r.meet(lane_, ClusterRun::Meeting::collective, what, site,
         [&](int warp) { r.execute_ldmatrix(warp, count, trans, site); });
  for (int i = 0; i < count; ++i) out[i] = me.out[i];
}

/// ldmatrix.m8n8: matrix i's row j is the 16 bytes at lane (8i + j)'s address. Without .trans
/// lane l receives, of each matrix, row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1; with .trans,
/// rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4. The first element sits in the low half.
inline void ClusterRun::execute_ldmatrix(int warp, int count, bool trans, Site site) {
  const int first = first_lane_of_warp(warp);
  std::uint16_t m[4][8][8];
  for (int i = 0; i < count; ++i)
    for (int j = 0; j < 8; ++j) {
      const int provider = first + 8 * i + j;
      const void* a = lane(provider).address;
      if (reinterpret_cast<std::uintptr_t>(a) % 16 != 0)
        fail("ldmatrix at " + site.str() + ": lane " + std::to_string(8 * i + j) +
             "'s row address is not 16-byte aligned");
      shared_access(provider, a, 16, false, site);
      if (!failure_.empty()) return;
      std::memcpy(m[i][j], a, 16);
    }
  // The rows' wavefronts were logged per lane; ldmatrix reads one matrix per wavefront at best.
  for (int l = 0; l < kLanes; ++l) {
    Lane& me = lane(first + l);
    for (int i = 0; i < count; ++i) {
      const std::uint16_t lo = trans ? m[i][2 * (l % 4)][l / 4] : m[i][l / 4][2 * (l % 4)];
      const std::uint16_t hi = trans ? m[i][2 * (l % 4) + 1][l / 4] : m[i][l / 4][2 * (l % 4) + 1];
      me.out[i] = std::uint32_t(lo) | (std::uint32_t(hi) << 16);
    }
  }
  close_warp_log(warp);
}

inline void HostBlock::mma(MmaType type, float (&d)[4], const std::uint32_t (&a)[4],
                           const std::uint32_t (&b)[2], Site site) const {
  ClusterRun& r = *run_;
  Lane& me = r.lane(lane_);
  for (int i = 0; i < 4; ++i) me.in[i] = a[i], me.in_f[i] = d[i];
  me.in[4] = b[0], me.in[5] = b[1];
  r.meet(lane_, ClusterRun::Meeting::collective,
         type == MmaType::bf16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", site,
         [&](int warp) { r.execute_mma(warp, type); });
  for (int i = 0; i < 4; ++i) d[i] = me.out_f[i];
}

inline float widen(std::uint16_t bits, MmaType type) {
  if (type == MmaType::bf16) {
    const std::uint32_t w = std::uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
}

/// mma.sync.m16n8k16.row.col, f32 accumulators: lane l (group g = l / 4, t = l % 4) holds
///   A: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
///   B: b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
///   C, D: c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1).
/// Products of bf16 / fp16 values are exact in float; they are added to C in k order.
inline void ClusterRun::execute_mma(int warp, MmaType type) {
  const int first = first_lane_of_warp(warp);
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < kLanes; ++l) {
    const Lane& me = lane(first + l);
    const int g = l / 4, t = l % 4;
    const int arow[4] = {g, g + 8, g, g + 8}, acol[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) {
      A[arow[i]][acol[i]] = widen(std::uint16_t(me.in[i] & 0xffff), type);
      A[arow[i]][acol[i] + 1] = widen(std::uint16_t(me.in[i] >> 16), type);
    }
    for (int i = 0; i < 2; ++i) {
      B[2 * t + 8 * i][g] = widen(std::uint16_t(me.in[4 + i] & 0xffff), type);
      B[2 * t + 8 * i + 1][g] = widen(std::uint16_t(me.in[4 + i] >> 16), type);
    }
    C[g][2 * t] = me.in_f[0], C[g][2 * t + 1] = me.in_f[1];
    C[g + 8][2 * t] = me.in_f[2], C[g + 8][2 * t + 1] = me.in_f[3];
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float sum = C[m][n];
      for (int k = 0; k < 16; ++k) sum += A[m][k] * B[k][n];
      C[m][n] = sum;
    }
  for (int l = 0; l < kLanes; ++l) {
    Lane& me = lane(first + l);
    const int g = l / 4, t = l % 4;
    me.out_f[0] = C[g][2 * t], me.out_f[1] = C[g][2 * t + 1];
    me.out_f[2] = C[g + 8][2 * t], me.out_f[3] = C[g + 8][2 * t + 1];
  }
  counters_.mma += 1;
}

inline void HostBlock::cp_async_16(void* dst, const void* src, bool valid, Site site) const {
  ClusterRun& r = *run_;
  Lane& me = r.lane(lane_);
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 ||
      (valid && reinterpret_cast<std::uintptr_t>(src) % 16 != 0))
    r.fail("cp.async at " + site.str() + ": an address is not 16-byte aligned");
  int block = 0;
  const std::size_t offset = r.locate(dst, 16, block, site);
  if (!r.failure_.empty()) return;
  r.shadow_.write(offset, 16, r.accessor(lane_), site, r.now(), true);
  Lane::Copy c{dst, {}, site};
  if (valid) std::memcpy(c.data, src, 16);
  std::memset(dst, 0xff, 16);  // NaN until the wait
  me.open.push_back(c);
  if (Counting::enabled()) {
    if (valid) me.log.push_back({src, 16, false, false, false, site.file, site.line});
    me.log.push_back({dst, 16, true, true, block != me.block_rank, site.file, site.line});
  }
}

inline void HostBlock::cp_async_commit() const {
  Lane& me = run_->lane(lane_);
  me.groups.push_back(std::move(me.open));
  me.open.clear();
}

/// cp.async.wait_group n: every committed group but the n most recent lands now.
inline void HostBlock::wait_copies(int n, Site site) const {
  if (!Mutation::get().enabled(SyncKind::copy_wait, site)) return;
  ClusterRun& r = *run_;
  Lane& me = r.lane(lane_);
  while (me.groups.size() > std::size_t(n)) {
    for (const Lane::Copy& c : me.groups.front()) {
      int block = 0;
      const std::size_t offset = r.locate(c.dst, 16, block, site);
      std::memcpy(c.dst, c.data, 16);
      r.shadow_.land(offset, 16, r.accessor(lane_), site);
    }
    me.groups.erase(me.groups.begin());
  }
}

template <class U>
U HostBlock::load_shared(const U* p, Site site) const {
  run_->shared_access(lane_, p, sizeof(U), false, site);
  U v;
  std::memcpy(&v, p, sizeof(U));
  return v;
}

template <class U>
void HostBlock::store_shared(U* p, const U& v, Site site) const {
  run_->shared_access(lane_, p, sizeof(U), true, site);
  std::memcpy(p, &v, sizeof(U));
}

template <class U>
U HostBlock::load_global(const U* p, Site site) const {
  check_global_alignment(p, sizeof(U), alignof(U), site);
  if (Counting::enabled())
    run_->lane(lane_).log.push_back(
        {p, std::uint32_t(sizeof(U)), false, false, false, site.file, site.line});
  U v;
  std::memcpy(&v, p, sizeof(U));
  return v;
}

template <class U>
void HostBlock::store_global(U* p, const U& v, Site site) const {
  check_global_alignment(p, sizeof(U), alignof(U), site);
  if (Counting::enabled())
    run_->lane(lane_).log.push_back(
        {p, std::uint32_t(sizeof(U)), false, true, false, site.file, site.line});
  std::memcpy(p, &v, sizeof(U));
}

inline void HostBlock::atomic_add_global(float* p, float v, Site site) const {
  if (Counting::enabled())
    run_->lane(lane_).log.push_back(
        {p, std::uint32_t(sizeof(float)), false, true, false, site.file, site.line});
  note_adder(p);
  *p += v;
}

inline void HostBlock::check_global_alignment(const void* p, std::size_t bytes,
                                              std::size_t alignment, Site site) const {
  if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0)
    run_->fail("a global access of " + std::to_string(bytes) + " bytes at " + site.str() +
               ": the address is not " + std::to_string(alignment) + "-byte aligned");
}

inline void HostBlock::atomic_add_global_pair(float* p, float x, float y, Site site) const {
  check_global_alignment(p, 2 * sizeof(float), 2 * sizeof(float), site);
  if (Counting::enabled())
    run_->lane(lane_).log.push_back(
        {p, std::uint32_t(2 * sizeof(float)), false, true, false, site.file, site.line});
  note_adder(p), note_adder(p + 1);
  p[0] += x, p[1] += y;
}

inline void HostBlock::note_adder(const float* p) const {
  const index_t adder = (block(2) * run_->shape_.y + block(1)) * run_->shape_.x + block(0);
  const auto [last, first] = run_->last_adder_.try_emplace(p, adder);
  if (!first && last->second != adder) ++run_->counters_.unordered_adds, last->second = adder;
}

inline void HostBlock::count_fma(index_t n) const {
  run_->lane(lane_).counters.fma += std::uint64_t(n);
}
inline void HostBlock::count_exp(index_t n) const {
  run_->lane(lane_).counters.exp += std::uint64_t(n);
}

// --- launches ----------------------------------------------------------------------------------

/// Bytes of stack per emulated thread (sanitizers' frames are larger).
#if defined(DCMHA_FIBER_ASAN) || defined(DCMHA_FIBER_TSAN)
constexpr std::size_t kLaneStackBytes = 1 << 20;
#else
constexpr std::size_t kLaneStackBytes = 256 << 10;
#endif

/// The counters of every launch since the last reset, process-wide (the cost model reads them).
class LaunchLog {
 public:
  static LaunchLog& get() {
    static LaunchLog log;
    return log;
  }
  void add(const char* kernel, const Counters& c) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({kernel, c});
  }
  std::vector<std::pair<std::string, Counters>> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(entries_);
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::string, Counters>> entries_;
};

/// Runs body(blk) for every thread of every block of the launch, as kernel<<<...>>> would with
/// the cluster dimension given: clusters in grid order, one at a time. Throws EmulationError
/// for a fatal error and std::logic_error listing the races found; returns the launch's counts.
template <class Body>
Counters launch(const char* kernel, const LaunchShape& shape, Body body) {
  if (shape.threads < 1 || shape.cluster < 1 || shape.cluster > kMaxClusterBlocks ||
      shape.x % shape.cluster != 0)
    throw EmulationError(std::string("dcmha::cuda::emulator: bad launch shape for ") + kernel +
                         ": threads " + std::to_string(shape.threads) + ", cluster " +
                         std::to_string(shape.cluster) + ", grid x " + std::to_string(shape.x) +
                         " (expected threads >= 1, a cluster of 1 to " +
                         std::to_string(kMaxClusterBlocks) + " blocks dividing x)");
  std::vector<Lane> lanes(static_cast<std::size_t>(shape.threads * shape.cluster));
  for (Lane& l : lanes) l.fiber = std::make_unique<Fiber>(kLaneStackBytes);
  ClusterRun run(shape, lanes);
  std::size_t races = 0;
  std::string first_races;
  for (index_t z = 0; z < shape.z; ++z)
    for (index_t y = 0; y < shape.y; ++y)
      for (index_t x = 0; x < shape.x; x += shape.cluster) {
        run.run(x, y, z, body);
        if (run.shadow().race_count() > 0 && races == 0)
          for (const Race& race : run.shadow().races()) first_races += "\n  " + race.what;
        races += run.shadow().race_count();
      }
  if (races > 0)
    throw std::logic_error(std::string("dcmha::cuda::emulator: ") + std::to_string(races) +
                           " shared-memory races in " + kernel + ", first:" + first_races);
  LaunchLog::get().add(kernel, run.counters());
  return run.counters();
}

}  // namespace dcmha::cuda::emulator
