// GPU benchmarks of the CUDA backend: MHA against DCMHA in bf16 and fp16 storage, on device
// memory.
//
// Names: <dir>/<op>/<storage>/B<b>/H<h>/T<t>/D<d>/causal with dir in {fwd, fwdbwd}, op in
// {mha, dcmha}, storage in {bf16, fp16}; decode/<op>/<storage>/B<b>/H<h>/S<s>/D<d>: one new
// token per sequence against a device DecodeCache holding s tokens. DCMHA is the official DCFormer
// default (G = 1, pre and post compose, query-wise and key-wise rank-2 terms and gates, no static
// W), as in bench/dcmha_bench.cpp. T is 2048 and 4096; DCMHA_BENCH_LONG=1 in the environment adds
// 8192.
//
// Timing: one warm-up call (the workspace grows, the kernels load), then one timed call per
// case (decode: ten, a step is microseconds), CUDA events around the calls (manual time), so
// the host's launch overhead counts. One call, not a median of many, because
// scripts/gpu_check.sh runs on a leased machine under a hard time limit: a single call is a
// little noisier, and far above the events' resolution at these shapes. Inputs are drawn on
// the device (a counter-based hash, Box-Muller): drawing them on the host took 10-18 s for a
// T8192 case (about 1e9 values).
// Counters: peak_MiB, the device memory the case added (inputs, outputs, gradients, the cache
// and the workspace: in use at the end of the timed call less in use before the case, so the
// CUDA context is not counted), and workspace_MiB.
//
//   --dcmha_smoke   tiny shapes only: proves every body runs (exit status 1 if one failed)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <dcmha/cuda/decode.hpp>

#include "cuda/kernel_instances.hpp"

namespace {

using dcmha::bf16;
using dcmha::index_t;
using dcmha::TensorView;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

/// SplitMix64's finalizer: a counter-based hash, so element i of tensor `seed` gets the same
/// value on every run and every launch shape.
__device__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// data[i] = scale * N(0, 1), Box-Muller on the hash's two 32-bit halves.
template <class T>
__global__ void fill_normal(T* data, index_t n, float scale, std::uint64_t seed) {
  const float two_to_minus_24 = 1.0f / 16777216.0f;  // 24-bit integers to [0, 1)
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const std::uint64_t bits = mix(seed * 0xd1b54a32d192ed03ull + std::uint64_t(i));
    const float u1 = (float(bits >> 40) + 1.0f) * two_to_minus_24;  // (0, 1]: log(u1) finite
    const float u2 = float((bits >> 8) & 0xffffffu) * two_to_minus_24;
    const float normal = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    data[i] = static_cast<T>(scale * normal);
  }
}

/// Device arrays of random values (normal, scaled; never zeros, so no path is trivially cheap),
/// freed at the end of their scope.
class DeviceTensors {
 public:
  DeviceTensors() = default;
  DeviceTensors(const DeviceTensors&) = delete;
  DeviceTensors& operator=(const DeviceTensors&) = delete;
  ~DeviceTensors() {
    cudaDeviceSynchronize();  // kernels still reading these arrays finish first
    for (void* p : owned_) cudaFree(p);
  }
  template <class T, int N>
  TensorView<T, N> random(const dcmha::Shape<N>& shape, float scale) {
    index_t n = 1;
    for (index_t s : shape) n *= s;
    T* device = static_cast<T*>(allocate(n * sizeof(T)));
    const int threads = 256;
    const index_t blocks = std::min<index_t>((n + threads - 1) / threads, 8192);
    fill_normal<T><<<static_cast<unsigned>(blocks), threads>>>(device, n, scale, next_seed_++);
    check_cuda(cudaGetLastError(), "fill_normal");
    return dcmha::view<N>(device, shape);
  }
  /// Softmax statistics: written by the forward before anything reads them.
  TensorView<float, 3> lse(index_t B, index_t H, index_t T) {
    return dcmha::view<3>(static_cast<float*>(allocate(B * H * T * sizeof(float))), {B, H, T});
  }

 private:
  void* allocate(index_t bytes) {
    void* device = nullptr;
    check_cuda(cudaMalloc(&device, static_cast<std::size_t>(bytes)), "cudaMalloc");
    owned_.push_back(device);
    return device;
  }

  std::uint64_t next_seed_ = 42;
  std::vector<void*> owned_;
};

/// The official default's compose weights (and gradients) for a (B, L, H) problem.
template <class T>
struct Compose {
  dcmha::ComposeWeights<T> weights;
  dcmha::ComposeGrads<T> grads;
};

template <class T>
Compose<T> official_compose(DeviceTensors& t, index_t B, index_t L, index_t S, index_t H) {
  const index_t R = 2;
  Compose<T> c;
  for (int side = 0; side < 2; ++side) {
    dcmha::ComposeTerms<T>& w = side == 0 ? c.weights.pre : c.weights.post;
    dcmha::ComposeTermGrads<T>& g = side == 0 ? c.grads.pre : c.grads.post;
    w.query_wise = w.key_wise = true;
    w.qw1 = t.random<T, 5>({B, L, 1, R, H}, 0.1f), w.qw2 = t.random<T, 5>({B, L, 1, R, H}, 0.1f);
    w.kw1 = t.random<T, 5>({B, S, 1, R, H}, 0.1f), w.kw2 = t.random<T, 5>({B, S, 1, R, H}, 0.1f);
    w.qdd = t.random<T, 4>({B, L, 1, H}, 0.3f), w.kdd = t.random<T, 4>({B, S, 1, H}, 0.3f);
    g.qw1 = t.random<T, 5>({B, L, 1, R, H}, 1), g.qw2 = t.random<T, 5>({B, L, 1, R, H}, 1);
    g.kw1 = t.random<T, 5>({B, S, 1, R, H}, 1), g.kw2 = t.random<T, 5>({B, S, 1, R, H}, 1);
    g.qdd = t.random<T, 4>({B, L, 1, H}, 1), g.kdd = t.random<T, 4>({B, S, 1, H}, 1);
  }
  return c;
}

/// The key-side terms of `w` (what DecodeCache::append stores with each token).
template <class T>
dcmha::ComposeWeights<T> key_side_of(const dcmha::ComposeWeights<T>& w) {
  dcmha::ComposeWeights<T> k;
  for (int s = 0; s < 2; ++s) {
    const dcmha::ComposeTerms<T>& from = s == 0 ? w.pre : w.post;
    dcmha::ComposeTerms<T>& to = s == 0 ? k.pre : k.post;
    to.key_wise = true, to.kw1 = from.kw1, to.kw2 = from.kw2, to.kdd = from.kdd;
  }
  return k;
}

/// The query-side terms of `w` (what decode takes with the new token's query).
template <class T>
dcmha::ComposeWeights<T> query_side_of(const dcmha::ComposeWeights<T>& w) {
  dcmha::ComposeWeights<T> q;
  for (int s = 0; s < 2; ++s) {
    const dcmha::ComposeTerms<T>& from = s == 0 ? w.pre : w.post;
    dcmha::ComposeTerms<T>& to = s == 0 ? q.pre : q.post;
    to.query_wise = true, to.qw1 = from.qw1, to.qw2 = from.qw2, to.qdd = from.qdd;
  }
  return q;
}

double mib(std::size_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

double used_mib() {
  std::size_t free = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return mib(total - free);
}

/// Benchmarks that reported an error (Google Benchmark's exit status ignores them).
int failed_cases = 0;

void fail_case(benchmark::State& state, const std::exception& e) {
  ++failed_cases;
  state.SkipWithError(e.what());
}

/// One warm-up call, then `call` timed with CUDA events once per Google Benchmark iteration.
template <class F>
void time_iterations(benchmark::State& state, F&& call) {
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  call();  // warm-up: the workspace grows, kernels load
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (auto _ : state) {
    cudaEventRecord(start);
    call();
    cudaEventRecord(stop);
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1000.0);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

/// A timed case: a forward (and backward) of MHA or DCMHA at B, H, L = T = S, D, with `launch`
/// choosing among MHA's backwards (one pass in rounds, one pass unordered, two-sided).
struct AttentionCase {
  bool dcmha_on = false, backward = false;
  index_t B = 1, H = 1, L = 1, D = 1;
  dcmha::cuda::LaunchOptions launch;
};

template <class T>
void attention(benchmark::State& state, const AttentionCase& a) {
  const double baseline = used_mib();
  const index_t B = a.B, H = a.H, L = a.L, D = a.D;
  try {
    DeviceTensors t;
    const auto q = t.random<T, 4>({B, H, L, D}, 1), k = t.random<T, 4>({B, H, L, D}, 1);
    const auto v = t.random<T, 4>({B, H, L, D}, 1), dout = t.random<T, 4>({B, H, L, D}, 1);
    const auto out = t.random<T, 4>({B, H, L, D}, 1), dq = t.random<T, 4>({B, H, L, D}, 1);
    const auto dk = t.random<T, 4>({B, H, L, D}, 1), dv = t.random<T, 4>({B, H, L, D}, 1);
    const auto lse = t.lse(B, H, L);
    const Compose<T> c = a.dcmha_on ? official_compose<T>(t, B, L, L, H) : Compose<T>{};
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    dcmha::cuda::DeviceWorkspace ws;
    time_iterations(state, [&] {
      dcmha::cuda::forward(cfg, q, k, v, out, lse, c.weights, ws);
      if (a.backward)
        dcmha::cuda::backward(cfg, q, k, v, out, lse, dout, dq, dk, dv, c.weights, c.grads, ws, 0,
                              a.launch);
    });
    state.counters["peak_MiB"] = used_mib() - baseline;
    state.counters["workspace_MiB"] = mib(ws.bytes());
  } catch (const std::exception& e) {
    fail_case(state, e);
  }
}

/// Appends S tokens to `cache` in chunks of at most 512; each chunk's inputs are freed after it,
/// so peak_MiB counts the cache, not the prefill's temporaries.
template <class T>
void fill_cache(dcmha::cuda::DecodeCache<T>& cache, bool dcmha_on, index_t B, index_t H, index_t S,
                index_t D) {
  for (index_t done = 0; done < S;) {
    const index_t n = std::min<index_t>(512, S - done);
    DeviceTensors chunk;
    const Compose<T> kc = dcmha_on ? official_compose<T>(chunk, B, n, n, H) : Compose<T>{};
    cache.append(chunk.random<T, 4>({B, H, n, D}, 1), chunk.random<T, 4>({B, H, n, D}, 1),
                 dcmha_on ? key_side_of(kc.weights) : dcmha::ComposeWeights<T>{});
    done += n;
  }
}

template <class T>
void decode(benchmark::State& state, bool dcmha_on, index_t B, index_t H, index_t S, index_t D) {
  const double baseline = used_mib();
  try {
    dcmha::DecodeCacheConfig cc;
    cc.B = B, cc.H = H, cc.Hk = H, cc.D = D, cc.Dv = D, cc.G = 1;
    cc.capacity = S, cc.max_step = 512;
    cc.pre_key_wise = cc.post_key_wise = dcmha_on;
    cc.Rk = dcmha_on ? 2 : 0;
    dcmha::cuda::DecodeCache<T> cache(cc);
    // S - 1 tokens of prefill, then token S's key side; the timed step is its query against all.
    fill_cache(cache, dcmha_on, B, H, S - 1, D);
    DeviceTensors t;
    const Compose<T> c = dcmha_on ? official_compose<T>(t, B, 1, 1, H) : Compose<T>{};
    const auto k_new = t.random<T, 4>({B, H, 1, D}, 1), v_new = t.random<T, 4>({B, H, 1, D}, 1);
    const auto q_new = t.random<T, 4>({B, H, 1, D}, 1), out = t.random<T, 4>({B, H, 1, D}, 1);
    cache.append(k_new, v_new, dcmha_on ? key_side_of(c.weights) : dcmha::ComposeWeights<T>{});
    const dcmha::ComposeWeights<T> query_side =
        dcmha_on ? query_side_of(c.weights) : dcmha::ComposeWeights<T>{};
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    dcmha::cuda::DeviceWorkspace ws;
    time_iterations(state, [&] { dcmha::cuda::decode(cfg, q_new, cache, query_side, out, ws); });
    state.counters["peak_MiB"] = used_mib() - baseline;
  } catch (const std::exception& e) {
    fail_case(state, e);
  }
}

struct Sizes {
  index_t B, H, D;
  std::vector<index_t> lengths;
  index_t decode_B, decode_S;
};

Sizes sizes(bool smoke) {
  if (smoke) return {1, 4, 16, {64}, 2, 64};
  Sizes s{4, 32, 128, {2048, 4096}, 8, 4096};
  const char* long_run = std::getenv("DCMHA_BENCH_LONG");
  if (long_run && std::strcmp(long_run, "1") == 0) s.lengths.push_back(8192);
  return s;
}

std::string shape_name(const char* letter, index_t B, index_t H, index_t L, index_t D) {
  return "/B" + std::to_string(B) + "/H" + std::to_string(H) + "/" + letter + std::to_string(L) +
         "/D" + std::to_string(D);
}

/// Every case of one storage type T, named with `storage` ("bf16", "fp16").
/// MHA's forward+backward also with its other backwards: "mha_unordered" (deterministic off: the
/// one pass in one launch) and "mha_two_sided" (one_pass off).
template <class T>
void register_storage(const char* storage, const Sizes& s) {
  auto attention_case = [&](const char* direction, const char* op, bool dcmha_on, bool backward,
                            index_t L, const dcmha::cuda::LaunchOptions& launch) {
    const AttentionCase a{dcmha_on, backward, s.B, s.H, L, s.D, launch};
    const std::string name = std::string(direction) + "/" + op + "/" + storage +
                             shape_name("T", s.B, s.H, L, s.D) + "/causal";
    benchmark::RegisterBenchmark(name.c_str(), attention<T>, a)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  };
  for (index_t L : s.lengths) {
    for (bool backward : {false, true})
      for (bool dcmha_on : {false, true})
        attention_case(backward ? "fwdbwd" : "fwd", dcmha_on ? "dcmha" : "mha", dcmha_on, backward,
                       L, {});
    dcmha::cuda::LaunchOptions unordered, two_sided;
    unordered.deterministic = false;
    two_sided.one_pass = false;
    attention_case("fwdbwd", "mha_unordered", false, true, L, unordered);
    attention_case("fwdbwd", "mha_two_sided", false, true, L, two_sided);
  }
  for (bool dcmha_on : {false, true}) {
    const std::string name = std::string("decode/") + (dcmha_on ? "dcmha/" : "mha/") + storage +
                             shape_name("S", s.decode_B, s.H, s.decode_S, s.D);
    // A step is microseconds: ten calls average out the launch jitter one call would show.
    benchmark::RegisterBenchmark(name.c_str(), decode<T>, dcmha_on, s.decode_B, s.H, s.decode_S,
                                 s.D)
        ->UseManualTime()
        ->Iterations(10)
        ->Unit(benchmark::kMicrosecond);
  }
}

void register_all(bool smoke) {
  const Sizes s = sizes(smoke);
  register_storage<bf16>("bf16", s);
  register_storage<dcmha::half>("fp16", s);
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (std::strcmp(argv[i], "--dcmha_smoke") == 0)
      smoke = true;
    else
      args.push_back(argv[i]);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("dcmha_cuda_bench: no CUDA device, skipped\n");
    return 77;
  }
#ifdef DCMHA_CUDA_COMPILE_CHECK
  // Its kernel units' device code is unoptimized (tests/cuda/CMakeLists.txt): no time to report.
  if (!smoke) {
    std::fprintf(stderr,
                 "dcmha_cuda_bench: built with DCMHA_CUDA_COMPILE_CHECK=ON, whose kernels are not "
                 "optimized; configure with DCMHA_CUDA_COMPILE_CHECK=OFF to time them\n");
    return 1;
  }
#endif
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  register_all(smoke);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return failed_cases ? 1 : 0;
}
