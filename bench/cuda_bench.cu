// GPU benchmarks of the CUDA backend: MHA against DCMHA, bf16 storage, on device memory.
//
// Names: <dir>/<op>/B<b>/H<h>/T<t>/D<d>/causal with dir in {fwd, fwdbwd}, op in {mha, dcmha};
// decode/<op>/B<b>/H<h>/S<s>/D<d>: one new token per sequence against a device DecodeCache
// holding s tokens. DCMHA is the official DCFormer default (G = 1, pre and post compose,
// query-wise and key-wise rank-2 terms and gates, no static W), as in bench/dcmha_bench.cpp.
// Times are CUDA events around the calls (manual time), so the host's launch overhead counts.
// Counters: peak_MiB, the device memory the case added (inputs, outputs, gradients, the cache
// and the workspace: in use at the end of the timed loop less in use before the case, so the
// CUDA context is not counted), and workspace_MiB.
//
//   --dcmha_smoke   tiny shapes only: proves every body runs (exit status 1 if one failed)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>
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

/// Device arrays of random bf16 values (normal, scaled), freed at the end of a benchmark.
class DeviceTensors {
 public:
  ~DeviceTensors() {
    for (void* p : owned_) cudaFree(p);
  }
  template <int N>
  TensorView<bf16, N> random(const dcmha::Shape<N>& shape, float scale) {
    index_t n = 1;
    for (index_t s : shape) n *= s;
    std::vector<bf16> host(static_cast<std::size_t>(n));
    std::normal_distribution<float> normal(0.0f, scale);
    for (bf16& x : host) x = bf16(normal(rng_));
    void* device = nullptr;
    check_cuda(cudaMalloc(&device, n * sizeof(bf16)), "cudaMalloc");
    owned_.push_back(device);
    check_cuda(cudaMemcpy(device, host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice),
               "cudaMemcpy");
    return dcmha::view<N>(static_cast<bf16*>(device), shape);
  }
  TensorView<float, 3> lse(index_t B, index_t H, index_t T) {
    void* device = nullptr;
    check_cuda(cudaMalloc(&device, B * H * T * sizeof(float)), "cudaMalloc");
    owned_.push_back(device);
    return dcmha::view<3>(static_cast<float*>(device), {B, H, T});
  }

 private:
  std::mt19937 rng_{42};
  std::vector<void*> owned_;
};

/// The official default's compose weights (and gradients) for a (B, L, H) problem.
struct Compose {
  dcmha::ComposeWeights<bf16> weights;
  dcmha::ComposeGrads<bf16> grads;
};

Compose official_compose(DeviceTensors& t, index_t B, index_t T, index_t S, index_t H) {
  const index_t R = 2;
  Compose c;
  for (int side = 0; side < 2; ++side) {
    dcmha::ComposeTerms<bf16>& w = side == 0 ? c.weights.pre : c.weights.post;
    dcmha::ComposeTermGrads<bf16>& g = side == 0 ? c.grads.pre : c.grads.post;
    w.query_wise = w.key_wise = true;
    w.qw1 = t.random<5>({B, T, 1, R, H}, 0.1f), w.qw2 = t.random<5>({B, T, 1, R, H}, 0.1f);
    w.kw1 = t.random<5>({B, S, 1, R, H}, 0.1f), w.kw2 = t.random<5>({B, S, 1, R, H}, 0.1f);
    w.qdd = t.random<4>({B, T, 1, H}, 0.3f), w.kdd = t.random<4>({B, S, 1, H}, 0.3f);
    g.qw1 = t.random<5>({B, T, 1, R, H}, 0), g.qw2 = t.random<5>({B, T, 1, R, H}, 0);
    g.kw1 = t.random<5>({B, S, 1, R, H}, 0), g.kw2 = t.random<5>({B, S, 1, R, H}, 0);
    g.qdd = t.random<4>({B, T, 1, H}, 0), g.kdd = t.random<4>({B, S, 1, H}, 0);
  }
  return c;
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

/// Times `call` with CUDA events, one iteration per Google Benchmark iteration.
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

void attention(benchmark::State& state, bool dcmha_on, bool backward, index_t B, index_t H,
               index_t T, index_t D) {
  const double baseline = used_mib();
  try {
    DeviceTensors t;
    const auto q = t.random<4>({B, H, T, D}, 1), k = t.random<4>({B, H, T, D}, 1);
    const auto v = t.random<4>({B, H, T, D}, 1), dout = t.random<4>({B, H, T, D}, 1);
    const auto out = t.random<4>({B, H, T, D}, 0), dq = t.random<4>({B, H, T, D}, 0);
    const auto dk = t.random<4>({B, H, T, D}, 0), dv = t.random<4>({B, H, T, D}, 0);
    const auto lse = t.lse(B, H, T);
    const Compose c = dcmha_on ? official_compose(t, B, T, T, H) : Compose{};
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    dcmha::cuda::DeviceWorkspace ws;
    time_iterations(state, [&] {
      dcmha::cuda::forward(cfg, q, k, v, out, lse, c.weights, ws);
      if (backward)
        dcmha::cuda::backward(cfg, q, k, v, lse, dout, dq, dk, dv, c.weights, c.grads, ws);
    });
    state.counters["peak_MiB"] = used_mib() - baseline;
    state.counters["workspace_MiB"] = mib(ws.bytes());
  } catch (const std::exception& e) {
    fail_case(state, e);
  }
}

void decode(benchmark::State& state, bool dcmha_on, index_t B, index_t H, index_t S, index_t D) {
  const double baseline = used_mib();
  try {
    DeviceTensors t;
    dcmha::DecodeCacheConfig cc;
    cc.B = B, cc.H = H, cc.Hk = H, cc.D = D, cc.Dv = D, cc.G = 1;
    cc.capacity = S, cc.max_step = 512;
    cc.pre_key_wise = cc.post_key_wise = dcmha_on;
    cc.Rk = dcmha_on ? 2 : 0;
    dcmha::cuda::DecodeCache<bf16> cache(cc);
    // Fill S - 1 tokens in chunks, then time the step of token S against all of them.
    for (index_t done = 0; done < S - 1;) {
      const index_t n = std::min<index_t>(512, S - 1 - done);
      const Compose kc = dcmha_on ? official_compose(t, B, n, n, H) : Compose{};
      dcmha::ComposeWeights<bf16> key_side;
      if (dcmha_on)
        for (int s = 0; s < 2; ++s) {
          auto& from = s == 0 ? kc.weights.pre : kc.weights.post;
          auto& to = s == 0 ? key_side.pre : key_side.post;
          to.key_wise = true, to.kw1 = from.kw1, to.kw2 = from.kw2, to.kdd = from.kdd;
        }
      cache.append(t.random<4>({B, H, n, D}, 1), t.random<4>({B, H, n, D}, 1), key_side);
      done += n;
    }
    const Compose c = dcmha_on ? official_compose(t, B, 1, 1, H) : Compose{};
    dcmha::ComposeWeights<bf16> key_side, query_side;
    if (dcmha_on)
      for (int s = 0; s < 2; ++s) {
        auto& from = s == 0 ? c.weights.pre : c.weights.post;
        auto& ks = s == 0 ? key_side.pre : key_side.post;
        auto& qs = s == 0 ? query_side.pre : query_side.post;
        ks.key_wise = true, ks.kw1 = from.kw1, ks.kw2 = from.kw2, ks.kdd = from.kdd;
        qs.query_wise = true, qs.qw1 = from.qw1, qs.qw2 = from.qw2, qs.qdd = from.qdd;
      }
    const auto k_new = t.random<4>({B, H, 1, D}, 1), v_new = t.random<4>({B, H, 1, D}, 1);
    const auto q_new = t.random<4>({B, H, 1, D}, 1), out = t.random<4>({B, H, 1, D}, 0);
    cache.append(k_new, v_new, key_side);
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    dcmha::cuda::DeviceWorkspace ws;
    time_iterations(state, [&] { dcmha::cuda::decode(cfg, q_new, cache, query_side, out, ws); });
    state.counters["peak_MiB"] = used_mib() - baseline;
  } catch (const std::exception& e) {
    fail_case(state, e);
  }
}

void register_all(bool smoke) {
  const index_t B = smoke ? 1 : 4, H = smoke ? 4 : 32, D = smoke ? 16 : 128;
  const std::vector<index_t> lengths =
      smoke ? std::vector<index_t>{64} : std::vector<index_t>{2048, 4096, 8192};
  for (index_t T : lengths)
    for (bool backward : {false, true})
      for (bool dcmha_on : {false, true}) {
        const std::string name = std::string(backward ? "fwdbwd/" : "fwd/") +
                                 (dcmha_on ? "dcmha" : "mha") + "/B" + std::to_string(B) + "/H" +
                                 std::to_string(H) + "/T" + std::to_string(T) + "/D" +
                                 std::to_string(D) + "/causal";
        benchmark::RegisterBenchmark(name.c_str(), attention, dcmha_on, backward, B, H, T, D)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  const index_t decode_B = smoke ? 2 : 8, S = smoke ? 64 : 4096;
  for (bool dcmha_on : {false, true}) {
    const std::string name = std::string("decode/") + (dcmha_on ? "dcmha" : "mha") + "/B" +
                             std::to_string(decode_B) + "/H" + std::to_string(H) + "/S" +
                             std::to_string(S) + "/D" + std::to_string(D);
    benchmark::RegisterBenchmark(name.c_str(), decode, dcmha_on, decode_B, H, S, D)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
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
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  register_all(smoke);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return failed_cases ? 1 : 0;
}
