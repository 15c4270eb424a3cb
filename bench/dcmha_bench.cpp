// Benchmarks of the attention core: MHA against DCMHA on the same inputs.
//
// Names: <dir>/<op>/B<b>/H<h>/T<t>/D<d>/<mask>, dir in {fwd, bwd, fwdbwd}, op in {mha, dcmha},
// mask in {causal, full, window<w>} (window<w>: causal with a sliding window of w keys, the local
// layers of DCFormer). Storage is float; <dir>/<op>/bf16/B<b>/... are the same cases with bf16
// tensors (float arithmetic), for a few shapes, and .../bf16/storage_type/... the same with
// Products::storage_type (bf16 dot products where the CPU has AVX512_BF16);
// <dir>/<op>/nested/B<b>/... make one call per sequence from each thread of an enclosing OpenMP
// team of b threads. Decoding: decode/<op>/B<b>/H<h>/S<s>/D<d>, one new token per sequence against
// a DecodeCache holding s tokens (the new one included). Google Benchmark appends
// "/real_time" (and "_median" etc. for aggregates) in its reports, so a --benchmark_filter should
// not anchor the mask with '$'.
//
// DCMHA runs the official DCFormer default: G = 1, pre and post compose, query-wise and key-wise
// rank-2 terms plus their gates, no static W. The dynamic weights are random and made once
// outside the timed loop: the dynamic weight projection is a separate, much cheaper GEMM and is
// deliberately not part of these numbers.
//
// The dynamic weight projection has benchmarks of its own, named like the attention core's shape
// they serve: {fwd,bwd}/dynw/B<b>/H<h>/T<t>/D<d> is dynamic_weights_forward / _backward for the
// input of a model of width E = H·D (DCFormer: G = 1, R = 2, hidden width K = 4M), so that its
// cost can be read next to the attention core's at the same shape. The forward keeps its
// activations (ProjectionActivations) and bwd times the backward from them, as training runs it.
//
// Extra flags (before the --benchmark_* ones are parsed):
//   --dcmha_smoke           tiny shapes only, for a quick CTest run; exit status 1 if any
//                           benchmark failed (Google Benchmark itself would still return 0)
//   --dcmha_report_memory   add peak_rss_MiB and io_MiB to every benchmark, not only T16384
//
// peak_rss_MiB is the process's high-water mark (getrusage), so it only describes one case when
// that case runs alone: scripts/bench.sh runs the T16384 case in a process of its own.
#include <benchmark/benchmark.h>
#include <dcmha/dcmha.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using dcmha::index_t;

enum class Dir { fwd, bwd, fwdbwd };
enum class Op { mha, dcmha };

struct Case {
  Dir dir;
  Op op;
  index_t B, H, T, D;
  dcmha::Mask mask;
  bool memory_counters;
  index_t window = 0;  // > 0: causal with a sliding window
  bool bf16 = false;   // bf16 storage instead of float
  // bf16 only: Products::storage_type (bf16 dot products where the CPU has them) instead of exact
  bool storage_products = false;
  // One call per sequence, each made by a thread of an enclosing OpenMP team of B threads (a
  // caller that is already parallel): what a nested call costs next to one call over the batch.
  bool nested = false;
};

const char* name_of(Dir d) { return d == Dir::fwd ? "fwd" : d == Dir::bwd ? "bwd" : "fwdbwd"; }
const char* name_of(Op o) { return o == Op::mha ? "mha" : "dcmha"; }
const char* name_of(dcmha::Mask m) { return m == dcmha::Mask::causal ? "causal" : "full"; }

std::string name_of(const Case& c) {
  return std::string(name_of(c.dir)) + "/" + name_of(c.op) + (c.bf16 ? "/bf16" : "") +
         (c.storage_products ? "/storage_type" : "") + (c.nested ? "/nested" : "") + "/B" +
         std::to_string(c.B) + "/H" + std::to_string(c.H) + "/T" + std::to_string(c.T) + "/D" +
         std::to_string(c.D) + "/" +
         (c.window > 0 ? "window" + std::to_string(c.window) : std::string(name_of(c.mask)));
}

constexpr index_t kGroups = 1;  // official DCFormer default
constexpr index_t kRank = 2;

std::atomic<bool> g_any_failed{false};

// splitmix64 + Box-Muller: std::normal_distribution over the T16384 buffers (~10^8 values)
// would take longer than the benchmark itself, and the values only need to look like activations.
void fill_normal(std::vector<float>& x, float stddev, std::uint64_t seed) {
  std::uint64_t s = seed;
  auto next = [&s] {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const double two_pi = 6.283185307179586;
  for (std::size_t i = 0; i < x.size(); i += 2) {
    const double u1 = (double(next() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: log() stays finite
    const double u2 = double(next() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)) * stddev;
    x[i] = float(r * std::cos(two_pi * u2));
    if (i + 1 < x.size()) x[i + 1] = float(r * std::sin(two_pi * u2));
  }
}
template <class T>
void fill_normal(std::vector<T>& x, float stddev, std::uint64_t seed) {
  std::vector<float> f(x.size());
  fill_normal(f, stddev, seed);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(f[i]);
}

// One for every case and call, as a training loop keeps one: the timings are of the steady state,
// not of allocating and faulting in the kernels' panels on every call. It holds about what the
// largest case so far needed (the T16384 memory case runs in a process of its own).
dcmha::Workspace workspace;

/// Sequence b of a batched view (batch dim first), as a batch of one.
template <class S, int N>
dcmha::TensorView<S, N> batch_item(dcmha::TensorView<S, N> x, index_t b) {
  if (x.empty()) return x;
  x.data += b * x.stride[0];
  x.shape[0] = 1;
  return x;
}
template <class Terms>
Terms batch_item_terms(Terms t, index_t b) {  // static W has no batch dim
  t.qw1 = batch_item(t.qw1, b);
  t.qw2 = batch_item(t.qw2, b);
  t.qdd = batch_item(t.qdd, b);
  t.kw1 = batch_item(t.kw1, b);
  t.kw2 = batch_item(t.kw2, b);
  t.kdd = batch_item(t.kdd, b);
  return t;
}
template <class S>
dcmha::ComposeWeights<S> batch_item(const dcmha::ComposeWeights<S>& c, index_t b) {
  return {batch_item_terms(c.pre, b), batch_item_terms(c.post, b)};
}
template <class S>
dcmha::ComposeGrads<S> batch_item(const dcmha::ComposeGrads<S>& c, index_t b) {
  return {batch_item_terms(c.pre, b), batch_item_terms(c.post, b)};
}

// Every buffer of one problem, in the (B, T, H, D) layout of a real model, in storage type T.
// Gradients are only allocated when a case needs them so that forward-only runs have the
// footprint of inference.
template <class Scalar>
struct Problem {
  index_t B, H, T, D;
  bool dcmha;
  std::vector<Scalar> q, k, v, o, dout, dq, dk, dv;
  std::vector<dcmha::acc_t<Scalar>> lse;
  dcmha::DynamicWeightsStorage<Scalar> dynw, dynw_grad;
  dcmha::ComposeWeights<Scalar> compose;
  dcmha::ComposeGrads<Scalar> dcompose;
  bool have_forward = false;
  dcmha::Mask forward_mask = dcmha::Mask::causal;
  index_t forward_window = 0;

  Problem(index_t B_, index_t H_, index_t T_, index_t D_, bool dc)
      : B(B_), H(H_), T(T_), D(D_), dcmha(dc) {
    const auto n = static_cast<std::size_t>(B * T * H * D);
    q.resize(n);
    k.resize(n);
    v.resize(n);
    o.resize(n);
    fill_normal(q, 1.0f, 1);
    fill_normal(k, 1.0f, 2);
    fill_normal(v, 1.0f, 3);
    lse.resize(static_cast<std::size_t>(B * H * T));
    if (dcmha) {
      dynw = dcmha::DynamicWeightsStorage<Scalar>(B, T, kGroups, kRank, H / kGroups);
      fill_normal(dynw.data, 0.1f, 4);
      compose = dcmha::compose_weights<Scalar>(dynw.views());
    }
  }

  void ensure_grads() {
    if (!dout.empty()) return;
    const auto n = q.size();
    dout.resize(n);
    dq.resize(n);
    dk.resize(n);
    dv.resize(n);
    fill_normal(dout, 1.0f, 5);
    if (dcmha) {
      dynw_grad = dcmha::DynamicWeightsStorage<Scalar>(B, T, kGroups, kRank, H / kGroups);
      dcompose = dcmha::compose_grads(dynw_grad.views());
    }
  }

  auto act(std::vector<Scalar>& x) { return dcmha::bthd(x.data(), B, T, H, D); }
  auto lse_view() { return dcmha::view<3>(lse.data(), {B, H, T}); }

  void forward(const dcmha::AttentionConfig& cfg) {
    dcmha::forward(cfg, act(q), act(k), act(v), act(o), lse_view(), compose, workspace);
    forward_mask = cfg.mask;
    forward_window = cfg.window;
    have_forward = true;
  }
  /// The problem is shared between cases, so the saved lse may come from another mask.
  void ensure_forward(const dcmha::AttentionConfig& cfg) {
    if (!have_forward || forward_mask != cfg.mask || forward_window != cfg.window) forward(cfg);
  }
  void backward(const dcmha::AttentionConfig& cfg) {
    dcmha::backward(cfg, act(q), act(k), act(v), lse_view(), act(dout), act(dq), act(dk), act(dv),
                    compose, dcompose, workspace);
  }

  /// forward, or backward, of each sequence on its own, from the threads of an OpenMP team of B
  /// threads, each with a Workspace of its own.
  void per_sequence(const dcmha::AttentionConfig& cfg, bool backward) {
    if (nested_workspaces.size() != std::size_t(B))
      nested_workspaces = std::vector<dcmha::Workspace>(std::size_t(B));
#pragma omp parallel for num_threads(int(B)) schedule(static, 1)
    for (index_t b = 0; b < B; ++b) {
      auto seq = [b](auto x) { return batch_item(x, b); };
      dcmha::Workspace& ws = nested_workspaces[std::size_t(b)];
      if (backward)
        dcmha::backward(cfg, seq(act(q)), seq(act(k)), seq(act(v)), seq(lse_view()), seq(act(dout)),
                        seq(act(dq)), seq(act(dk)), seq(act(dv)), batch_item(compose, b),
                        batch_item(dcompose, b), ws);
      else
        dcmha::forward(cfg, seq(act(q)), seq(act(k)), seq(act(v)), seq(act(o)), seq(lse_view()),
                       batch_item(compose, b), ws);
    }
  }
  std::vector<dcmha::Workspace> nested_workspaces;

  double io_bytes() const {
    const auto vecs = {&q, &k, &v, &o, &dout, &dq, &dk, &dv, &dynw.data, &dynw_grad.data};
    double bytes = double(lse.size()) * sizeof(lse[0]);
    for (const auto* x : vecs) bytes += double(x->size()) * sizeof(Scalar);
    return bytes;
  }
};

// Google Benchmark calls a benchmark function once per repetition and per iteration-count probe;
// rebuilding a T16384 problem each time would dominate the run, so the last one is kept. Only
// one lives at a time, which keeps peak memory at the largest single case.
std::unique_ptr<Problem<float>> cached;
std::unique_ptr<Problem<dcmha::bf16>> cached_bf16;
void release_decode_problem();

template <class T>
std::unique_ptr<Problem<T>>& cache_of() {
  if constexpr (std::is_same_v<T, float>)
    return cached;
  else
    return cached_bf16;
}

template <class T>
Problem<T>& problem_for(const Case& c) {
  release_decode_problem();
  if constexpr (std::is_same_v<T, float>)
    cached_bf16.reset();
  else
    cached.reset();
  std::unique_ptr<Problem<T>>& p = cache_of<T>();
  const bool dc = c.op == Op::dcmha;
  if (!p || p->B != c.B || p->H != c.H || p->T != c.T || p->D != c.D || p->dcmha != dc) {
    p.reset();
    p = std::make_unique<Problem<T>>(c.B, c.H, c.T, c.D, dc);
  }
  return *p;
}

double peak_rss_mib() {
  struct rusage ru;
  std::memset(&ru, 0, sizeof ru);
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // Linux reports KiB
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Useful FLOPs only: QK^T and PV, 2 flops per multiply-add, so 4·B·H·T·S·D for a forward;
// causal does half the (t, s) pairs. Compose work is not counted, so DCMHA's GFLOP/s being
// lower than MHA's is exactly its overhead.
double useful_flops(const Case& c) {
  double f = 4.0 * double(c.B) * double(c.H) * double(c.T) * double(c.T) * double(c.D);
  if (c.mask == dcmha::Mask::causal) f *= 0.5;
  if (c.window > 0 && c.window < c.T) {  // row t sees min(t + 1, W) keys
    const double T = double(c.T), W = double(c.window);
    f = 4.0 * double(c.B) * double(c.H) * (T * W - W * (W - 1) / 2) * double(c.D);
  }
  if (c.dir == Dir::bwd) f *= 2.5;
  if (c.dir == Dir::fwdbwd) f *= 3.5;
  return f;
}

template <class T>
void run_case_as(benchmark::State& state, const Case& c) {
  dcmha::AttentionConfig cfg;
  cfg.mask = c.mask;
  cfg.window = c.window;
  cfg.products = c.storage_products ? dcmha::Products::storage_type : dcmha::Products::exact;
  Problem<T>& p = problem_for<T>(c);
  if (c.dir != Dir::fwd) p.ensure_grads();

  // Google Benchmark calls this once per repetition; only the first call of a case warms up
  // (caches, page mapping, the OpenMP pool). Cases that take seconds per iteration skip it: one
  // iteration already dwarfs those effects, and a second one would double the run.
  static std::set<std::string> warmed;
  const bool warm_up = useful_flops(c) < 1e11 && warmed.insert(name_of(c)).second;

  // A kernel that throws becomes a reported error instead of std::terminate.
  try {
    if (c.dir == Dir::bwd) p.ensure_forward(cfg);  // backward reads this forward's lse
    if (warm_up) {
      if (c.dir != Dir::bwd) p.forward(cfg);
      if (c.dir != Dir::fwd) p.backward(cfg);
    }
    for (auto _ : state) {
      if (c.nested) {
        p.per_sequence(cfg, c.dir == Dir::bwd);
        benchmark::ClobberMemory();
        continue;
      }
      switch (c.dir) {
        case Dir::fwd:
          p.forward(cfg);
          break;
        case Dir::bwd:
          p.backward(cfg);
          break;
        case Dir::fwdbwd:
          p.forward(cfg);
          p.backward(cfg);
          break;
      }
      benchmark::ClobberMemory();
    }
  } catch (const std::exception& e) {
    g_any_failed = true;
    state.SkipWithError(e.what());
    return;
  }

  // Raw FLOPs as a rate: the console then prints e.g. "FLOPS=85.3G/s", i.e. GFLOP/s.
  state.counters["FLOPS"] =
      benchmark::Counter(useful_flops(c), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = max_threads();
  if (c.memory_counters) {
    state.counters["peak_rss_MiB"] = peak_rss_mib();
    state.counters["io_MiB"] = p.io_bytes() / (1024.0 * 1024.0);
  }
}

void run_case(benchmark::State& state, const Case& c) {
  if (c.bf16)
    run_case_as<dcmha::bf16>(state, c);
  else
    run_case_as<float>(state, c);
}

// ---------------------------------------------------------------------------------------------
// Decoding: one new token per sequence against a DecodeCache of S tokens

enum class Storage { f32, bf16, f16 };

struct DecodeCase {
  Op op;
  index_t B, H, S, D;
  Storage storage = Storage::f32;  // the cache's, the query's and the output's type
};

std::string name_of(const DecodeCase& c) {
  const char* type = c.storage == Storage::bf16  ? "/bf16"
                     : c.storage == Storage::f16 ? "/fp16"
                                                 : "";
  return std::string("decode/") + name_of(c.op) + type + "/B" + std::to_string(c.B) + "/H" +
         std::to_string(c.H) + "/S" + std::to_string(c.S) + "/D" + std::to_string(c.D);
}

/// A decode problem of any storage type, behind one interface for the benchmark's cache of one.
struct DecodeRunner {
  DecodeCase c;
  explicit DecodeRunner(const DecodeCase& c_) : c(c_) {}
  virtual ~DecodeRunner() = default;
  virtual void decode(const dcmha::AttentionConfig& cfg) = 0;
  /// K + V (+ key-wise compose state) of all B sequences, per cached token, in bytes.
  virtual double cache_bytes_per_token() const = 0;
};

// The cache is filled once, outside the timed loop, and then holds S tokens per sequence, the new
// one (appended last, alone) included. Every timed iteration decodes that same token again, so
// the cache neither grows nor changes between iterations.
template <class T>
struct DecodeProblem : DecodeRunner {
  static constexpr index_t kFillChunk = 512;
  dcmha::DecodeCacheConfig cc;
  dcmha::DecodeCache<T> cache;
  std::vector<T> q, out;
  dcmha::DynamicWeightsStorage<T> step_dynw;  // the new token's dynamic weights
  dcmha::ComposeWeights<T> query_side;

  static dcmha::DecodeCacheConfig config(const DecodeCase& c) {
    dcmha::DecodeCacheConfig cc;
    cc.B = c.B;
    cc.H = c.H;
    cc.Hk = c.H;
    cc.D = c.D;
    cc.Dv = c.D;
    cc.G = kGroups;
    const bool dc = c.op == Op::dcmha;
    cc.pre_key_wise = cc.post_key_wise = dc;
    cc.Rk = dc ? kRank : 0;
    cc.capacity = c.S;
    cc.max_step = std::min(c.S, kFillChunk);
    return cc;
  }

  explicit DecodeProblem(const DecodeCase& c_) : DecodeRunner(c_), cc(config(c_)), cache(cc) {
    const index_t B = c.B, H = c.H, D = c.D, M = H / kGroups, chunk = cc.max_step;
    const bool dc = c.op == Op::dcmha;
    std::vector<T> k(static_cast<std::size_t>(B * H * chunk * D)), v(k.size());
    fill_normal(k, 1.0f, 2);
    fill_normal(v, 1.0f, 3);
    dcmha::DynamicWeightsStorage<T> fill_dynw(B, chunk, kGroups, kRank, M);
    fill_normal(fill_dynw.data, 0.1f, 4);
    // The first n tokens of the chunk buffers.
    auto kv = [&](std::vector<T>& x, index_t n) {
      return dcmha::view<4>(x.data(), {B, H, n, D}, {H * chunk * D, chunk * D, D, 1});
    };
    auto key_side = [&](dcmha::DynamicWeightsStorage<T>& dw, index_t n) {
      if (!dc) return dcmha::ComposeWeights<T>{};
      dcmha::ComposeWeights<T> w = dcmha::decode_key_side(dw.views());
      for (dcmha::ComposeTerms<T>* t : {&w.pre, &w.post}) {
        t->kw1.shape[1] = n;
        t->kw2.shape[1] = n;
        t->kdd.shape[1] = n;
      }
      return w;
    };
    for (index_t done = 0; done < c.S - 1;) {
      const index_t n = std::min(chunk, c.S - 1 - done);
      cache.append(kv(k, n), kv(v, n), key_side(fill_dynw, n));
      done += n;
    }
    step_dynw = dcmha::DynamicWeightsStorage<T>(B, 1, kGroups, kRank, M);
    fill_normal(step_dynw.data, 0.1f, 5);
    cache.append(kv(k, 1), kv(v, 1), key_side(step_dynw, 1));
    if (dc) query_side = dcmha::decode_query_side(step_dynw.views());
    q.resize(static_cast<std::size_t>(B * H * D));
    out.resize(q.size());
    fill_normal(q, 1.0f, 1);
  }

  void decode(const dcmha::AttentionConfig& cfg) override {
    const T* cq = q.data();
    dcmha::decode(cfg, dcmha::bhtd(cq, c.B, c.H, 1, c.D), cache, query_side,
                  dcmha::bhtd(out.data(), c.B, c.H, 1, c.D));
  }

  double cache_bytes_per_token() const override {
    return double(dcmha::DecodeCache<T>::required_elements(cc)) * sizeof(T) / double(c.S);
  }
};

std::unique_ptr<DecodeRunner> cached_decode;
void release_decode_problem() { cached_decode.reset(); }

// Like problem_for: one problem at a time, the attention problem released first.
DecodeRunner& decode_problem_for(const DecodeCase& c) {
  cached.reset();
  cached_bf16.reset();
  const DecodeCase* k = cached_decode ? &cached_decode->c : nullptr;
  if (!k || k->op != c.op || k->B != c.B || k->H != c.H || k->S != c.S || k->D != c.D ||
      k->storage != c.storage) {
    cached_decode.reset();
    if (c.storage == Storage::bf16)
      cached_decode = std::make_unique<DecodeProblem<dcmha::bf16>>(c);
    else if (c.storage == Storage::f16)
      cached_decode = std::make_unique<DecodeProblem<dcmha::half>>(c);
    else
      cached_decode = std::make_unique<DecodeProblem<float>>(c);
  }
  return *cached_decode;
}

void run_decode_case(benchmark::State& state, const DecodeCase& c) {
  const dcmha::AttentionConfig cfg;
  try {
    DecodeRunner& p = decode_problem_for(c);
    p.decode(cfg);  // warm-up: the first touch of the output and the OpenMP pool
    for (auto _ : state) {
      p.decode(cfg);
      benchmark::ClobberMemory();
    }
    // QK^T and PV of one query row per head against S keys; compose work is not counted.
    state.counters["FLOPS"] =
        benchmark::Counter(4.0 * double(c.B) * double(c.H) * double(c.S) * double(c.D),
                           benchmark::Counter::kIsIterationInvariantRate);
    state.counters["threads"] = max_threads();
    state.counters["cache_bytes_per_token"] = p.cache_bytes_per_token();
    // The cache's bytes read per call (each cached token once) as a rate, next to
    // memory_bandwidth's.
    state.counters["cache_read_GBps"] =
        benchmark::Counter(p.cache_bytes_per_token() * double(c.S) * 1e-9,
                           benchmark::Counter::kIsIterationInvariantRate);
  } catch (const std::exception& e) {
    g_any_failed = true;
    state.SkipWithError(e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// The machine's DRAM read bandwidth: what decode, which reads its cache once per token, is
// bound by. Every thread sums its share of a buffer far larger than the caches (64-bit XOR in
// eight independent lanes, which the compiler vectorizes), read once per iteration.

struct BandwidthCase {
  index_t mebibytes;
};
std::string name_of(const BandwidthCase& c) {
  return "memory_bandwidth/read/" + std::to_string(c.mebibytes) + "MiB";
}

void run_bandwidth_case(benchmark::State& state, const BandwidthCase& c) {
  release_decode_problem();
  cached.reset();
  cached_bf16.reset();
  const index_t words = c.mebibytes * (index_t(1) << 20) / 8;
  std::vector<std::uint64_t> buffer(static_cast<std::size_t>(words));
#pragma omp parallel for schedule(static)
  for (index_t i = 0; i < words; ++i) buffer[i] = std::uint64_t(i) * 0x9E3779B97F4A7C15ull;
  auto read_all = [&] {
    std::uint64_t total = 0;
#pragma omp parallel reduction(^ : total)
    {
      index_t begin = 0, end = words;
#ifdef _OPENMP
      const index_t share = (words / omp_get_num_threads() + 7) / 8 * 8;
      begin = std::min(words, share * omp_get_thread_num());
      end = std::min(words, begin + share);
#endif
      std::uint64_t lane[8] = {};
      for (index_t i = begin; i + 8 <= end; i += 8)
        for (int l = 0; l < 8; ++l) lane[l] ^= buffer[i + l];
      for (int l = 0; l < 8; ++l) total ^= lane[l];
    }
    return total;
  };
  benchmark::DoNotOptimize(read_all());
  for (auto _ : state) benchmark::DoNotOptimize(read_all());
  state.counters["read_GBps"] =
      benchmark::Counter(double(words) * 8e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = max_threads();
}

// ---------------------------------------------------------------------------------------------
// One tile product alone, one thread, operands in L1/L2: the exact products' float FMA kernel
// (cpu/gemm.hpp) against the bf16 pair products of Products::storage_type (cpu/bf16_products.hpp)
// on the same shape, the forward's 128-row block by a 128-key tile at D = 128.

struct TileProductCase {
  bool bf16_pairs;
  index_t rows, cols, depth;
};
std::string name_of(const TileProductCase& c) {
  return std::string("tile_product/") + (c.bf16_pairs ? "bf16_pairs" : "float_fma") + "/" +
         std::to_string(c.rows) + "x" + std::to_string(c.cols) + "x" + std::to_string(c.depth);
}

void run_tile_product_case(benchmark::State& state, const TileProductCase& c) {
  if (c.bf16_pairs && !dcmha::cpu::bf16_products_available()) {
    state.SkipWithError("no AVX512_BF16 on this CPU");
    return;
  }
  std::vector<float> a(c.rows * c.depth), b(c.depth * c.cols), out(c.rows * c.cols);
  fill_normal(a, 1.0f, 1);
  fill_normal(b, 1.0f, 2);
  const index_t pairs = dcmha::cpu::pair_count(c.depth);
  std::vector<std::uint32_t> a_pairs(c.rows * pairs), b_pairs(pairs * c.cols);
  std::vector<dcmha::bf16> b_rows(b.begin(), b.end());
  auto run = [&] {
    if (!c.bf16_pairs)
      return dcmha::cpu::gemm_nn<float>(c.rows, c.cols, c.depth, a.data(), c.depth, 1, b.data(),
                                        c.cols, out.data(), c.cols, false);
    // P'V's form: A float rows rounded into pairs, B's rows interleaved, then the product.
    dcmha::cpu::bf16_product_ab(c.rows, c.cols, c.depth, {a.data(), c.depth},
                                {b_rows.data(), c.cols}, {out.data(), c.cols, 1.0f, false},
                                a_pairs.data(), b_pairs.data());
  };
  run();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * double(c.rows * c.cols * c.depth),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

/// Registers case c under name_of(c), timed by run(state, c) in wall-clock milliseconds.
template <class C>
void register_named(const C& c, void (*run)(benchmark::State&, const C&)) {
  benchmark::RegisterBenchmark(name_of(c).c_str(), [c, run](benchmark::State& s) { run(s, c); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

void register_decode_case(const DecodeCase& c) { register_named(c, run_decode_case); }
void register_bandwidth_case(const BandwidthCase& c) { register_named(c, run_bandwidth_case); }
void register_tile_product_case(const TileProductCase& c) {
  register_named(c, run_tile_product_case);
}
void register_case(const Case& c) { register_named(c, run_case); }

// ---------------------------------------------------------------------------------------------
// The dynamic weight projection: x (B, T, E) -> the twelve dynamic tensors, and its backward

struct ProjectionCase {
  Dir dir;  // fwd or bwd
  index_t B, H, T, D;
};

std::string name_of(const ProjectionCase& c) {
  return std::string(name_of(c.dir)) + "/dynw/B" + std::to_string(c.B) + "/H" +
         std::to_string(c.H) + "/T" + std::to_string(c.T) + "/D" + std::to_string(c.D);
}

// Parameters in the official layout with the official init scales (spec section 2).
struct ProjectionProblem {
  ProjectionCase c;
  index_t E, M, K;
  std::vector<float> x, dx, dw1, qkw, dd, g_dw1, g_qkw, g_dd;
  dcmha::DynamicWeightsStorage<float> out, dout;
  dcmha::DynamicWeightProjection<float> params;
  dcmha::DynamicWeightProjectionGrads<float> grads;
  dcmha::ProjectionActivations<float> activations;

  explicit ProjectionProblem(const ProjectionCase& c_)
      : c(c_),
        E(c_.H * c_.D),
        M(c_.H / kGroups),
        K(4 * c_.H / kGroups),
        out(c_.B, c_.T, kGroups, kRank, c_.H / kGroups),
        dout(c_.B, c_.T, kGroups, kRank, c_.H / kGroups) {
    const index_t G = kGroups, R = kRank, H = c.H;
    auto sized = [](std::vector<float>& v, index_t n, float stddev, std::uint64_t seed) {
      v.resize(static_cast<std::size_t>(n));
      fill_normal(v, stddev, seed);
    };
    sized(x, c.B * c.T * E, 1.0f, 11);
    sized(dw1, E * G * 4 * K, std::sqrt(2.0f / float(E + K)), 12);
    sized(qkw, G * 4 * K * 2 * R * M, 0.02f / (std::sqrt(2.0f * float(H * R)) * float(H + R)), 13);
    sized(dd, E * G * 4 * M, 0.05f * std::sqrt(2.0f / float(H + E)), 14);
    params.dw1 = dcmha::view<4>(dw1.data(), {E, G, 4, K});
    params.qkw = dcmha::view<5>(qkw.data(), {G, 4, K, 2 * R, M});
    params.dd = dcmha::view<3>(dd.data(), {E, G, 4 * M});
    if (c.dir == Dir::bwd) {
      fill_normal(dout.data, 1.0f, 15);
      dx.resize(x.size());
      g_dw1.resize(dw1.size());
      g_qkw.resize(qkw.size());
      g_dd.resize(dd.size());
      grads.dw1 = dcmha::view<4>(g_dw1.data(), {E, G, 4, K});
      grads.qkw = dcmha::view<5>(g_qkw.data(), {G, 4, K, 2 * R, M});
      grads.dd = dcmha::view<3>(g_dd.data(), {E, G, 4 * M});
    }
  }

  /// The backward's forward (keeping the activations) runs once, before the timed loop.
  void prepare(const dcmha::ProjectionConfig& cfg) {
    if (c.dir == Dir::bwd)
      dcmha::dynamic_weights_forward(cfg, input(), params, out.views(), activations);
  }
  void run(const dcmha::ProjectionConfig& cfg) {
    if (c.dir == Dir::fwd)
      dcmha::dynamic_weights_forward(cfg, input(), params, out.views(), activations);
    else
      dcmha::dynamic_weights_backward(cfg, input(), params, activations, dout.views(),
                                      dcmha::view<3>(dx.data(), {c.B, c.T, E}), grads);
  }
  dcmha::TensorView<const float, 3> input() const {
    return dcmha::view<3>(x.data(), {c.B, c.T, E});
  }

  // The GEMMs' FLOPs: x dw1 and x dd (E -> 4K + 4M per position), then hidden qkw
  // (4 x K -> 2R·M per group); the backward does each product twice (input and weight gradients).
  // Counted from the math, so a backward that recomputed the forward's products would not look
  // faster.
  double flops() const {
    const double rows = double(c.B) * double(c.T);
    const double f = 2.0 * rows * double(E) * double(kGroups) * double(4 * K + 4 * M) +
                     2.0 * rows * double(kGroups) * 4.0 * double(K) * double(2 * kRank * M);
    return c.dir == Dir::fwd ? f : 2.0 * f;
  }
};

void run_projection_case(benchmark::State& state, const ProjectionCase& c) {
  const dcmha::ProjectionConfig cfg;
  try {
    release_decode_problem();
    cached.reset();
    cached_bf16.reset();
    ProjectionProblem p(c);
    p.prepare(cfg);
    p.run(cfg);  // warm-up: first touch of the outputs and the OpenMP pool
    for (auto _ : state) {
      p.run(cfg);
      benchmark::ClobberMemory();
    }
    state.counters["FLOPS"] =
        benchmark::Counter(p.flops(), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["threads"] = max_threads();
  } catch (const std::exception& e) {
    g_any_failed = true;
    state.SkipWithError(e.what());
  }
}

void register_projection_case(const ProjectionCase& c) { register_named(c, run_projection_case); }

struct ShapeSet {
  index_t H, D;
  std::vector<index_t> Ts;
};

// Shape-major order, so consecutive benchmarks share the cached problem.
void register_all(bool smoke, bool memory_everywhere) {
  const std::vector<ShapeSet> shapes =
      smoke ? std::vector<ShapeSet>{{4, 16, {32, 64}}}
            : std::vector<ShapeSet>{{32, 128, {512, 1024, 2048, 4096}},  // DCFormer-6.9B heads
                                    {32, 80, {1024, 2048}},              // Pythia-2.8B heads
                                    {16, 64, {512, 1024, 2048, 4096}}};  // small models
  for (const ShapeSet& s : shapes)
    for (index_t T : s.Ts)
      for (dcmha::Mask mask : {dcmha::Mask::causal, dcmha::Mask::full})
        for (Op op : {Op::mha, Op::dcmha})
          for (Dir dir : {Dir::fwd, Dir::bwd, Dir::fwdbwd})
            register_case({dir, op, 1, s.H, T, s.D, mask, memory_everywhere});
  for (const ShapeSet& s : shapes)
    for (index_t T : s.Ts)
      for (Dir dir : {Dir::fwd, Dir::bwd}) register_projection_case({dir, 1, s.H, T, s.D});

  // bf16 storage at DCFormer-6.9B's heads, with exact and with storage-type products.
  for (index_t T : smoke ? std::vector<index_t>{32, 64} : std::vector<index_t>{1024, 2048})
    for (Op op : {Op::mha, Op::dcmha})
      for (Dir dir : {Dir::fwd, Dir::bwd, Dir::fwdbwd})
        for (bool storage : {false, true}) {
          Case c{dir,
                 op,
                 1,
                 smoke ? 4 : 32,
                 T,
                 smoke ? 16 : 128,
                 dcmha::Mask::causal,
                 memory_everywhere,
                 0,
                 true};
          c.storage_products = storage;
          register_case(c);
        }

  // Long context: what matters is that memory stays O(B·H·T), with no T×S buffer anywhere.
  if (!smoke)
    for (Op op : {Op::mha, Op::dcmha})
      register_case({Dir::fwdbwd, op, 1, 16, 16384, 64, dcmha::Mask::causal, true});

  // Local layers (DCFormer's window 256): the cost should grow linearly in T, not quadratically.
  const index_t window = smoke ? 8 : 256;
  for (index_t T : smoke ? std::vector<index_t>{32, 64} : std::vector<index_t>{2048, 8192})
    for (Op op : {Op::mha, Op::dcmha})
      register_case({Dir::fwd, op, 1, smoke ? 4 : 32, T, smoke ? 16 : 128, dcmha::Mask::causal,
                     memory_everywhere, window});

  // A caller already inside a parallel region: B = 2 sequences, one call each from the threads of
  // an enclosing team, next to one call over both.
  for (Dir dir : {Dir::fwd, Dir::bwd})
    for (bool nested : {false, true}) {
      Case c{dir,
             Op::dcmha,
             2,
             smoke ? 4 : 16,
             smoke ? 64 : 2048,
             smoke ? 16 : 64,
             dcmha::Mask::causal,
             memory_everywhere};
      c.nested = nested;
      register_case(c);
    }

  // Decoding with DCFormer-6.9B's heads: one token, a batch of 1 (latency) and of 8.
  for (index_t S : smoke ? std::vector<index_t>{32, 64} : std::vector<index_t>{1024, 4096, 16384})
    for (index_t B : {1, 8})
      for (Op op : {Op::mha, Op::dcmha})
        register_decode_case({op, B, smoke ? 4 : 32, S, smoke ? 16 : 128});
  // The same with bf16 and fp16 caches (half the bytes per token) at a batch of 8.
  for (index_t S : smoke ? std::vector<index_t>{64} : std::vector<index_t>{4096, 16384})
    for (Storage storage : {Storage::bf16, Storage::f16})
      for (Op op : {Op::mha, Op::dcmha})
        register_decode_case({op, 8, smoke ? 4 : 32, S, smoke ? 16 : 128, storage});
  register_bandwidth_case({smoke ? 64 : 2048});
  for (bool pairs : {false, true})
    register_tile_product_case({pairs, smoke ? 16 : 128, smoke ? 16 : 128, smoke ? 16 : 128});
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false, memory_everywhere = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--dcmha_smoke") == 0)
      smoke = true;
    else if (std::strcmp(argv[i], "--dcmha_report_memory") == 0)
      memory_everywhere = true;
    else
      argv[kept++] = argv[i];
  }
  argc = kept;

  register_all(smoke, memory_everywhere);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_any_failed ? 1 : 0;
}
