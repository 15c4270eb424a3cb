#pragma once
// The execution model the CUDA kernels are written against: a kernel body is a function of a
// Block, what one thread sees of its thread block. Under nvcc DeviceBlock maps it onto CUDA's
// built-ins and PTX; emulator/emulator.hpp's HostBlock runs the same bodies on the host, lane by
// lane, with the same instruction semantics (the tests, CI without a GPU).
//
//   identity     thread(), threads(), block(axis), cluster_rank(), cluster_size()
//   barriers     sync() (__syncthreads), sync_warp() (__syncwarp), sync_cluster() (a cluster's
//                barrier.cluster arrive.release + wait.acquire)
//   shared       shared() (dynamic shared memory), peer_shared(p, block) (the same offset
//                in cluster block `block`'s shared memory), load_shared / store_shared
//   global       load_global / store_global, atomic_add_global and atomic_add_global_pair
//                (float, red.global.add, .v2 on sm_90: MHA's dQ sums)
//   warp         shfl_xor, ldmatrix_x4 / _x2 (and .trans), mma_bf16 / mma_f16
//                (mma.sync.m16n8k16, f32 accumulators, d += a b)
//   async        cp_async_16 (cp.async.cg, 16 bytes, zeros where not valid), cp_async_commit,
//                cp_async_wait<N> (wait_group N)
//   counting     count_fma, count_exp: CUDA-core work the emulator's cost model counts (nothing
//                on the device)
//
// Kernels touch shared memory only through these calls, so that the emulator sees every access.
#include <cstdint>

#include "../tensor.hpp"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif
#endif

namespace dcmha::cuda {

/// Threads per warp: the unit of sync_warp(), shuffles and the tensor-core instructions.
constexpr int kWarpSize = 32;

template <class Block>
DCMHA_INLINE int lane_of(const Block& blk) {
  return blk.thread() % kWarpSize;
}
/// The lane, hidden from the compiler's loop-invariant code motion. The products' ldmatrix
/// addresses (a swizzled chunk per k step: 8 per operand at head dim 128) are then recomputed at
/// each call, a few integer operations, instead of being hoisted out of the key loop into
/// registers that the output accumulators need.
template <class Block>
DCMHA_INLINE int unhoisted_lane_of(const Block& blk) {
  int lane = lane_of(blk);
#ifdef __CUDA_ARCH__
  asm volatile("" : "+r"(lane));
#endif
  return lane;
}
template <class Block>
DCMHA_INLINE int warp_of(const Block& blk) {
  return blk.thread() / kWarpSize;
}

/// Calls f(i) for the items i in [0, n) that thread blk.thread() owns: i = thread, thread +
/// threads, ... The same thread owns the same items in every call with the same n.
template <class Block, class F>
DCMHA_INLINE void for_each_owned(const Block& blk, int n, F&& f) {
  for (int i = blk.thread(); i < n; i += blk.threads()) f(i);
}

#if defined(__CUDACC__)
struct DeviceBlock {
  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ index_t block(int axis) const {
    return axis == 0 ? blockIdx.x : axis == 1 ? blockIdx.y : blockIdx.z;
  }
  __device__ void* shared() const {
    // 128-byte aligned: ldmatrix rows and cp.async destinations (16 bytes) start aligned.
    extern __shared__ __align__(128) unsigned char dcmha_dynamic_shared[];
    return dcmha_dynamic_shared;
  }
  __device__ void sync() const { __syncthreads(); }
  __device__ void sync_warp() const { __syncwarp(); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ int cluster_rank() const {
    return static_cast<int>(cooperative_groups::this_cluster().block_rank());
  }
  __device__ int cluster_size() const {
    return static_cast<int>(cooperative_groups::this_cluster().num_blocks());
  }
  __device__ void sync_cluster() const { cooperative_groups::this_cluster().sync(); }
  template <class U>
  __device__ U* peer_shared(U* local, int block) const {
    return cooperative_groups::this_cluster().map_shared_rank(local, static_cast<unsigned>(block));
  }
#else
  // Before sm_90 there are no clusters: every launch has clusters of one block.
  __device__ int cluster_rank() const { return 0; }
  __device__ int cluster_size() const { return 1; }
  __device__ void sync_cluster() const { __syncthreads(); }
  template <class U>
  __device__ U* peer_shared(U* local, int) const {
    return local;
  }
#endif

  __device__ float shfl_xor(float v, int lane_mask) const {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
  }

  template <class U>
  __device__ U load_shared(const U* p) const {
    return *p;
  }
  template <class U>
  __device__ void store_shared(U* p, const U& v) const {
    *p = v;
  }
  template <class U>
  __device__ U load_global(const U* p) const {
    return *p;
  }
  template <class U>
  __device__ void store_global(U* p, const U& v) const {
    *p = v;
  }
  __device__ void atomic_add_global(float* p, float v) const { atomicAdd(p, v); }
  /// p[0] += x, p[1] += y, p 8-byte aligned: one 8-byte red on sm_90, two 4-byte ones before.
  __device__ void atomic_add_global_pair(float* p, float x, float y) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x), atomicAdd(p + 1, y);
#endif
  }
  __device__ void count_fma(index_t) const {}
  __device__ void count_exp(index_t) const {}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static __device__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
  }
  __device__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
  __device__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
  __device__ void ldmatrix_x2(std::uint32_t (&r)[2], const void* row) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
  }
  __device__ void ldmatrix_x2_trans(std::uint32_t (&r)[2], const void* row) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
  }
  __device__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4],
                           const std::uint32_t (&b)[2]) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ void mma_f16(float (&d)[4], const std::uint32_t (&a)[4],
                          const std::uint32_t (&b)[2]) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ void cp_async_16(void* dst, const void* src, bool valid) const {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
  }
  __device__ void cp_async_commit() const { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
  template <int N>
  __device__ void cp_async_wait() const {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
  }
#endif
};
#endif

}  // namespace dcmha::cuda
