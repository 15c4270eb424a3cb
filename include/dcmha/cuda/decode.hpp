#pragma once
// Incremental decoding on the GPU (spec section 3), as on the CPU (decode/decode.hpp):
//
//   dcmha::cuda::DecodeCache<T> cache(config);                 // device memory
//   cache.append(k_new, v_new, key_side, counts, stream);      // 1. the new tokens' K, V, terms
//   dcmha::cuda::decode(cfg, q_new, cache, query_side, out, workspace, stream);  // 2. their rows
//
// Same configuration, layout, ring rules and checks as dcmha::DecodeCache (whose bookkeeping it
// keeps, over device slots); tensors are device memory, counts host memory. A step is the
// forward kernel over the cache's slots. nvcc only.
#include <memory>
#include <vector>

#include "../decode/decode_params.hpp"
#include "append_kernel.hpp"
#include "attention.hpp"

namespace dcmha::cuda {

template <class T>
__global__ void append_kernel(const AppendParams<T> p) {
  append_token(DeviceBlock{}, p);
}

template <class T>
class DecodeCache {
 public:
  /// Device memory for the configuration (zeroed); dcmha::Error if CUDA cannot provide it.
  explicit DecodeCache(const DecodeCacheConfig& c) {
    const char* fn = "dcmha::cuda::DecodeCache";
    const index_t elements = dcmha::DecodeCache<T>::required_elements(c);
    try {
      check(fn, "cudaMalloc", cudaMalloc(&slots_, elements * sizeof(T)));
      check(fn, "cudaMalloc", cudaMalloc(&indices_, 2 * c.B * sizeof(index_t)));
      // Finished before any append, whatever stream that uses.
      check(fn, "cudaMemset", cudaMemset(slots_, 0, elements * sizeof(T)));
      check(fn, "cudaDeviceSynchronize", cudaDeviceSynchronize());
      state_ = std::make_unique<dcmha::DecodeCache<T>>(c, static_cast<T*>(slots_), elements);
    } catch (...) {
      cudaFree(slots_);
      cudaFree(indices_);
      throw;
    }
  }
  DecodeCache(const DecodeCache&) = delete;
  DecodeCache& operator=(const DecodeCache&) = delete;
  ~DecodeCache() {
    cudaFree(slots_);
    cudaFree(indices_);
  }

  const DecodeCacheConfig& config() const { return state_->config(); }
  index_t capacity() const { return state_->capacity(); }
  index_t length(index_t b) const { return state_->length(b); }
  index_t kept(index_t b) const { return state_->kept(b); }
  void reset() { state_->reset(); }
  /// The bookkeeping and the slots' device views (k_slots(), ...), as dcmha::DecodeCache has them.
  const dcmha::DecodeCache<T>& state() const { return *state_; }

  /// dcmha::DecodeCache::append on the device: k_new, v_new and key_side are device memory,
  /// counts host memory; asynchronous on `stream`.
  void append(TensorView<const T, 4> k_new, TensorView<const T, 4> v_new,
              const ComposeWeights<T>& key_side = {}, TensorView<const index_t, 1> counts = {},
              cudaStream_t stream = 0) {
    const char* fn = "dcmha::cuda::DecodeCache::append";
    state_->append_rows(fn, k_new, v_new, key_side, counts,
                        [&](index_t n, const index_t* lengths, const index_t* step_counts) {
                          copy_tokens(fn, n, lengths, step_counts,
                                      append_params(k_new, v_new, key_side), stream);
                        });
  }

 private:
  /// The append kernel's parameters, less the step's lengths and counts.
  AppendParams<T> append_params(TensorView<const T, 4> k_new, TensorView<const T, 4> v_new,
                                const ComposeWeights<T>& key_side) const {
    AppendParams<T> p;
    p.k_new = k_new, p.v_new = v_new;
    p.k_slots = state_->k_slots(), p.v_slots = state_->v_slots();
    p.key_side[0] = key_side.pre, p.key_side[1] = key_side.post;
    for (int side = 0; side < 2; ++side) {
      p.kw1_slots[side] = state_->kw1_slots(side == 1);
      p.kw2_slots[side] = state_->kw2_slots(side == 1);
      p.kdd_slots[side] = state_->kdd_slots(side == 1);
    }
    p.capacity = capacity();
    return p;
  }
  /// Stages the lengths and counts, then appends n tokens of each sequence.
  void copy_tokens(const char* fn, index_t n, const index_t* lengths, const index_t* counts,
                   AppendParams<T> p, cudaStream_t stream) {
    const index_t B = config().B;
    staged_.assign(lengths, lengths + B);
    staged_.insert(staged_.end(), counts, counts + B);
    check(fn, "cudaMemcpyAsync",
          cudaMemcpyAsync(indices_, staged_.data(), 2 * B * sizeof(index_t), cudaMemcpyHostToDevice,
                          stream));
    p.lengths = static_cast<const index_t*>(indices_);
    p.counts = p.lengths + B;
    KernelLaunch l;
    l.shape.threads = 128;
    l.shape.x = n;
    l.shape.y = B;
    launch(fn, append_kernel<T>, l, stream, p);
  }

  void* slots_ = nullptr;
  void* indices_ = nullptr;
  std::vector<index_t> staged_;
  std::unique_ptr<dcmha::DecodeCache<T>> state_;
};

// A template over an unused int, as attention.hpp's entry points: only a call compiles its type.
#define DCMHA_DEFINE_CUDA_DECODE_ENTRY_POINTS(T)                                                   \
  template <int = 0>                                                                               \
  void decode(const AttentionConfig& cfg, TensorView<const T, 4> q_new,                            \
              const DecodeCache<T>& cache, const ComposeWeights<T>& query_side,                    \
              TensorView<T, 4> out, DeviceWorkspace& workspace, cudaStream_t stream = 0,           \
              const LaunchOptions& launch = {}) {                                                  \
    const char* fn = "dcmha::cuda::decode";                                                        \
    detail::DecodeStepLengths lengths; /* the params' host arrays, staged by the launch */         \
    launch_forward(fn,                                                                             \
                   detail::decode_params(fn, cfg, q_new, cache.state(), query_side, out, lengths), \
                   workspace, stream, launch);                                                     \
  }

DCMHA_DEFINE_CUDA_DECODE_ENTRY_POINTS(float)
DCMHA_DEFINE_CUDA_DECODE_ENTRY_POINTS(bf16)
DCMHA_DEFINE_CUDA_DECODE_ENTRY_POINTS(half)
#undef DCMHA_DEFINE_CUDA_DECODE_ENTRY_POINTS

}  // namespace dcmha::cuda
