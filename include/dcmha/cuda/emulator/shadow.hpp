#pragma once
// The emulator's race detector: a shadow record per 2 bytes of a cluster's shared memory, saying
// who last wrote it and who read it since, with the synchronization generations they had then.
// An access is ordered after an earlier one of another thread only through a barrier both passed
// since: a block barrier (same block), a cluster barrier (any block of the cluster), or a warp
// sync (same warp). Anything else is a race, reported with both sites. Destinations of
// asynchronous copies are marked pending from the copy until its wait: reading or writing them
// then is an error too (and reads see NaN, which the copy put there).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dcmha::cuda::emulator {

/// Where a kernel called the emulator from: a warp instruction, a barrier, a memory access.
struct Site {
  const char* file = "?";
  int line = 0;
  static Site here(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return {file, line};
  }
  std::string str() const;
};

inline std::string Site::str() const {
  std::string f = file;
  const std::size_t slash = f.find("include/dcmha/");
  if (slash != std::string::npos) f = f.substr(slash + 8);
  return f + ":" + std::to_string(line);
}

/// The largest cluster a device allows (8 is portable): the detector's records hold a cluster
/// rank in a byte, and the emulator refuses larger clusters.
inline constexpr int kMaxClusterBlocks = 16;

/// One thread as the detector sees it, and the generations of the barriers it has passed.
struct Accessor {
  int thread = 0;  // in the cluster: block rank * threads + thread
  int warp = 0;    // in the cluster
  int block = 0;   // cluster rank
  std::uint32_t block_generation = 0, cluster_generation = 0, warp_generation = 0;
};

/// An access as recorded: who, at which generations, from where. 32 bytes, so that a cell (the
/// last write and the reads since) fills one 64-byte cache line: the detector runs on every
/// shared-memory access the emulated kernels make, and is most of the emulated suites' time.
struct AccessRecord {
  static constexpr int kNone = -1, kMany = -2;
  std::int32_t thread = kNone;
  std::int16_t warp = kNone;
  std::int8_t block = kNone;  // cluster rank, below kMaxClusterBlocks
  bool pending = false;       // a write: an asynchronous copy's destination, until its wait
  std::uint32_t block_generation = 0, cluster_generation = 0, warp_generation = 0;
  std::int32_t line = 0;
  const char* file = "?";

  bool empty() const { return thread == kNone; }
  Site site() const { return {file, line}; }
  /// The same accessor at the same generations (and the same pending state): the first 20
  /// bytes, compared as whole words (field by field, the compiler merged fields into words that
  /// the stores of a copy had written in halves, and the loads waited on them).
  bool same(const AccessRecord& o) const {
    return word(0) == o.word(0) && word(8) == o.word(8) && warp_generation == o.warp_generation;
  }
  static AccessRecord of(const Accessor& a, Site site) {
    AccessRecord r;
    r.thread = a.thread;
    r.warp = static_cast<std::int16_t>(a.warp);
    r.block = static_cast<std::int8_t>(a.block);
    r.block_generation = a.block_generation;
    r.cluster_generation = a.cluster_generation;
    r.warp_generation = a.warp_generation;
    r.line = site.line;
    r.file = site.file;
    return r;
  }

 private:
  std::uint64_t word(std::size_t offset) const {
    std::uint64_t w;
    std::memcpy(&w, reinterpret_cast<const unsigned char*>(this) + offset, sizeof w);
    return w;
  }
};
static_assert(kMaxClusterBlocks <= 127, "a cluster rank fits the record's byte");
static_assert(sizeof(AccessRecord) == 32 && offsetof(AccessRecord, warp_generation) == 16,
              "same() compares the identity as two words and the warp generation");

/// The generations now, for the accessor's comparisons.
struct Generations {
  const std::vector<std::uint32_t>* block = nullptr;  // per cluster rank
  const std::vector<std::uint32_t>* warp = nullptr;   // per warp of the cluster
  std::uint32_t cluster = 0;
};

/// Whether every access of `r` happened before a barrier that `a` has passed since.
inline bool ordered_before(const AccessRecord& r, const Accessor& a, const Generations& now) {
  if (r.empty()) return true;
  if (r.thread == a.thread) return true;
  if (r.cluster_generation < now.cluster) return true;
  if (r.block >= 0 && r.block == a.block &&
      r.block_generation < (*now.block)[static_cast<std::size_t>(r.block)])
    return true;
  if (r.warp >= 0 && r.warp == a.warp &&
      r.warp_generation < (*now.warp)[static_cast<std::size_t>(r.warp)])
    return true;
  return false;
}

/// The records of 2 bytes: 64, a cache line.
struct alignas(64) ShadowCell {
  AccessRecord write, reads;
};

/// What one race looked like.
struct Race {
  std::string what;
};

/// The shadow of one cluster's shared memory (all its blocks, at `stride` bytes apart).
class Shadow {
 public:
  void reset(std::size_t bytes) { cells_.assign((bytes + 1) / 2, ShadowCell{}); }

  /// Checks a read of bytes [offset, offset + n) by `a`, then records it. Neighbouring cells
  /// mostly hold the same records (a row written by one thread, read by one): a cell whose
  /// records were the last decided cell's takes that cell's outcome.
  void read(std::size_t offset, std::size_t n, const Accessor& a, Site site,
            const Generations& now) {
    const AccessRecord me = AccessRecord::of(a, site);
    const ShadowCell* decided = nullptr;  // its write, and its reads before this access:
    AccessRecord decided_reads;           // the same records repeat
    for (std::size_t c = offset / 2; c < (offset + n + 1) / 2 && c < cells_.size(); ++c) {
      ShadowCell& cell = cells_[c];
      if (cell.write.pending) {
        report("read of an asynchronous copy's destination before its wait", c, a, site,
               cell.write.site());
        decided = nullptr;
        continue;
      }
      if (decided != nullptr && decided->write.same(cell.write) && decided_reads.same(cell.reads)) {
        cell.reads = decided->reads;
        continue;
      }
      if (cell.write.thread != a.thread && !ordered_before(cell.write, a, now))
        report("read after another thread's write with no barrier between", c, a, site,
               cell.write.site());
      decided_reads = cell.reads;
      if (!cell.reads.same(me)) merge_read(cell.reads, a, site, now);
      decided = &cell;
    }
  }

  /// Checks a write of bytes [offset, offset + n) by `a`, then records it (pending: the
  /// destination of an asynchronous copy, landing at the issuing thread's wait).
  void write(std::size_t offset, std::size_t n, const Accessor& a, Site site,
             const Generations& now, bool pending = false) {
    AccessRecord me = AccessRecord::of(a, site);
    me.pending = pending;
    for (std::size_t c = offset / 2; c < (offset + n + 1) / 2 && c < cells_.size(); ++c) {
      ShadowCell& cell = cells_[c];
      if (cell.write.pending)
        report("write to an asynchronous copy's destination before its wait", c, a, site,
               cell.write.site());
      else if (!ordered_before(cell.write, a, now))
        report("write after another thread's write with no barrier between", c, a, site,
               cell.write.site());
      else if (!reads_ordered_before_write(cell.reads, a, now))
        report("write after another thread's read with no barrier between", c, a, site,
               cell.reads.site());
      cell.write = me;
      cell.reads = AccessRecord{};
    }
  }

  /// An asynchronous copy of `a` into [offset, offset + n) lands: a write at this moment.
  void land(std::size_t offset, std::size_t n, const Accessor& a, Site site) {
    const AccessRecord me = AccessRecord::of(a, site);
    for (std::size_t c = offset / 2; c < (offset + n + 1) / 2 && c < cells_.size(); ++c) {
      cells_[c].write = me;
      cells_[c].reads = AccessRecord{};
    }
  }

  const std::vector<Race>& races() const { return races_; }
  std::size_t race_count() const { return race_count_; }

 private:
  /// A later write by `a` is ordered after the recorded reads when each of them is: the
  /// record keeps their common thread, warp and block where they share one.
  static bool reads_ordered_before_write(const AccessRecord& r, const Accessor& a,
                                         const Generations& now) {
    if (r.empty() || r.thread == a.thread) return true;
    if (r.cluster_generation < now.cluster) return true;
    if (r.block >= 0 && r.block == a.block &&
        r.block_generation < (*now.block)[static_cast<std::size_t>(r.block)])
      return true;
    return r.warp >= 0 && r.warp == a.warp &&
           r.warp_generation < (*now.warp)[static_cast<std::size_t>(r.warp)];
  }

  static void merge_read(AccessRecord& r, const Accessor& a, Site site, const Generations& now) {
    // Reads a block (or cluster) barrier has ordered before this one are ordered before any
    // later write in the block as well: only reads since that barrier need remembering.
    const bool stale =
        r.empty() || r.cluster_generation < now.cluster ||
        (r.block >= 0 && r.block_generation < (*now.block)[static_cast<std::size_t>(r.block)]);
    if (stale) {
      r = AccessRecord::of(a, site);
      return;
    }
    if (r.thread != a.thread) r.thread = AccessRecord::kMany;
    if (r.warp != a.warp) r.warp = AccessRecord::kMany;
    if (r.block != a.block) r.block = AccessRecord::kMany;
    if (a.warp_generation > r.warp_generation) r.warp_generation = a.warp_generation;
    r.line = site.line;
    r.file = site.file;
  }

  void report(const char* what, std::size_t cell, const Accessor& a, Site site, Site other) {
    ++race_count_;
    if (races_.size() >= 8) return;
    races_.push_back({std::string(what) + ": thread " + std::to_string(a.thread) + " at " +
                      site.str() + ", shared byte " + std::to_string(2 * cell) +
                      ", earlier access at " + other.str()});
  }

  std::vector<ShadowCell> cells_;
  std::vector<Race> races_;
  std::size_t race_count_ = 0;
};

}  // namespace dcmha::cuda::emulator
