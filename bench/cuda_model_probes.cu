// The cost model's assumptions about an sm_90 GPU, measured: what tools/cost_model charges a
// warp's shared-memory loads (a 16-byte load 4 cycles of the shared-memory unit however many
// lanes share an address, as the compose weights' loads do), the DSMEM bandwidth it assumes
// (3.3 TB/s) and the barriers' latency it leaves out (docs/performance.md: "the barriers'
// exposure"). scripts/gpu_check.sh runs it; its table goes beside the model's.
//
// Every probe runs one block of 8 warps (32 for the loads) on each multiprocessor, as DCMHA's
// kernels do (their shared memory keeps a second block off), through the kernels' own
// primitives (DeviceBlock: sync, sync_cluster, peer_shared):
//   shared loads    cycles of a multiprocessor per warp instruction (clock64 around a loop of
//                   independent loads from 32 warps, which keeps the shared-memory unit busy)
//   barriers        nanoseconds per barrier of a loop of nothing else (CUDA events)
//   DSMEM           bytes a second of 16-byte loads from the next block of the cluster,
//                   scaled from the multiprocessors running to the chip's
//
//   dcmha_model_probes [--smoke] [--table FILE]   (--smoke: a few rounds, proves it runs;
//                                                  exit status 77 without a device)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <dcmha/cuda/simt.hpp>

namespace {

using dcmha::cuda::DeviceBlock;

constexpr int kBlockThreads = 256;  // DCMHA's blocks: 8 warps
constexpr int kLoadThreads = 1024;  // 32 warps keep the shared-memory unit busy
constexpr int kCluster = 8;         // the official plan's cluster
// Over half a multiprocessor's shared memory: one block on each, as DCMHA's 176-224 KB.
constexpr int kOneBlockShared = 160 * 1024;
constexpr int kLoadChunks = 1024;  // 16 KB of 16-byte chunks the loads walk
constexpr int kUnroll = 8;         // independent loads in flight per thread
constexpr int kPeerChunks = 8192;  // 128 KB a block reads from its peer

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct Launch {
  int blocks = 1, threads = kBlockThreads, cluster = 1;
  int shared = kOneBlockShared;
};

cudaLaunchConfig_t config_of(const Launch& l, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(l.blocks));
  config.blockDim = dim3(static_cast<unsigned>(l.threads));
  config.dynamicSmemBytes = static_cast<std::size_t>(l.shared);
  if (l.cluster > 1) {
    attribute->id = cudaLaunchAttributeClusterDimension;
    attribute->val.clusterDim.x = static_cast<unsigned>(l.cluster);
    attribute->val.clusterDim.y = attribute->val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return config;
}

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), const Launch& l, Args... args) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.shared),
        "cudaFuncSetAttribute");
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = config_of(l, &attribute);
  check(cudaLaunchKernelEx(&config, kernel, args...), "cudaLaunchKernelEx");
  check(cudaGetLastError(), "kernel launch");
}

/// Clusters of `l` that run at once (the launch then is one wave).
template <class... Params>
int active_clusters(void (*kernel)(Params...), Launch l) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.shared),
        "cudaFuncSetAttribute");
  cudaLaunchAttribute attribute;
  l.blocks = l.cluster;
  const cudaLaunchConfig_t config = config_of(l, &attribute);
  int clusters = 0;
  check(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config),
        "cudaOccupancyMaxActiveClusters");
  return std::max(clusters, 1);
}

/// Seconds of one call of f, after a warm-up call, by CUDA events.
template <class F>
double seconds(F&& f) {
  f();
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start), "cudaEventRecord");
  f();
  check(cudaEventRecord(stop), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start), cudaEventDestroy(stop);
  return ms * 1e-3;
}

// --- kernels ------------------------------------------------------------------------------------

__global__ void block_barriers(int rounds) {
  const DeviceBlock blk;
  for (int i = 0; i < rounds; ++i) blk.sync();
}

__global__ void cluster_barriers(int rounds) {
  const DeviceBlock blk;
  for (int i = 0; i < rounds; ++i) blk.sync_cluster();
}

/// Each block reads the next cluster block's kPeerChunks chunks `rounds` times, 16 bytes a lane.
__global__ void peer_reads(int rounds, float* sink) {
  const DeviceBlock blk;
  float4* own = static_cast<float4*>(blk.shared());
  for (int i = blk.thread(); i < kPeerChunks; i += blk.threads())
    own[i] = make_float4(float(i), 1.0f, 2.0f, 3.0f);
  blk.sync_cluster();
  const float4* peer = blk.peer_shared(own, (blk.cluster_rank() + 1) % blk.cluster_size());
  float sum[4] = {0, 0, 0, 0};
  for (int r = 0; r < rounds; ++r) {
    // A round's own offset, so that no load is the same as the last round's.
    const int offset = (r * kBlockThreads + blk.thread()) % kPeerChunks;
    for (int i = 0; i < kPeerChunks; i += kBlockThreads * kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float4 v = peer[(offset + i + u * kBlockThreads) % kPeerChunks];
        sum[u % 4] += v.x + v.y + v.z + v.w;
      }
    }
  }
  blk.sync_cluster();  // no block leaves while a peer reads its shared memory
  if (sum[0] + sum[1] + sum[2] + sum[3] == -1.0f) sink[0] = 1.0f;  // keeps the loads
}

/// One shared-memory load of kBytes (4 or 16) at p, kept whole (volatile: the compiler may
/// neither drop it nor narrow it to the component used), and its first float.
template <int kBytes>
__device__ float first_of_load(const float* p) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  float v[4];
  if constexpr (kBytes == 16)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                 : "r"(address));
  else
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v[0]) : "r"(address));
  return v[0];
}

/// Shared-memory loads of kBytes (4 or 16) a lane, `lanes_per_address` adjacent lanes reading
/// the same address (the addresses consecutive: no bank conflict); each block's clock cycles
/// over the loop into cycles[block]. A load and an add each: few enough instructions that 32
/// warps issue them faster than the shared-memory unit takes one load a cycle.
template <int kBytes>
__global__ void shared_loads(int rounds, int lanes_per_address, long long* cycles, float* sink) {
  const DeviceBlock blk;
  float* words = static_cast<float*>(blk.shared());
  for (int i = blk.thread(); i < kLoadChunks * 4; i += blk.threads()) words[i] = float(i);
  const int lane_address = (blk.thread() % dcmha::cuda::kWarpSize) / lanes_per_address;
  const float* first = words + lane_address * kBytes / 4;
  float sum[4] = {0, 0, 0, 0};
  blk.sync();
  const long long start = clock64();
  for (int r = 0; r < rounds; ++r) {
    // Each load 32 chunks (512 B) past the last: the pattern's banks stay, the address changes.
    const int round = (r * kUnroll * 32 % kLoadChunks) * 4;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      sum[u % 4] += first_of_load<kBytes>(first + (round + u * 32 * 4) % (kLoadChunks * 4));
  }
  blk.sync();  // thread 0's clock then spans every warp's loop
  if (blk.thread() == 0) cycles[blockIdx.x] = clock64() - start;
  if (sum[0] + sum[1] + sum[2] + sum[3] == -1.0f) sink[0] = 1.0f;
}

// --- probes -------------------------------------------------------------------------------------

struct Device {
  cudaDeviceProp properties{};
  float* sink = nullptr;
  long long* cycles = nullptr;
};

/// Cycles of a multiprocessor per warp instruction: the median block's loop over its loads.
template <int kBytes>
double load_cycles(const Device& d, int rounds, int lanes_per_address) {
  const int blocks = d.properties.multiProcessorCount;
  launch(shared_loads<kBytes>, {blocks, kLoadThreads, 1, kOneBlockShared}, rounds,
         lanes_per_address, d.cycles, d.sink);
  check(cudaDeviceSynchronize(), "shared_loads");
  std::vector<long long> cycles(static_cast<std::size_t>(blocks));
  check(cudaMemcpy(cycles.data(), d.cycles, cycles.size() * sizeof(long long),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  std::nth_element(cycles.begin(), cycles.begin() + blocks / 2, cycles.end());
  const double instructions = double(rounds) * kUnroll * (kLoadThreads / dcmha::cuda::kWarpSize);
  return double(cycles[std::size_t(blocks / 2)]) / instructions;
}

double barrier_ns(const Device& d, int rounds, bool cluster) {
  Launch l{d.properties.multiProcessorCount, kBlockThreads, 1, kOneBlockShared};
  if (cluster) l.cluster = kCluster, l.blocks = active_clusters(cluster_barriers, l) * kCluster;
  return seconds([&] { launch(cluster ? cluster_barriers : block_barriers, l, rounds); }) / rounds *
         1e9;
}

/// DSMEM bytes a second of the chip: those of the multiprocessors that ran, scaled to all.
double peer_bandwidth(const Device& d, int rounds) {
  Launch l{kCluster, kBlockThreads, kCluster, kOneBlockShared};
  l.blocks = active_clusters(peer_reads, l) * kCluster;
  const double s = seconds([&] { launch(peer_reads, l, rounds, d.sink); });
  const double bytes = double(l.blocks) * rounds * kPeerChunks * 16;
  return bytes / s * d.properties.multiProcessorCount / l.blocks;
}

std::string table(const Device& d, bool smoke) {
  const int load_rounds = smoke ? 2 : 4096, barrier_rounds = smoke ? 4 : 20000;
  const int peer_rounds = smoke ? 1 : 1024;
  char line[512];
  std::string t;
  auto row = [&](const char* probe, double value, const char* unit, const char* model) {
    std::snprintf(line, sizeof(line), "| %s | %.3g %s | %s |\n", probe, value, unit, model);
    t += line;
  };
  std::snprintf(line, sizeof(line),
                "%s, sm_%d%d, %d multiprocessors%s\n\n| probe | measured | the cost model |\n"
                "|---|---|---|\n",
                d.properties.name, d.properties.major, d.properties.minor,
                d.properties.multiProcessorCount, smoke ? " (smoke: not a measurement)" : "");
  t += line;
  const char* cycles = "cycles a warp instruction";
  row("shared load, 4 B a lane, 32 addresses (the method's check)",
      load_cycles<4>(d, load_rounds, 1), cycles, "1");
  row("shared load, 16 B a lane, 32 addresses", load_cycles<16>(d, load_rounds, 1), cycles, "4");
  row("shared load, 16 B a lane, 8 addresses of 4 lanes", load_cycles<16>(d, load_rounds, 4),
      cycles, "4");
  row("shared load, 16 B a lane, 4 addresses of 8 lanes (compose weights)",
      load_cycles<16>(d, load_rounds, 8), cycles, "4");
  row("shared load, 16 B a lane, 1 address", load_cycles<16>(d, load_rounds, 32), cycles, "4");
  row("block barrier, 8 warps, nothing else", barrier_ns(d, barrier_rounds, false), "ns",
      "not modeled");
  if (d.properties.major >= 9) {
    row("cluster barrier, 8 blocks of 8 warps, nothing else", barrier_ns(d, barrier_rounds, true),
        "ns", "not modeled");
    row("DSMEM, 16 B loads from the next of 8 blocks", peer_bandwidth(d, peer_rounds) * 1e-12,
        "TB/s (the chip)", "3.3 TB/s");
  } else {
    t += "| cluster barrier, DSMEM | no clusters before sm_90 | |\n";
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  const char* table_file = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else if (std::strcmp(argv[i], "--table") == 0 && i + 1 < argc) {
      table_file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--smoke] [--table FILE]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  try {
    Device d;
    check(cudaGetDeviceProperties(&d.properties, 0), "cudaGetDeviceProperties");
    check(cudaMalloc(&d.sink, sizeof(float)), "cudaMalloc");
    check(cudaMalloc(&d.cycles, sizeof(long long) * std::size_t(d.properties.multiProcessorCount)),
          "cudaMalloc");
    const std::string t = table(d, smoke);
    std::fputs(t.c_str(), stdout);
    if (table_file) {
      FILE* f = std::fopen(table_file, "w");
      if (!f) throw std::runtime_error(std::string("cannot write ") + table_file);
      std::fputs(t.c_str(), f);
      std::fclose(f);
    }
    cudaFree(d.sink), cudaFree(d.cycles);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcmha_model_probes: %s\n", e.what());
    return 1;
  }
  return 0;
}
