// The emulator the CUDA kernels' tests run on (include/dcmha/cuda/emulator/): its warp-level
// instructions against plain matrix arithmetic with the PTX ISA's lane layouts, its asynchronous
// copies, and the errors it must catch (races, divergent collectives, deadlocks, misalignment).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <dcmha/cuda/emulator/emulator.hpp>

namespace {

namespace em = dcmha::cuda::emulator;
using em::HostBlock;

std::uint16_t bf16_bits(float x) { return Eigen::numext::bit_cast<std::uint16_t>(dcmha::bf16(x)); }
std::uint32_t pack(float lo, float hi) {
  return std::uint32_t(bf16_bits(lo)) | (std::uint32_t(bf16_bits(hi)) << 16);
}

/// Runs body on one block of `threads` threads with `shared` bytes.
template <class Body>
em::Counters run(int threads, std::size_t shared, Body body, int cluster = 1) {
  em::LaunchShape shape;
  shape.x = cluster;
  shape.threads = threads;
  shape.shared_bytes = shared;
  shape.cluster = cluster;
  return em::launch("test", shape, body);
}

// Small integers: every product and sum is exact in float.
float a_value(int m, int k) { return float((m * 7 + k * 3) % 11 - 5); }
float b_value(int k, int n) { return float((k * 5 + n * 9) % 13 - 6); }

TEST(CudaEmulator, MmaTakesThePtxFragmentLayout) {
  // Fragments built by hand from the PTX ISA's tables for mma.m16n8k16 (.row.col, bf16):
  // group g = lane / 4, t = lane % 4.
  float d[32][4];
  run(32, 0, [&](const HostBlock& blk) {
    const int l = blk.thread(), g = l / 4, t = l % 4;
    const std::uint32_t a[4] = {pack(a_value(g, 2 * t), a_value(g, 2 * t + 1)),
                                pack(a_value(g + 8, 2 * t), a_value(g + 8, 2 * t + 1)),
                                pack(a_value(g, 2 * t + 8), a_value(g, 2 * t + 9)),
                                pack(a_value(g + 8, 2 * t + 8), a_value(g + 8, 2 * t + 9))};
    const std::uint32_t b[2] = {pack(b_value(2 * t, g), b_value(2 * t + 1, g)),
                                pack(b_value(2 * t + 8, g), b_value(2 * t + 9, g))};
    float acc[4] = {1, 2, 3, 4};
    blk.mma_bf16(acc, a, b);
    for (int i = 0; i < 4; ++i) d[l][i] = acc[i];
  });
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
      float expected = float(i + 1);
      for (int k = 0; k < 16; ++k) expected += a_value(rows[i], k) * b_value(k, cols[i]);
      ASSERT_EQ(d[l][i], expected) << "lane " << l << " element " << i;
    }
  }
}

TEST(CudaEmulator, LdmatrixFeedsMmaAsOnTheDevice) {
  // A (16 x 16) row-major and B^T (8 x 16, [n][k]) in shared memory, loaded with the usual
  // addressing (ldmatrix.x4: lane l gives row l % 16, columns 8 (l / 16); .x2: row l % 8,
  // columns 8 (l / 8 % 2)); and B (16 x 8, [k][n]) loaded with .trans: the same product.
  float d[2][32][4];
  run(32, 3 * 16 * 16 * 2, [&](const HostBlock& blk) {
    auto* base = static_cast<std::uint16_t*>(blk.shared());
    std::uint16_t *a = base, *bt = base + 256, *b = base + 512;
    const int l = blk.thread();
    for (int i = l; i < 256; i += 32) {
      blk.store_shared(&a[i], bf16_bits(a_value(i / 16, i % 16)));
      if (i < 128) blk.store_shared(&bt[i], bf16_bits(b_value(i % 16, i / 16)));
      if (i < 128) blk.store_shared(&b[i], bf16_bits(b_value(i / 8, i % 8)));
    }
    blk.sync();
    std::uint32_t af[4], bf[2], bf_trans[2];
    blk.ldmatrix_x4(af, a + (l % 16) * 16 + (l / 16) * 8);
    blk.ldmatrix_x2(bf, bt + (l % 8) * 16 + (l / 8 % 2) * 8);
    blk.ldmatrix_x2_trans(bf_trans, b + (l % 16) * 8);
    float acc[4] = {0, 0, 0, 0}, acc_trans[4] = {0, 0, 0, 0};
    blk.mma_bf16(acc, af, bf);
    blk.mma_bf16(acc_trans, af, bf_trans);
    for (int i = 0; i < 4; ++i) d[0][l][i] = acc[i], d[1][l][i] = acc_trans[i];
  });
  for (int v = 0; v < 2; ++v)
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
      for (int i = 0; i < 4; ++i) {
        float expected = 0;
        for (int k = 0; k < 16; ++k) expected += a_value(rows[i], k) * b_value(k, cols[i]);
        ASSERT_EQ(d[v][l][i], expected) << (v ? "trans " : "") << "lane " << l << " " << i;
      }
    }
}

TEST(CudaEmulator, FloatSixteenMmaWidensHalves) {
  float d[32][4];
  run(32, 0, [&](const HostBlock& blk) {
    const int l = blk.thread();
    auto h = [](float x) {
      return std::uint32_t(Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x)));
    };
    const std::uint32_t one = h(1.0f) | (h(0.5f) << 16);
    const std::uint32_t a[4] = {one, one, one, one}, b[2] = {one, one};
    float acc[4] = {0, 0, 0, 0};
    blk.mma_f16(acc, a, b);
    for (int i = 0; i < 4; ++i) d[l][i] = acc[i];
  });
  // Row of A: 1, 0.5 repeated; column of B: 1, 0.5 repeated: 8 * (1 + 0.25).
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) ASSERT_EQ(d[l][i], 10.0f);
}

TEST(CudaEmulator, ShuffleXorSwapsLanes) {
  float got[32];
  run(32, 0,
      [&](const HostBlock& blk) { got[blk.thread()] = blk.shfl_xor(float(blk.thread()), 5); });
  for (int l = 0; l < 32; ++l) EXPECT_EQ(got[l], float(l ^ 5));
}

TEST(CudaEmulator, AsynchronousCopiesLandAtTheirWait) {
  alignas(16) float source[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  float before[4], after[4], zeros[4];
  run(32, 64, [&](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    if (blk.thread() == 0) {
      blk.cp_async_16(s, source, true);
      blk.cp_async_16(s + 4, source + 4, false);  // zero-fill
      blk.cp_async_commit();
      // Reading now is an error the emulator reports; read the raw bytes instead.
      std::memcpy(before, s, 16);
      blk.cp_async_wait<0>();
      for (int i = 0; i < 4; ++i) after[i] = blk.load_shared(&s[i]), zeros[i] = s[4 + i];
    }
  });
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isnan(before[i]));
    EXPECT_EQ(after[i], source[i]);
    EXPECT_EQ(zeros[i], 0.0f);
  }
}

/// The message of the std::logic_error (race report or emulation error) body throws, or "".
template <class Body>
std::string failure_of(int threads, Body body, int cluster = 1) {
  try {
    run(threads, 256, body, cluster);
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaEmulator, ReportsAReadOfACopyBeforeItsWait) {
  alignas(16) float source[4] = {1, 2, 3, 4};
  const std::string e = failure_of(32, [&](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    if (blk.thread() != 0) return;
    blk.cp_async_16(s, source, true);
    blk.cp_async_commit();
    (void)blk.load_shared(&s[0]);
    blk.cp_async_wait<0>();
  });
  EXPECT_NE(e.find("before its wait"), std::string::npos) << e;
}

TEST(CudaEmulator, CatchesRacesAndAcceptsBarriers) {
  // Thread 40 (another warp) reads what thread 0 wrote: a race without a barrier between.
  auto body = [](bool barrier) {
    return [barrier](const HostBlock& blk) {
      auto* s = static_cast<float*>(blk.shared());
      if (blk.thread() == 0) blk.store_shared(&s[0], 1.0f);
      if (barrier) blk.sync();
      if (blk.thread() == 40) (void)blk.load_shared(&s[0]);
    };
  };
  EXPECT_NE(failure_of(64, body(false)).find("read after another thread's write"),
            std::string::npos);
  EXPECT_EQ(failure_of(64, body(true)), "");
  // Write after another thread's read (the next tile overwriting a buffer still being read).
  EXPECT_NE(failure_of(64,
                       [](const HostBlock& blk) {
                         auto* s = static_cast<float*>(blk.shared());
                         if (blk.thread() == 5) blk.store_shared(&s[0], 1.0f);
                         blk.sync();
                         // Lanes run in thread order here, so thread 0 reads first.
                         if (blk.thread() == 0) (void)blk.load_shared(&s[0]);
                         if (blk.thread() == 40) blk.store_shared(&s[0], 2.0f);
                       })
                .find("write after another thread's read"),
            std::string::npos);
}

TEST(CudaEmulator, WarpSyncOrdersOnlyItsWarp) {
  auto body = [](int reader, bool warp_sync) {
    return [reader, warp_sync](const HostBlock& blk) {
      auto* s = static_cast<float*>(blk.shared());
      if (blk.thread() == 3) blk.store_shared(&s[0], 1.0f);
      if (warp_sync) blk.sync_warp();
      if (blk.thread() == reader) (void)blk.load_shared(&s[0]);
    };
  };
  EXPECT_EQ(failure_of(64, body(17, true)), "");   // same warp, synced
  EXPECT_NE(failure_of(64, body(17, false)), "");  // same warp, not synced
  EXPECT_NE(failure_of(64, body(35, true)).find("read after"), std::string::npos);  // other warp
}

TEST(CudaEmulator, ClusterBarrierOrdersPeerBlocks) {
  auto body = [](bool barrier) {
    return [barrier](const HostBlock& blk) {
      auto* s = static_cast<float*>(blk.shared());
      if (blk.cluster_rank() == 1 && blk.thread() == 0) blk.store_shared(&s[0], 7.0f);
      if (barrier)
        blk.sync_cluster();
      else
        blk.sync();  // orders each block only
      if (blk.cluster_rank() == 0 && blk.thread() == 0) {
        const float v = blk.load_shared(blk.peer_shared(&s[0], 1));
        if (barrier && v != 7.0f) throw std::logic_error("peer value not seen");
      }
      blk.sync_cluster();  // block 1's memory stays until block 0 is done with it
    };
  };
  EXPECT_EQ(failure_of(32, body(true), 2), "");
  EXPECT_NE(failure_of(32, body(false), 2).find("read after"), std::string::npos);
}

TEST(CudaEmulator, APeerMayNotExitBeforeItsPeersAreDone) {
  // Block 1 reads block 0's shared memory after their last cluster barrier: block 0 may be gone.
  auto body = [](bool final_barrier) {
    return [final_barrier](const HostBlock& blk) {
      auto* s = static_cast<float*>(blk.shared());
      if (blk.thread() == 0) blk.store_shared(&s[0], 1.0f);
      blk.sync_cluster();
      if (blk.cluster_rank() == 1 && blk.thread() == 0)
        (void)blk.load_shared(blk.peer_shared(&s[0], 0));
      if (final_barrier) blk.sync_cluster();
    };
  };
  EXPECT_EQ(failure_of(32, body(true), 2), "");
  // Caught whichever of the two the schedule runs first: the peer's exit, or the read after it.
  const std::string e = failure_of(32, body(false), 2);
  EXPECT_TRUE(e.find("exits while a peer") != std::string::npos ||
              e.find("whose threads have exited") != std::string::npos)
      << e;
}

TEST(CudaEmulator, DivergentCollectivesAndDeadlocksAreErrors) {
  EXPECT_NE(failure_of(32,
                       [](const HostBlock& blk) {
                         if (blk.thread() < 16)
                           (void)blk.shfl_xor(1.0f, 1);
                         else
                           blk.sync_warp();
                       })
                .find("divergent warp"),
            std::string::npos);
  EXPECT_NE(failure_of(64,
                       [](const HostBlock& blk) {
                         if (blk.thread() < 32) blk.sync();
                       })
                .find("deadlock"),
            std::string::npos);
  EXPECT_NE(failure_of(32,
                       [](const HostBlock& blk) {
                         auto* s = static_cast<std::uint16_t*>(blk.shared());
                         std::uint32_t r[4];
                         blk.ldmatrix_x4(r, s + 1);  // not 16-byte aligned
                       })
                .find("not 16-byte aligned"),
            std::string::npos);
  EXPECT_NE(failure_of(32,
                       [](const HostBlock& blk) {
                         auto* s = static_cast<float*>(blk.shared());
                         (void)blk.load_shared(&s[64]);  // the launch has 256 bytes
                       })
                .find("outside the block"),
            std::string::npos);
}

TEST(CudaEmulator, ClustersOfUpToSixteenBlocks) {
  // 16 blocks, the largest cluster a device allows, each block's rank kept whole by the race
  // detector: blocks 15 and 7 (apart in the fourth bit only) ordered by their block barriers
  // alone are not ordered, and block 7 reading what block 15 wrote is a race. (Block 7 reaches
  // its barrier first; block 15 writes before block 7 goes on.)
  const auto peer_read = [](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    if (blk.cluster_rank() == 15 && blk.thread() == 0) blk.store_shared(&s[0], 1.0f);
    blk.sync();
    if (blk.cluster_rank() == 7 && blk.thread() == 0)
      (void)blk.load_shared(blk.peer_shared(&s[0], 15));
    blk.sync_cluster();
  };
  EXPECT_NE(failure_of(32, peer_read, 16).find("read after another thread's write"),
            std::string::npos);
  const auto nothing = [](const HostBlock&) {};
  EXPECT_NE(failure_of(32, nothing, 17).find("cluster 17"), std::string::npos);
  EXPECT_NE(failure_of(0, nothing).find("threads 0"), std::string::npos);
}

TEST(CudaEmulator, ADisabledSyncSiteIsSkipped) {
  auto body = [](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    if (blk.thread() == 0) blk.store_shared(&s[0], 1.0f);
    blk.sync();
    if (blk.thread() == 40) (void)blk.load_shared(&s[0]);
  };
  em::Mutation::get().forget_seen();
  EXPECT_EQ(failure_of(64, body), "");
  const std::set<em::SyncSite> seen = em::Mutation::get().seen();
  ASSERT_EQ(seen.size(), 1u);
  em::Mutation::get().disable(*seen.begin());
  const std::string e = failure_of(64, body);
  em::Mutation::get().clear();
  EXPECT_NE(e.find("read after"), std::string::npos) << e;
}

TEST(CudaEmulator, CountsSectorsAndBankConflicts) {
  alignas(32) float global[64] = {};
  em::Counting::enabled() = true;
  const em::Counters c = run(32, 32 * 33 * 4, [&](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    const int l = blk.thread();
    (void)blk.load_global(&global[l]);   // 128 contiguous bytes: 4 sectors
    blk.store_shared(&s[l], 1.0f);       // one wavefront
    blk.store_shared(&s[l * 32], 1.0f);  // every lane in bank 0: 32 wavefronts
    (void)blk.load_shared(&s[32 * 32]);  // the same word for all: one wavefront
  });
  em::Counting::enabled() = false;
  EXPECT_EQ(c.global_load_sectors, 4u);
  EXPECT_EQ(c.global_load_bytes, 128u);
  EXPECT_EQ(c.shared_requests, 3u);
  EXPECT_EQ(c.shared_wavefronts, 1u + 32u + 1u);
}

TEST(CudaEmulator, BreaksCountsDownByCallSite) {
  // Each site's counts under its own "file:line kind", and together the launch's totals.
  alignas(32) float global[64] = {};
  int load_line = 0, store_line = 0, shuffle_line = 0;
  em::Counting::enabled() = em::Counting::sites() = true;
  const em::Counters c = run(32, 32 * 33 * 4, [&](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    const int l = blk.thread();
    for (int i = 0; i < 2; ++i) {
      // clang-format off
      load_line = __LINE__; const float x = blk.load_global(&global[l + 32 * i]);
      store_line = __LINE__; blk.store_shared(&s[l * 32], x);  // 32 wavefronts
      shuffle_line = __LINE__; (void)blk.shfl_xor(x, 1);
      // clang-format on
    }
  });
  em::Counting::enabled() = em::Counting::sites() = false;
  const std::string file = __FILE__;
  auto at = [&](int line, const char* kind) {
    const auto it = c.sites.find(file + ":" + std::to_string(line) + " " + kind);
    return it == c.sites.end() ? em::SiteCounts{} : it->second;
  };
  ASSERT_EQ(c.sites.size(), 3u);
  EXPECT_EQ(at(load_line, "global load").instructions, 2u);
  EXPECT_EQ(at(load_line, "global load").global_sectors, 8u);
  EXPECT_EQ(at(store_line, "shared store").shared_wavefronts, 64u);
  EXPECT_EQ(at(shuffle_line, "shuffle").shuffles, 2u);
  em::SiteCounts sum;
  for (const auto& [site, counts] : c.sites) sum += counts;
  EXPECT_EQ(sum.shared_wavefronts, c.shared_wavefronts);
  EXPECT_EQ(sum.shuffles, c.shuffles);
  EXPECT_EQ(sum.global_sectors, c.global_load_sectors + c.global_store_sectors);
}

TEST(CudaEmulator, ABranchSomeLanesSkipDoesNotShiftTheOthers) {
  // Half the warp stores first (banks 0-15), then every lane stores one of 32 consecutive words:
  // two instructions of one wavefront each. Matching the lanes' accesses by index instead would
  // pair the upper lanes' second store (banks 0-15 again) with the first: three.
  em::Counting::enabled() = true;
  const em::Counters c = run(32, 128 * 4, [&](const HostBlock& blk) {
    auto* s = static_cast<float*>(blk.shared());
    const int l = blk.thread();
    if (l < 16) blk.store_shared(&s[64 + l], 1.0f);
    blk.store_shared(&s[16 + l], 1.0f);
  });
  em::Counting::enabled() = false;
  EXPECT_EQ(c.shared_requests, 2u);
  EXPECT_EQ(c.shared_wavefronts, 2u);
}

TEST(CudaEmulator, CountsEachPeerWordOnce) {
  // DSMEM bytes: the distinct words of other blocks an instruction reads, whichever lanes read
  // them; a block's own memory is not DSMEM.
  em::Counting::enabled() = true;
  const em::Counters c = run(
      32, 64 * 4,
      [&](const HostBlock& blk) {
        auto* s = static_cast<float*>(blk.shared());
        const int l = blk.thread(), peer = 1 - blk.cluster_rank();
        blk.store_shared(&s[l], 1.0f);
        blk.sync_cluster();
        (void)blk.load_shared(blk.peer_shared(&s[l], peer));         // 32 words
        (void)blk.load_shared(blk.peer_shared(&s[l / 8], peer));     // 4 words, 8 lanes each
        (void)blk.load_shared(l < 16 ? blk.peer_shared(&s[l], peer)  // 16 words, the rest own
                                     : &s[l]);
        blk.sync_cluster();
      },
      2);
  em::Counting::enabled() = false;
  EXPECT_EQ(c.peer_shared_bytes, 2u * 4u * (32u + 4u + 16u));
}

TEST(CudaEmulator, PairedReductionsAndTheAlignmentOfGlobalAccesses) {
  // red.global.add.v2.f32 adds two floats as one 8-byte access (a warp's 32 pairs: 8 sectors);
  // a global access whose address is not a multiple of its size faults on the device and fails
  // here, naming the site.
  alignas(32) float sums[64] = {};
  em::Counting::enabled() = true;
  const em::Counters c = run(32, 0, [&](const HostBlock& blk) {
    const int l = blk.thread();
    blk.atomic_add_global_pair(&sums[2 * l], float(l), -float(l));
    blk.atomic_add_global_pair(&sums[2 * l], 0.5f, 0.25f);
  });
  em::Counting::enabled() = false;
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(sums[2 * l], float(l) + 0.5f) << l;
    EXPECT_EQ(sums[2 * l + 1], -float(l) + 0.25f) << l;
  }
  EXPECT_EQ(c.global_store_sectors, 2u * 8u);
  EXPECT_EQ(c.global_store_bytes, 2u * 256u);
  EXPECT_EQ(c.unordered_adds, 0u);  // one block
  EXPECT_NE(failure_of(32,
                       [&](const HostBlock& blk) {
                         blk.atomic_add_global_pair(&sums[1 + 2 * blk.thread()], 1.0f, 1.0f);
                       })
                .find("not 8-byte aligned"),
            std::string::npos);
  alignas(8) std::uint16_t halves[80] = {};
  EXPECT_NE(failure_of(32,
                       [&](const HostBlock& blk) {
                         blk.store_global(
                             reinterpret_cast<std::uint32_t*>(&halves[1 + 2 * blk.thread()]),
                             std::uint32_t(1));
                       })
                .find("not 4-byte aligned"),
            std::string::npos);
  EXPECT_EQ(failure_of(32,
                       [&](const HostBlock& blk) {
                         blk.store_global(
                             reinterpret_cast<std::uint32_t*>(&halves[2 * blk.thread()]),
                             std::uint32_t(1));
                       }),
            "");
}

}  // namespace
