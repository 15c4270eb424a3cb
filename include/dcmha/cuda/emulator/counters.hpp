#pragma once
// What the emulator counts per launch, for the cost model (tools/cost_model): global memory in
// 32-byte sectors, shared memory in wavefronts (a bank-conflicted access replays), tensor-core
// and CUDA-core operations, barriers. A warp instruction's accesses are the lanes' n-th accesses
// from one call site since the warp last met (at a collective or a barrier): exact for convergent
// code, and a branch some lanes skip does not shift the others' accesses.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dcmha::cuda::emulator {

/// One call site's part of a launch's counts (Counting::sites()): what its warp instructions
/// cost the shared-memory unit, DSMEM and L2.
struct SiteCounts {
  std::uint64_t instructions = 0, shared_wavefronts = 0, shuffles = 0;
  std::uint64_t peer_shared_bytes = 0, global_sectors = 0;

  SiteCounts& operator+=(const SiteCounts& o) {
    instructions += o.instructions, shared_wavefronts += o.shared_wavefronts;
    shuffles += o.shuffles, peer_shared_bytes += o.peer_shared_bytes;
    global_sectors += o.global_sectors;
    return *this;
  }
};

struct Counters {
  std::uint64_t blocks = 0, threads = 0;
  std::uint64_t global_load_bytes = 0, global_load_sectors = 0;
  std::uint64_t global_store_bytes = 0, global_store_sectors = 0;
  std::uint64_t shared_bytes = 0, shared_requests = 0, shared_wavefronts = 0;
  std::uint64_t peer_shared_bytes = 0;  // another block's shared memory (a cluster's DSMEM)
  std::uint64_t mma = 0;                // m16n8k16 tensor-core instructions (2,048 multiply-adds)
  std::uint64_t fma = 0, exp = 0;  // CUDA-core multiply-adds and exponentials the kernels count
  // Barriers met, once per block that waits: a cluster barrier once for each block of the cluster.
  std::uint64_t shuffles = 0, block_barriers = 0, cluster_barriers = 0, warp_syncs = 0;
  // Atomic adds to an address that another block of the launch added to before: their order,
  // and so the sum's last bits, are the schedule's (0 for a deterministic launch).
  std::uint64_t unordered_adds = 0;
  // By "file:line kind" (shared load, shared store, global load, global store, shuffle), where
  // Counting::sites() is on; empty otherwise.
  std::map<std::string, SiteCounts> sites;

  Counters& operator+=(const Counters& o) {
    blocks += o.blocks, threads += o.threads;
    global_load_bytes += o.global_load_bytes, global_load_sectors += o.global_load_sectors;
    global_store_bytes += o.global_store_bytes, global_store_sectors += o.global_store_sectors;
    shared_bytes += o.shared_bytes, shared_requests += o.shared_requests;
    shared_wavefronts += o.shared_wavefronts, peer_shared_bytes += o.peer_shared_bytes;
    mma += o.mma, fma += o.fma, exp += o.exp, shuffles += o.shuffles;
    block_barriers += o.block_barriers, cluster_barriers += o.cluster_barriers;
    warp_syncs += o.warp_syncs, unordered_adds += o.unordered_adds;
    for (const auto& [site, counts] : o.sites) sites[site] += counts;
    return *this;
  }
};

/// One lane's memory access, as logged between two meetings of its warp, with its call site.
struct LoggedAccess {
  const void* address = nullptr;
  std::uint32_t bytes = 0;
  bool shared = false, store = false, peer = false;
  const char* file = "";
  int line = 0;
};

/// A warp's logged accesses as instructions: the lanes' n-th accesses of one kind from one call
/// site since the warp last met, together. Convergent code gives each instruction its lanes;
/// a lane that skips a branch's accesses (an owner-only update) does not shift the others.
inline std::vector<std::vector<LoggedAccess>> instructions_of(
    const std::vector<const std::vector<LoggedAccess>*>& lanes) {
  using Site = std::tuple<const char*, int, bool, bool>;  // call site and kind
  using Key = std::pair<Site, std::size_t>;               // and occurrence
  std::vector<std::pair<Key, const LoggedAccess*>> keyed;
  for (const std::vector<LoggedAccess>* log : lanes) {
    std::map<Site, std::size_t> visits;
    for (const LoggedAccess& a : *log) {
      const Site site{a.file, a.line, a.shared, a.store};
      keyed.push_back({{site, visits[site]++}, &a});
    }
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::vector<LoggedAccess>> out;
  for (std::size_t i = 0; i < keyed.size(); ++i) {
    if (i == 0 || keyed[i].first != keyed[i - 1].first) out.emplace_back();
    out.back().push_back(*keyed[i].second);
  }
  return out;
}

/// The 32-byte sectors a warp instruction's accesses touch.
inline std::uint64_t sectors_of(const std::vector<LoggedAccess>& lanes) {
  std::vector<std::uintptr_t> sectors;
  for (const LoggedAccess& a : lanes) {
    const auto first = reinterpret_cast<std::uintptr_t>(a.address) / 32;
    const auto last = (reinterpret_cast<std::uintptr_t>(a.address) + a.bytes - 1) / 32;
    for (std::uintptr_t s = first; s <= last; ++s) sectors.push_back(s);
  }
  std::sort(sectors.begin(), sectors.end());
  return static_cast<std::uint64_t>(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
}

/// The bytes a warp instruction moves between blocks of a cluster (DSMEM): each distinct address
/// of another block once, as lanes reading the same word share one transfer.
inline std::uint64_t peer_bytes_of(const std::vector<LoggedAccess>& lanes) {
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> seen;
  for (const LoggedAccess& a : lanes)
    if (a.peer) seen.emplace_back(reinterpret_cast<std::uintptr_t>(a.address), a.bytes);
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
  std::uint64_t bytes = 0;
  for (const auto& s : seen) bytes += s.second;
  return bytes;
}

/// Shared-memory wavefronts of accesses made together: 32 banks of 4 bytes deliver one word each
/// per wavefront, the same word to any number of lanes; the most distinct words any bank must
/// deliver is the wavefront count.
inline std::uint64_t wavefronts_of(const LoggedAccess* lanes, std::size_t n) {
  std::vector<std::uintptr_t> words;
  for (std::size_t i = 0; i < n; ++i) {
    const auto first = reinterpret_cast<std::uintptr_t>(lanes[i].address) / 4;
    const auto last = (reinterpret_cast<std::uintptr_t>(lanes[i].address) + lanes[i].bytes - 1) / 4;
    for (std::uintptr_t w = first; w <= last; ++w) words.push_back(w);
  }
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  std::uint64_t per_bank[32] = {};
  std::uint64_t most = 0;
  for (std::uintptr_t w : words) most = std::max(most, ++per_bank[w % 32]);
  return most;
}

/// A warp instruction's shared-memory wavefronts: accesses of 8 bytes go in two phases of 16
/// lanes, of 16 bytes in four of 8 (the hardware's), each phase counted as above.
inline std::uint64_t shared_wavefronts(const std::vector<LoggedAccess>& lanes) {
  if (lanes.empty()) return 0;
  const std::uint32_t bytes = lanes.front().bytes;
  const std::size_t phase = bytes >= 16 ? 8 : bytes == 8 ? 16 : 32;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < lanes.size(); i += phase)
    total += wavefronts_of(lanes.data() + i, std::min(phase, lanes.size() - i));
  return total;
}

}  // namespace dcmha::cuda::emulator
