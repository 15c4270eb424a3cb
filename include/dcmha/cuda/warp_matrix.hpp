#pragma once
// The tensor-core product of one warp: C (8 x 32, float) = A (8 x k, bf16) B (k x 32, bf16),
// the m8n32k16 shape of CUDA's warp matrix functions (nvcuda::wmma, bf16 from sm_80 on), with
// float accumulation. 8 x 32 matches a step of 32 keys: score rows are A = Q rows against
// B = K^T, output rows are A = P' rows against B = a 32-column slice of V.
//
// On sm_80 and newer it runs on tensor cores. Everywhere else (the host runner, older GPUs) each
// lane computes its 8 of the 256 results in k order; the tensor cores' order within a k-step is
// unspecified, so results agree to float rounding, not bitwise.
//
// The operands' rules are the wmma loads': pointers 32-byte aligned, leading dimensions a
// multiple of 8 elements (bf16) or 4 (float). Off the device they are checked and throw.
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "../config.hpp"
#include "simt.hpp"

#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#include <cuda_bf16.h>
#include <mma.h>
#define DCMHA_CUDA_TENSOR_CORES 1
#endif

namespace dcmha::cuda {

/// How B is stored: element (k, n) at k * ldb + n (row major) or n * ldb + k (column major, as
/// K's rows are for B = K^T).
enum class Layout { row_major, column_major };

/// The product's tile.
struct WarpTile {
  static constexpr int rows = 8, cols = 32, depth = 16;
};

DCMHA_HOST_DEVICE inline void check_warp_operand(const void* p, index_t leading, index_t multiple) {
#if !defined(__CUDA_ARCH__)
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0 || leading % multiple != 0)
    throw std::logic_error(
        "dcmha::cuda::warp_product: an operand is not 32-byte aligned or its "
        "leading dimension is not a multiple of 8 (bf16) / 4 (float)");
#else
  (void)p, (void)leading, (void)multiple;
#endif
}

/// c = a b for one warp (every lane calls it with the same arguments). k is a multiple of
/// WarpTile::depth. The operands were written before the caller's sync_warp() or sync(); the
/// caller syncs again before another lane reads c.
template <Layout BLayout, class Block>
DCMHA_HOST_DEVICE void warp_product(const Block& blk, const bf16* a, index_t lda, const bf16* b,
                                    index_t ldb, index_t k, float* c, index_t ldc) {
  check_warp_operand(a, lda, 8);
  check_warp_operand(b, ldb, 8);
  check_warp_operand(c, ldc, 4);
#if defined(DCMHA_CUDA_TENSOR_CORES)
  namespace wmma = nvcuda::wmma;
  using BOrder = std::conditional_t<BLayout == Layout::row_major, wmma::row_major, wmma::col_major>;
  constexpr int m = WarpTile::rows, n = WarpTile::cols, depth = WarpTile::depth;
  wmma::fragment<wmma::matrix_a, m, n, depth, __nv_bfloat16, wmma::row_major> a_part;
  wmma::fragment<wmma::matrix_b, m, n, depth, __nv_bfloat16, BOrder> b_part;
  wmma::fragment<wmma::accumulator, m, n, depth, float> sum;
  wmma::fill_fragment(sum, 0.0f);
  // Eigen::bfloat16 is the 16 bits of a bf16, as __nv_bfloat16 is.
  const auto* a16 = reinterpret_cast<const __nv_bfloat16*>(a);
  const auto* b16 = reinterpret_cast<const __nv_bfloat16*>(b);
  for (index_t d = 0; d < k; d += depth) {
    wmma::load_matrix_sync(a_part, a16 + d, unsigned(lda));
    wmma::load_matrix_sync(b_part, b16 + (BLayout == Layout::row_major ? d * ldb : d),
                           unsigned(ldb));
    wmma::mma_sync(sum, a_part, b_part, sum);
  }
  wmma::store_matrix_sync(c, sum, unsigned(ldc), wmma::mem_row_major);
  (void)blk;
#else
  constexpr int results = WarpTile::rows * WarpTile::cols;
  for (int e = lane_of(blk); e < results; e += kWarpSize) {
    const index_t i = e / WarpTile::cols, j = e % WarpTile::cols;
    float sum = 0;
    for (index_t d = 0; d < k; ++d) {
      const bf16 bv = BLayout == Layout::row_major ? b[d * ldb + j] : b[j * ldb + d];
      sum += float(a[i * lda + d]) * float(bv);
    }
    c[i * ldc + j] = sum;
  }
#endif
}

}  // namespace dcmha::cuda
