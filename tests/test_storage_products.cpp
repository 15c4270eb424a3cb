// Products::storage_type (config.hpp): the tile products in the storage type with float
// accumulation. For bf16 on a CPU with AVX512_BF16 they run on vdpbf16ps over operands packed in
// pairs (cpu/bf16_products.hpp): the packers and the product against their definitions, whole
// problems against the float64 reference over every switch, mask and tile edge, with each
// tensor's error next to the exact mode's; everywhere else the setting must compute exactly as
// Products::exact, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <dcmha/dcmha.hpp>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"

namespace {

using dcmha::index_t;
using dcmha::Products;
using dcmha::test::Layout;
using dcmha::test::ProblemSpec;
using dcmha::test::round_to;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;

bool have_bf16_products() { return dcmha::storage_type_products_available<dcmha::bf16>(); }

#define SKIP_WITHOUT_BF16_PRODUCTS()                                                    \
  if (!have_bf16_products())                                                            \
  GTEST_SKIP() << "this CPU has no AVX512_BF16 (or the products are not compiled in): " \
                  "Products::storage_type computes as exact here, checked by "          \
                  "StorageTypeProducts.ExactWhereNotAvailable"

#ifdef DCMHA_HAS_BF16_PRODUCTS
uint16_t bf16_bits(float x) { return Eigen::numext::bit_cast<uint16_t>(dcmha::bf16(x)); }
double bf16_value(uint16_t bits) { return double(Eigen::numext::bit_cast<dcmha::bf16>(bits)); }
uint32_t word(uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

// Every packer word by word against its definition, and the product against a float64 sum over
// the same bf16 values, over sizes around the 16-word blocks and the 6 x 64 register tiles.
TEST(Bf16Products, PackersAndProductMatchTheirDefinitions) {
  SKIP_WITHOUT_BF16_PRODUCTS();
  using namespace dcmha::cpu;
  dcmha::test::Rng rng(5);
  auto normal = [&] {
    return float(std::sqrt(-2 * std::log(1 - rng.uniform())) *
                 std::cos(6.283185307179586 * rng.uniform()));
  };
  for (index_t rows : {1, 2, 6, 7, 17, 33})
    for (index_t n : {1, 15, 16, 17, 63, 64, 65, 130})
      for (index_t depth : {1, 2, 31, 32, 33, 70}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " n " + std::to_string(n) + " depth " +
                     std::to_string(depth));
        const index_t pairs = pair_count(depth), lds = depth + 3;  // rows with a gap
        std::vector<float> a(rows * lds);
        std::vector<uint16_t> b_rows(n * lds), b_depth(depth * (n + 5));
        for (float& x : a) x = normal();
        for (uint16_t& x : b_rows) x = bf16_bits(normal());
        for (uint16_t& x : b_depth) x = bf16_bits(normal());
        // A: float rows rounded to pairs; the bf16 rows of A as they are.
        std::vector<uint32_t> a_pairs(rows * pairs), a_same(rows * pairs);
        pairs_of_float_rows(rows, depth, a.data(), lds, a_pairs.data(), pairs);
        std::vector<uint16_t> a_bits(rows * lds);
        for (size_t i = 0; i < a.size(); ++i) a_bits[i] = bf16_bits(a[i]);
        pairs_of_rows(rows, depth, a_bits.data(), lds, a_same.data(), pairs);
        for (index_t i = 0; i < rows; ++i)
          for (index_t kp = 0; kp < pairs; ++kp) {
            const uint16_t lo = a_bits[i * lds + 2 * kp];
            const uint16_t hi = 2 * kp + 1 < depth ? a_bits[i * lds + 2 * kp + 1] : 0;
            ASSERT_EQ(a_pairs[i * pairs + kp], word(lo, hi)) << "pairs_of_float_rows " << i;
            ASSERT_EQ(a_same[i * pairs + kp], word(lo, hi)) << "pairs_of_rows " << i;
          }
        // A^T: columns of a (rows x n floats, here `depth` rows of n), pairs along the rows.
        std::vector<float> cols(depth * (n + 2));
        for (float& x : cols) x = normal();
        std::vector<uint32_t> at(n * pairs);
        pairs_of_float_columns(depth, n, cols.data(), n + 2, at.data(), pairs);
        for (index_t j = 0; j < n; ++j)
          for (index_t kp = 0; kp < pairs; ++kp) {
            const uint16_t lo = bf16_bits(cols[2 * kp * (n + 2) + j]);
            const uint16_t hi =
                2 * kp + 1 < depth ? bf16_bits(cols[(2 * kp + 1) * (n + 2) + j]) : 0;
            ASSERT_EQ(at[j * pairs + kp], word(lo, hi)) << "pairs_of_float_columns " << j;
          }
        // B of A B^T (n rows of depth values, transposed) and of A B (depth rows of n values).
        std::vector<uint32_t> bt(pairs * n), bi(pairs * n);
        pairs_transposed(n, depth, b_rows.data(), lds, bt.data(), n);
        pairs_interleaved(depth, n, b_depth.data(), n + 5, bi.data(), n);
        for (index_t kp = 0; kp < pairs; ++kp)
          for (index_t j = 0; j < n; ++j) {
            const bool odd = 2 * kp + 1 >= depth;
            ASSERT_EQ(bt[kp * n + j],
                      word(b_rows[j * lds + 2 * kp], odd ? 0 : b_rows[j * lds + 2 * kp + 1]))
                << "pairs_transposed " << kp << " " << j;
            ASSERT_EQ(bi[kp * n + j], word(b_depth[2 * kp * (n + 5) + j],
                                           odd ? 0 : b_depth[(2 * kp + 1) * (n + 5) + j]))
                << "pairs_interleaved " << kp << " " << j;
          }
        // C = 0.5 A B + C: float accumulation of exact bf16 products.
        const index_t ldc = n + 1;
        std::vector<float> c(rows * ldc, 3.0f);
        PairProduct p;
        p.rows = rows;
        p.cols = n;
        p.pairs = pairs;
        p.a = a_pairs.data();
        p.lda = pairs;
        p.b = bi.data();
        p.ldb = n;
        p.c = c.data();
        p.ldc = ldc;
        p.alpha = 0.5f;
        p.accumulate = true;
        pair_product(p);
        double worst = 0;
        for (index_t i = 0; i < rows; ++i) {
          for (index_t j = 0; j < n; ++j) {
            double sum = 0, magnitude = 0;
            for (index_t k = 0; k < depth; ++k) {
              const double t =
                  bf16_value(a_bits[i * lds + k]) * bf16_value(b_depth[k * (n + 5) + j]);
              sum += t;
              magnitude += std::abs(t);
            }
            // float accumulation: a few ulps of the sum of magnitudes
            worst = std::max(worst, std::abs(3 + 0.5 * sum - c[i * ldc + j]) / (3 + magnitude));
          }
          ASSERT_EQ(c[i * ldc + n], 3.0f) << "column past the end written";
        }
        EXPECT_LE(worst, 64 * 0x1p-24);
      }
}
#endif

/// Every output of forward + backward in storage type T with `products`, as doubles.
template <class T>
std::vector<double> run_all(const dcmha::reference::Problem& p, const std::vector<double>& dout,
                            int threads, Products products) {
  TypedProblem<T> tp(p, Layout::bthd);
  tp.num_threads = threads;
  tp.products = products;
  tp.set_dout(dout);
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                  tp.dv(), tp.compose(), tp.dcompose());
  return dcmha::test::with_gradients(tp.out_values(), tp.gradients());
}

ProblemSpec official_spec(int64_t T, int64_t D) {
  ProblemSpec s;
  s.B = 1;
  s.H = 8;
  s.Hk = 8;
  s.T = T;
  s.S = T;
  s.D = D;
  s.Dv = D;
  s.G = 1;
  s.causal = true;
  s.pre = s.post = SideSpec::dynamic();
  return s;
}

template <class T>
void check_exact_where_not_available(const ProblemSpec& s, uint64_t seed) {
  SCOPED_TRACE(s.str());
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<T>(dcmha::test::random_problem(s, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = round_to<T>(x);
  const std::vector<double> exact = run_all<T>(p, dout, 2, Products::exact);
  const std::vector<double> storage = run_all<T>(p, dout, 2, Products::storage_type);
  ASSERT_EQ(exact.size(), storage.size());
  EXPECT_EQ(std::memcmp(exact.data(), storage.data(), exact.size() * sizeof(double)), 0);
}

// float, double and fp16 (no fp16 dot products on the CPU) take the exact products whatever the
// setting; bf16 too where the CPU lacks AVX512_BF16.
TEST(StorageTypeProducts, ExactWhereNotAvailable) {
  EXPECT_FALSE(dcmha::storage_type_products_available<float>());
  EXPECT_FALSE(dcmha::storage_type_products_available<double>());
  EXPECT_FALSE(dcmha::storage_type_products_available<dcmha::half>());
  check_exact_where_not_available<float>(official_spec(40, 16), 1);
  check_exact_where_not_available<double>(official_spec(40, 16), 2);
  check_exact_where_not_available<dcmha::half>(official_spec(40, 16), 3);
  if (have_bf16_products())
    std::printf("bf16: AVX512_BF16 present, Products::storage_type is checked by Bf16Products\n");
  else
    check_exact_where_not_available<dcmha::bf16>(official_spec(40, 16), 4);
}

/// Per tensor (out, then each gradient): the largest error relative to the tensor's largest
/// magnitude, for each product mode, against the float64 reference on bf16-valued inputs.
struct ModeErrors {
  std::vector<std::string> names;
  std::vector<double> exact, storage;
};

ModeErrors bf16_mode_errors(const ProblemSpec& s, uint64_t seed, int threads) {
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<dcmha::bf16>(dcmha::test::random_problem(s, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = round_to<dcmha::bf16>(x);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(p, dout);
  ModeErrors e;
  for (const Products mode : {Products::exact, Products::storage_type}) {
    TypedProblem<dcmha::bf16> tp(p, Layout::bthd);
    tp.num_threads = threads;
    tp.products = mode;
    tp.set_dout(dout);
    dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                    tp.dv(), tp.compose(), tp.dcompose());
    std::vector<double>& out = mode == Products::exact ? e.exact : e.storage;
    out.push_back(dcmha::test::max_rel_error(expected_out, tp.out_values()));
    if (mode == Products::exact) e.names.push_back("out");
    for (const auto& g : dcmha::test::gradient_errors(expected, tp.gradients())) {
      out.push_back(g.rel);
      if (mode == Products::exact) e.names.push_back(g.name);
    }
  }
  return e;
}

/// The storage-type products within `tolerance` of the reference on every tensor. A wrong lane,
/// pair or stride in a packer gives errors of order one; P' and dS rounded to bf16 (8 bits)
/// give a few 2^-9.
void check_bf16_storage_products(const ProblemSpec& s, uint64_t seed, int threads,
                                 double tolerance) {
  SCOPED_TRACE(s.str() + " threads=" + std::to_string(threads));
  const ModeErrors e = bf16_mode_errors(s, seed, threads);
  for (size_t i = 0; i < e.names.size(); ++i)
    EXPECT_LE(e.storage[i], tolerance) << e.names[i] << " (exact products: " << e.exact[i] << ")";
}

TEST(Bf16Products, RandomProblemsAgainstTheReference) {
  SKIP_WITHOUT_BF16_PRODUCTS();
  dcmha::test::Rng rng(31);
  auto pick = [&](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + int64_t(rng.uniform() * xs.size()));
  };
  for (int i = 0; i < 40; ++i) {
    ProblemSpec s;
    s.B = pick({1, 2});
    s.H = pick({2, 4, 6});
    s.Hk = pick({1, 2}) == 1 ? s.H : s.H / 2;
    s.G = s.H % 4 == 0 ? pick({1, 2}) : 1;
    s.T = pick({1, 2, 7, 16, 33, 40});
    s.S = rng.uniform() < 0.5 ? s.T : pick({1, 15, 17, 33, 65});
    s.D = pick({1, 7, 16, 33, 40});
    s.Dv = rng.uniform() < 0.5 ? s.D : pick({2, 5, 17});
    s.causal = rng.uniform() < 0.6;
    s.window = rng.uniform() < 0.25 ? pick({1, 3, 8}) : 0;
    const unsigned pre = unsigned(rng.uniform() * 8), post = unsigned(rng.uniform() * 8);
    s.pre = {bool(pre & 1), bool(pre & 2), bool(pre & 4)};
    s.post = {bool(post & 1), bool(post & 2), bool(post & 4)};
    check_bf16_storage_products(s, 500 + uint64_t(i), 1 + i % 2, 3e-2);
  }
}

TEST(Bf16Products, TileEdgesAgainstTheReference) {
  SKIP_WITHOUT_BF16_PRODUCTS();
  // Query blocks of 64 and 128 rows +-1, key tiles, decode-sized blocks (T < 8), two threads
  // sharing keys, one long causal sequence whose blocks are taken by whole threads.
  for (int64_t T : {1, 3, 65, 129}) {
    ProblemSpec s = official_spec(T, 24);
    s.H = s.Hk = 4;
    s.S = std::max<int64_t>(T, 97);
    s.Dv = 17;
    s.causal = T % 2 == 1;
    for (int threads : {1, 2}) check_bf16_storage_products(s, uint64_t(T), threads, 3e-2);
  }
  ProblemSpec wide = official_spec(1025, 32);
  wide.H = wide.Hk = 4;
  check_bf16_storage_products(wide, 6, 2, 3e-2);
}

// The official configuration's errors by tensor for both modes, printed for docs/performance.md:
// storage-type products may not be more than a few times less accurate than exact ones.
TEST(Bf16Products, ErrorsByTensorBesideExactProducts) {
  SKIP_WITHOUT_BF16_PRODUCTS();
  const ModeErrors e = bf16_mode_errors(official_spec(256, 64), 11, 2);
  std::printf("bf16, H8 T256 D64 causal, pre and post q/k terms: max error / max |reference|\n");
  std::printf("%-14s %12s %12s\n", "tensor", "exact", "storage_type");
  for (size_t i = 0; i < e.names.size(); ++i) {
    std::printf("%-14s %12.3e %12.3e\n", e.names[i].c_str(), e.exact[i], e.storage[i]);
    EXPECT_LE(e.storage[i], std::max(8 * e.exact[i], 4e-3)) << e.names[i];
  }
}

}  // namespace

namespace {

TEST(StorageTypeProducts, AnUnknownSettingIsRefusedByName) {
  const dcmha::reference::Problem p = dcmha::test::storage_problem<dcmha::bf16>(
      dcmha::test::random_problem(official_spec(8, 8), 1));
  TypedProblem<dcmha::bf16> tp(p, Layout::bthd);
  tp.products = static_cast<Products>(7);
  try {
    dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    FAIL() << "no error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.products: expected Products::exact or "
                                         "Products::storage_type, got 7"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
