#pragma once
// The execution model the CUDA kernels are written against: a kernel body is a function of a
// Block, what one thread sees of its thread block. Under nvcc DeviceBlock maps it onto CUDA's
// built-ins; simt_host.hpp runs the same bodies on host threads (the tests, CI without a GPU).
//
//   blk.thread(), blk.threads()   this thread's index in the block, the block's thread count
//   blk.block(0..2)               the block's index in the grid (x, y, z)
//   blk.sync()                    __syncthreads(): every thread of the block arrives first
//   blk.shared()                  the block's dynamic shared memory
//
// The kernels use nothing else of the GPU (no warp shuffles, votes or tensor-core fragments), so
// these five are all an execution layer must provide.
#include "../tensor.hpp"

namespace dcmha::cuda {

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
  __device__ void* shared() const {
    extern __shared__ double dcmha_dynamic_shared[];  // double: aligned for every scalar type
    return dcmha_dynamic_shared;
  }
};
#endif

}  // namespace dcmha::cuda
