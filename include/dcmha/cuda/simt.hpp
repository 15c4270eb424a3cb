#pragma once
// The execution model the CUDA kernels are written against: a kernel body is a function of a
// Block, what one thread sees of its thread block. Under nvcc DeviceBlock maps it onto CUDA's
// built-ins; simt_host.hpp runs the same bodies on host threads (the tests, CI without a GPU).
//
//   blk.thread(), blk.threads()   this thread's index in the block, the block's thread count
//   blk.block(0..2)               the block's index in the grid (x, y, z)
//   blk.sync()                    __syncthreads(): every thread of the block arrives first
//   blk.sync_warp()               __syncwarp(): every thread of this thread's warp arrives first
//   blk.shared()                  the block's dynamic shared memory
//
// Besides these six the kernels use the tensor-core products of warp_matrix.hpp, which the
// execution layer need not know: off the device they are plain loops over each lane's results.
#include "../tensor.hpp"

namespace dcmha::cuda {

/// Threads per warp: the unit of sync_warp() and of the tensor-core products.
constexpr int kWarpSize = 32;

template <class Block>
DCMHA_HOST_DEVICE int lane_of(const Block& blk) {
  return blk.thread() % kWarpSize;
}
template <class Block>
DCMHA_HOST_DEVICE int warp_of(const Block& blk) {
  return blk.thread() / kWarpSize;
}

/// Calls f(i) for the items i in [0, n) that thread blk.thread() owns: i = thread, thread +
/// threads, ... The same thread owns the same items in every call with the same n, which is what
/// lets a thread keep accumulating into the items it owns without a barrier between tiles.
template <class Block, class F>
DCMHA_HOST_DEVICE void for_each_owned(const Block& blk, index_t n, F&& f) {
  for (index_t i = blk.thread(); i < n; i += blk.threads()) f(i);
}

#if defined(__CUDACC__)
struct DeviceBlock {
  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ index_t block(int axis) const {
    return axis == 0 ? blockIdx.x : axis == 1 ? blockIdx.y : blockIdx.z;
  }
  __device__ void sync() const { __syncthreads(); }
  __device__ void sync_warp() const { __syncwarp(); }
  __device__ void* shared() const {
    // 128-byte aligned: every scalar type and the tensor-core loads (32 bytes) start aligned.
    extern __shared__ __align__(128) double dcmha_dynamic_shared[];
    return dcmha_dynamic_shared;
  }
};
#endif

}  // namespace dcmha::cuda
