// The compose pass's sums over groups of adjacent lanes (cuda/compose_pass.hpp), run by the
// emulator for every group size a warp holds: sum_values_over_parts gives every lane of a group
// every sum, scatter_sums_over_parts leaves each sum with one lane of it. Both must give the bits
// of summing each value alone (sum_over_parts), which the kernels' results rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <dcmha/cuda/compose_pass.hpp>
#include <dcmha/cuda/emulator/emulator.hpp>

namespace {

namespace em = dcmha::cuda::emulator;
using dcmha::cuda::kWarpSize;
using em::HostBlock;

template <class Body>
void run_warp(Body body) {
  em::LaunchShape shape;
  shape.threads = kWarpSize;
  em::launch("test", shape, body);
}

// Values whose sums round: the order of the additions shows in the bits.
float lane_value(int lane, int i) { return std::sin(float(lane * 37 + i * 11 + 1)) * 1e3f; }

std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

constexpr int kPartCounts[] = {1, 2, 4, 8, 16, 32};

template <int N>
void expect_every_lane_gets_every_sum(int parts) {
  std::vector<float> got(kWarpSize * N), alone(kWarpSize * N);
  run_warp([&](const HostBlock& blk) {
    const int lane = blk.thread();
    float v[N];
    for (int i = 0; i < N; ++i) v[i] = lane_value(lane, i);
    for (int i = 0; i < N; ++i) alone[lane * N + i] = dcmha::cuda::sum_over_parts(blk, v[i], parts);
    dcmha::cuda::sum_values_over_parts(blk, v, parts);
    for (int i = 0; i < N; ++i) got[lane * N + i] = v[i];
  });
  for (int lane = 0; lane < kWarpSize; ++lane)
    for (int i = 0; i < N; ++i) {
      double sum = 0;
      for (int p = 0; p < parts; ++p) sum += lane_value(lane - lane % parts + p, i);
      const float g = got[lane * N + i];
      EXPECT_EQ(bits(g), bits(alone[lane * N + i])) << "N " << N << " parts " << parts;
      EXPECT_NEAR(g, sum, 1e-5 * parts * 1e3) << "N " << N << " parts " << parts;
    }
}

TEST(CudaWarpSums, EveryLaneOfAGroupGetsEverySumInTheBitsOfSummingAlone) {
  for (int parts : kPartCounts) {
    expect_every_lane_gets_every_sum<1>(parts);
    expect_every_lane_gets_every_sum<2>(parts);
    expect_every_lane_gets_every_sum<4>(parts);
    expect_every_lane_gets_every_sum<8>(parts);
    expect_every_lane_gets_every_sum<16>(parts);
  }
}

template <int N>
void expect_each_sum_left_with_one_lane(int parts) {
  // taken[lane][i]: how often the lane was given element i (got: its value); padding past N
  // (elements k parts + part >= N) must be given zeros.
  std::vector<int> taken(kWarpSize * N, 0);
  std::vector<float> got(kWarpSize * N), alone(kWarpSize * N);
  std::vector<int> bad_padding(kWarpSize, 0);
  run_warp([&](const HostBlock& blk) {
    const int lane = blk.thread(), part = lane % parts;
    float v[N];
    for (int i = 0; i < N; ++i) v[i] = lane_value(lane, i);
    for (int i = 0; i < N; ++i) alone[lane * N + i] = dcmha::cuda::sum_over_parts(blk, v[i], parts);
    dcmha::cuda::scatter_sums_over_parts(blk, v, parts, [&](int k, float sum) {
      const int i = k * parts + part;
      if (i >= N) {
        bad_padding[lane] += sum != 0.0f;
        return;
      }
      ++taken[lane * N + i];
      got[lane * N + i] = sum;
    });
  });
  for (int lane = 0; lane < kWarpSize; ++lane) {
    EXPECT_EQ(bad_padding[lane], 0) << "N " << N << " parts " << parts << " lane " << lane;
    for (int i = 0; i < N; ++i) {
      const bool owner = i % parts == lane % parts;
      ASSERT_EQ(taken[lane * N + i], owner ? 1 : 0)
          << "N " << N << " parts " << parts << " lane " << lane << " element " << i;
      if (owner) {
        EXPECT_EQ(bits(got[lane * N + i]), bits(alone[lane * N + i]))
            << "N " << N << " parts " << parts << " element " << i;
      }
    }
  }
}

TEST(CudaWarpSums, EachSumIsLeftWithOneLaneInTheBitsOfSummingAlone) {
  for (int parts : kPartCounts) {
    expect_each_sum_left_with_one_lane<1>(parts);
    expect_each_sum_left_with_one_lane<3>(parts);
    expect_each_sum_left_with_one_lane<6>(parts);   // rank 1, two heads (the weight gradients)
    expect_each_sum_left_with_one_lane<10>(parts);  // rank 2
    expect_each_sum_left_with_one_lane<18>(parts);  // rank 4
    expect_each_sum_left_with_one_lane<32>(parts);
    expect_each_sum_left_with_one_lane<33>(parts);
  }
}

TEST(CudaWarpSums, ScatteringTakesFewerShufflesThanSummingAlone) {
  // The reason for both: at 4 lanes a group, 10 values take 8 shuffles where 20 summed alone.
  auto shuffles = [](auto sums) {
    em::LaunchShape shape;
    shape.threads = kWarpSize;
    return em::launch("test", shape, sums).shuffles;
  };
  const auto alone = shuffles([](const HostBlock& blk) {
    for (int i = 0; i < 10; ++i) (void)dcmha::cuda::sum_over_parts(blk, 1.0f, 4);
  });
  const auto scattered = shuffles([](const HostBlock& blk) {
    float v[10] = {};
    dcmha::cuda::scatter_sums_over_parts(blk, v, 4, [](int, float) {});
  });
  const auto halved = shuffles([](const HostBlock& blk) {
    float v[8] = {};
    dcmha::cuda::sum_values_over_parts(blk, v, 4);
  });
  EXPECT_EQ(alone, 20u);
  EXPECT_EQ(scattered, 8u);
  EXPECT_EQ(halved, 12u);  // 8 values summed alone: 16
}

}  // namespace
