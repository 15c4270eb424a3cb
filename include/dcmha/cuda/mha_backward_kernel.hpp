#pragma once
// MHA's backward in one pass over the keys (FlashAttention-2's): bf16 and fp16, head dims up to
// 128, given the forward's output (LaunchOptions::one_pass). Its launches:
//
//   sum_row_dots       D = rowsum(dO O) of every row into the scratch; the row's dQ sums zeroed.
//   MhaBackwardKernel  a block per (128 keys, head, sequence) over the 64-row query tiles that
//                      see its keys: S = Q K^T and dP = dO V^T, P and dS = P (dP - D) into shared
//                      memory, dV += P^T dO and dK += dS^T Q held in registers, and dQ += dS K
//                      added to the scratch (red.global.add). Launched in rounds of key_splits
//                      key blocks (one round where the order may vary).
//   store_query_grads  dQ = scale * the sums, added in split order, in the storage type.
//
// Its warps take 32 x 32 blocks of each product (the two-kernel backward's take 16 keys or rows
// by a whole tile), which reads each operand from shared memory about half as often, and dQ
// costs no second walk over the keys. Deterministic, block x of every round adds to dQ sums of
// its own: each element is added to by one thread a round, the rounds in stream order. (A block
// that walked its split's key blocks itself would save the launches, but the loop makes ptxas
// spill at head dim 128.) Unordered, one round's blocks all add to one sum.
#include "backward_kernel.hpp"

namespace dcmha::cuda {

/// The row (b, h, t) a quad of the row passes handles, or -1 past the last.
template <class Block>
DCMHA_INLINE index_t row_pass_row(const Block& blk, const detail::AttentionDims& d) {
  const index_t row = blk.block(0) * kRowPassRows + blk.thread() / 4;
  return row < d.B * d.H * d.T ? row : -1;
}

/// Pass 1: D = sum over d of dO O per row into scratch.row_dot, and the row's dQ sums zeroed.
template <class Block, class T>
DCMHA_INLINE void sum_row_dots(const Block& blk, const detail::BackwardParams<T>& p,
                               const BackwardScratch& scratch) {
  const index_t row = row_pass_row(blk, p.dims);
  const int part = blk.thread() % 4;
  const index_t at = row < 0 ? 0 : row;
  const index_t t = at % p.dims.T, h = at / p.dims.T % p.dims.H, b = at / p.dims.T / p.dims.H;
  const bool real = row >= 0 && t < detail::RowMask(p.mask, p.dims.T, p.dims.S).query_length(b);
  const float sum =
      real ? row_dot_part(blk, &p.out(b, h, t, 0), &p.dout(b, h, t, 0), int(p.dims.Dv), part)
           : 0.0f;
  const float dot = quad_sum(blk, sum);  // every lane of the warp: a shuffle takes them all
  if (row < 0) return;
  if (part == 0) blk.store_global(scratch.row_dot + row, dot);
  const index_t rows = p.dims.B * p.dims.H * p.dims.T;
  for (int split = 0; split < scratch.dq_sums; ++split) {
    float* sums = scratch.dq_sum + (split * rows + row) * p.dims.D;
    for (index_t d = 2 * part; d < p.dims.D; d += 8)
      store_column_pair(blk, sums + d, 0.0f, 0.0f, d + 1 < p.dims.D);
  }
}

/// Pass 3: dQ = scale * the splits' sums added in split order, rows past the query length 0.
template <class Block, class T>
DCMHA_INLINE void store_query_grads(const Block& blk, const detail::BackwardParams<T>& p,
                                    const BackwardScratch& scratch) {
  const index_t row = row_pass_row(blk, p.dims);
  if (row < 0) return;
  const index_t t = row % p.dims.T, h = row / p.dims.T % p.dims.H, b = row / p.dims.T / p.dims.H;
  const float scale = float(p.scale);
  const index_t rows = p.dims.B * p.dims.H * p.dims.T;
  // A quad's lanes take column pairs in turn: 8 bytes of sums, one store of dQ's pair.
  for (index_t d = 2 * (blk.thread() % 4); d < p.dims.D; d += 8) {
    const bool both = d + 1 < p.dims.D;
    float x = 0.0f, y = 0.0f;
    for (int split = 0; split < scratch.dq_sums; ++split) {
      const FloatPair s =
          load_column_pair(blk, scratch.dq_sum + (split * rows + row) * p.dims.D + d, both);
      x += s.x, y += s.y;
    }
    store_column_pair(blk, &p.dq(b, h, t, d), T(scale * x), T(scale * y), both);
  }
}

template <class T, int kHeadDim>
constexpr bool kOnePassHeadDim = kHeadDim <= 128 && kTensorCoreType<T>;

template <class T, int kHeadDim, class Block>
class MhaBackwardKernel : BackwardBlock<T, Block> {
  using Base = BackwardBlock<T, Block>;
  using Base::blk_, Base::p_, Base::geo_, Base::mask, Base::b_, Base::head_;
  static_assert(kOnePassHeadDim<T, kHeadDim>, "bf16 and fp16, head dims up to 128");

 public:
  /// dK and dV: warp w holds keys 32 (w % 4) .. + 31 by columns kHeadDim / 2 (w / 4) .. (half
  /// of each, two 16-key blocks of kKeyGradTiles n8 tiles).
  static constexpr int kKeyGradTiles = kHeadDim / 16;
  /// dQ: 32-row blocks by kHeadDim / 4 columns where those are whole pairs of n8 tiles (head
  /// dims 64, 128), else 16-row blocks by kHeadDim / 2 columns (32, 96).
  static constexpr int kQueryGradRowTiles = kHeadDim % 64 == 0 ? 2 : 1;
  static constexpr int kQueryGradColumnBlocks = 2 * kQueryGradRowTiles;
  static constexpr int kQueryGradTiles = kHeadDim / kQueryGradColumnBlocks / 8;

  DCMHA_INLINE MhaBackwardKernel(const Block& blk, const detail::BackwardParams<T>& p,
                                 const BackwardGeometry& geo, const BackwardScratch& scratch)
      : Base(blk, p, geo), scratch_(scratch) {
    s0_ = (geo.first_key_block + this->tile_) * kOnePassKeys;
    // A last round's block past the last key block (keys_real_ <= 0) stages only zeros, meets no
    // query tile and stores nothing.
    keys_real_ = p.dims.S - s0_ < kOnePassKeys ? int(p.dims.S - s0_) : kOnePassKeys;
  }

  DCMHA_INLINE void run() {
    this->stage_key_rows(sh().k(0), p_.k, geo_.D, geo_.chunked_k, s0_, keys_real_);
    this->stage_key_rows(sh().v(0), p_.v, geo_.Dv, geo_.chunked_v, s0_, keys_real_);
    blk_.cp_async_commit();
    DCMHA_UNROLL
    for (int m = 0; m < 2; ++m) dk_[m].zero(), dv_[m].zero();
    const int tiles = int((p_.dims.T + kOnePassRows - 1) / kOnePassRows);
    int stage = 0;
    int next = int(this->next_query_tile(0, tiles, s0_, keys_real_));
    if (next < tiles) this->stage_query_tile(sh(), next, 0);
    for (int tile = next; tile < tiles; tile = next, stage ^= 1) {
      next = int(this->next_query_tile(tile + 1, tiles, s0_, keys_real_));
      blk_.template cp_async_wait<0>();
      blk_.sync();  // the tile landed; every warp is done with the last one's P, dS and lse
      if (next < tiles) this->stage_query_tile(sh(), next, stage ^ 1);
      query_tile(tile * kOnePassRows, stage);
    }
    store();
  }

 private:
  using Scores = Accumulators<4>;  // a warp's 16 rows x 32 keys

  /// The warp's 32 rows and 32 keys of the score-shaped blocks.
  DCMHA_INLINE int score_row0() const { return 32 * (warp_of(blk_) / 4); }
  DCMHA_INLINE int key0() const { return 32 * (warp_of(blk_) % 4); }

  DCMHA_INLINE void query_tile(int t0, int stage) {
    this->load_row_statistics(sh().lse(), sh().row_dot(), scratch_.row_dot, t0, kOnePassRows,
                              kOnePassRows);
    Scores s[2], dp[2];
    DCMHA_UNROLL
    for (int m = 0; m < 2; ++m) s[m].zero(), dp[m].zero();
    product_rows_rows(blk_, sh().q(stage).head(0), score_row0(), sh().k(0).head(0), key0(),
                      this->depth_of(geo_.D), s);
    product_rows_rows(blk_, sh().dout(stage).head(0), score_row0(), sh().v(0).head(0), key0(),
                      this->depth_of(geo_.Dv), dp);
    blk_.sync();  // the row statistics, written by other warps
    DCMHA_UNROLL
    for (int m = 0; m < 2; ++m) score_grads(t0, m, s[m], dp[m]);
    blk_.sync();  // P and dS, written by other warps
    const int d0 = kHeadDim / 2 * (warp_of(blk_) / 4);
    product_cols_cols(blk_, sh().values_probs().head(0), key0(), sh().dout(stage).head(0), d0,
                      kOnePassRows, dv_);
    product_cols_cols(blk_, sh().dscores().head(0), key0(), sh().q(stage).head(0), d0, kOnePassRows,
                      dk_);
    add_query_grads(t0);
  }

  /// P = exp(scale S - lse), 0 where masked, and dS = P (dP - D) of 16-row block m into the
  /// shared P and dS tiles (dS in dp's registers: a third block would spill).
  DCMHA_INLINE void score_grads(int t0, int m, Scores& s, Scores& dp) {
    using std::exp;
    const FragmentPlace f(blk_);
    const int r0 = score_row0() + 16 * m;
    const FragmentRows rows(blk_, mask(), b_, t0 + r0, int(p_.dims.T - t0) - r0);
    mask_fragments(blk_, rows, s0_ + key0(), s, detail::negative_infinity<float>());
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float lse = blk_.load_shared(sh().lse() + r0 + f.row(2 * h));
      const float dot = blk_.load_shared(sh().row_dot() + r0 + f.row(2 * h));
      DCMHA_UNROLL
      for (int j = 0; j < 4; ++j) DCMHA_UNROLL
      for (int i = 2 * h; i < 2 * h + 2; ++i) {
        const float x = s.c[j][i];
        s.c[j][i] = lse > detail::negative_infinity<float>() ? exp(this->scale() * x - lse) : 0.0f;
        dp.c[j][i] = s.c[j][i] * (dp.c[j][i] - dot);
      }
    }
    blk_.count_exp(16);
    store_operand_fragments(blk_, s, sh().values_probs().head(0), r0, key0());
    store_operand_fragments(blk_, dp, sh().dscores().head(0), r0, key0());
  }

  /// dS K of the warp's dQ block, added to the scratch's sums (rows past the query length see no
  /// key: their dS is 0, and they are skipped).
  DCMHA_INLINE void add_query_grads(int t0) {
    constexpr int kRows = 16 * kQueryGradRowTiles, kColumns = 8 * kQueryGradTiles;
    const int w = warp_of(blk_);
    const int r0 = kRows * (w / kQueryGradColumnBlocks);
    const int d0 = kColumns * (w % kQueryGradColumnBlocks);
    Accumulators<kQueryGradTiles> dq[kQueryGradRowTiles];
    DCMHA_UNROLL
    for (int m = 0; m < kQueryGradRowTiles; ++m) dq[m].zero();
    product_rows_cols(blk_, sh().dscores().head(0), r0, sh().k(0).head(0), 0, d0, kOnePassKeys, dq);
    const FragmentPlace f(blk_);
    const index_t qlen = this->query_length();
    const index_t split = geo_.split_sums ? this->tile_ : 0;
    float* sums = scratch_.dq_sum +
                  (((split * p_.dims.B + b_) * p_.dims.H + head_) * p_.dims.T + t0) * geo_.D;
    DCMHA_UNROLL
    for (int m = 0; m < kQueryGradRowTiles; ++m) DCMHA_UNROLL
    for (int j = 0; j < kQueryGradTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = r0 + 16 * m + f.row(i), d = d0 + 8 * j + f.column(i);
      if (t0 + r >= qlen || d >= geo_.D) continue;
      add_column_pair(blk_, sums + r * geo_.D + d, dq[m].c[j][i], dq[m].c[j][i + 1],
                      d + 1 < geo_.D);
    }
  }

  DCMHA_INLINE void store() {
    const FragmentPlace f(blk_);
    const index_t klen = this->key_length();
    const int d0 = kHeadDim / 2 * (warp_of(blk_) / 4);
    DCMHA_UNROLL
    for (int m = 0; m < 2; ++m) DCMHA_UNROLL
    for (int j = 0; j < kKeyGradTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = key0() + 16 * m + f.row(i), d = d0 + 8 * j + f.column(i);
      if (r >= keys_real_) continue;
      const index_t s = s0_ + r;
      this->store_key_grads(scratch_, s, d, s < klen, {dk_[m].c[j][i], dk_[m].c[j][i + 1]},
                            {dv_[m].c[j][i], dv_[m].c[j][i + 1]});
    }
  }

  const BackwardScratch& scratch_;  // the kernel's parameter: a copy would hold registers
  DCMHA_INLINE BackwardTiles<T, kHeadDim> sh() const { return {geo_, blk_.shared()}; }
  int s0_ = 0;  // 32-bit positions (the plan keeps T and S below 2^31): 64-bit ones spill
  int keys_real_ = 0;
  Accumulators<kKeyGradTiles> dk_[2], dv_[2];
};

}  // namespace dcmha::cuda
