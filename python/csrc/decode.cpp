// The decode cache as a TorchScript custom class (torch.classes.dcmha.DecodeCache): a layer's
// keys, values and key-wise compose terms held by the operator side, appended to step by step
// (prefill: many tokens; decode: one), each step's queries run against everything kept.
// float32, float64, and bfloat16 / float16 caches (K, V and key-wise terms in that type).
//
//   cache = torch.classes.dcmha.DecodeCache(B, H, Hk, D, Dv, G, Rk, pre_key_wise,
//                                           post_key_wise, capacity, window, max_step, dtype)
//   cache.append(k_new, v_new, key_side, counts)    k_new, v_new (B, Hk, n, D|Dv)
//   out = cache.decode(q_new, query_side, scale)     q_new (B, H, n, D) -> (B, H, n, Dv)
//
// key_side and query_side are compose entry lists as the attention op takes them (14 optional
// tensors or none): key_side only kw1, kw2, kdd (of the new tokens), query_side only sw, qw1,
// qw2, qdd. counts: optional int64 (B) for a right-padded step.
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <dcmha/decode/decode.hpp>

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <variant>

#include "call_impl.hpp"

namespace dcmha_torch {

namespace {

/// The storage type of a held cache (unevaluated: for decltype).
template <class T>
T scalar_of(const std::unique_ptr<dcmha::DecodeCache<T>>&);

class DecodeCacheHolder : public torch::CustomClassHolder {
 public:
  DecodeCacheHolder(int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t Dv, int64_t G, int64_t Rk,
                    bool pre_key_wise, bool post_key_wise, int64_t capacity, int64_t window,
                    int64_t max_step, const std::string& dtype) {
    const char* fn = "dcmha.DecodeCache";
    dcmha::DecodeCacheConfig c;
    c.B = B, c.H = H, c.Hk = Hk, c.D = D, c.Dv = Dv, c.G = G, c.Rk = Rk;
    c.pre_key_wise = pre_key_wise, c.post_key_wise = post_key_wise;
    c.capacity = capacity, c.window = window, c.max_step = max_step;
    const std::pair<const char*, at::ScalarType> dtypes[] = {{"float32", at::kFloat},
                                                             {"float64", at::kDouble},
                                                             {"bfloat16", at::kBFloat16},
                                                             {"float16", at::kHalf}};
    const auto* it = std::find_if(std::begin(dtypes), std::end(dtypes),
                                  [&](const auto& d) { return dtype == d.first; });
    TORCH_CHECK(it != std::end(dtypes), fn,
                ": dtype: expected \"float32\", \"float64\", \"bfloat16\" or \"float16\", got \"",
                dtype, "\"");
    dtype_ = it->second;
    translating_errors([&] {
      switch (dtype_) {
        case at::kFloat:
          cache_ = std::make_unique<dcmha::DecodeCache<float>>(c);
          break;
        case at::kDouble:
          cache_ = std::make_unique<dcmha::DecodeCache<double>>(c);
          break;
        case at::kBFloat16:
          cache_ = std::make_unique<dcmha::DecodeCache<dcmha::bf16>>(c);
          break;
        default:
          cache_ = std::make_unique<dcmha::DecodeCache<dcmha::half>>(c);
      }
    });
  }

  void append(const at::Tensor& k_new, const at::Tensor& v_new, const OptionalTensorList& key_side,
              const c10::optional<at::Tensor>& counts) {
    const char* fn = "dcmha.DecodeCache.append";
    check_dtype(fn, "k_new", k_new);
    check_dtype(fn, "v_new", v_new);
    const ComposeEntries entries = entries_of(fn, "key_side", key_side);
    check_entries(fn, "key_side", entries);
    if (counts) check_lengths(fn, "counts", *counts);
    std::visit(
        [&](auto& cache) {
          using T = decltype(scalar_of(cache));
          translating_errors([&] {
            cache->append(view_of<const T, 4>(k_new), view_of<const T, 4>(v_new),
                          compose_weights<T>(entries),
                          counts ? view_of<const dcmha::index_t, 1>(*counts)
                                 : dcmha::TensorView<const dcmha::index_t, 1>{});
          });
        },
        cache_);
  }

  at::Tensor decode(const at::Tensor& q_new, const OptionalTensorList& query_side, double scale) {
    const char* fn = "dcmha.DecodeCache.decode";
    check_dtype(fn, "q_new", q_new);
    TORCH_CHECK(q_new.dim() == 4, fn, ": q_new: expected 4 dims (B, H, n, D), got ", q_new.dim());
    TORCH_CHECK(scale >= 0.0, fn, ": scale: expected > 0 (0 for 1/sqrt(D)), got ", scale);
    const ComposeEntries entries = entries_of(fn, "query_side", query_side);
    check_entries(fn, "query_side", entries);
    at::Tensor out;
    std::visit(
        [&](auto& cache) {
          using T = decltype(scalar_of(cache));
          const dcmha::DecodeCacheConfig& c = cache->config();
          out = at::empty({q_new.size(0), q_new.size(1), q_new.size(2), c.Dv}, q_new.options());
          dcmha::AttentionConfig cfg;
          cfg.scale = scale;
          cfg.window = c.window;
          cfg.num_threads = at::get_num_threads();
          translating_errors([&] {
            dcmha::decode(cfg, view_of<const T, 4>(q_new), *cache, compose_weights<T>(entries),
                          view_of<T, 4>(out), detail::thread_workspace());
          });
        },
        cache_);
    return out;
  }

  void reset() {
    std::visit([](auto& cache) { cache->reset(); }, cache_);
  }
  int64_t length(int64_t b) const {
    check_sequence(b);
    return std::visit([&](const auto& cache) { return int64_t(cache->length(b)); }, cache_);
  }
  int64_t kept(int64_t b) const {
    check_sequence(b);
    return std::visit([&](const auto& cache) { return int64_t(cache->kept(b)); }, cache_);
  }
  int64_t capacity() const {
    return std::visit([](const auto& cache) { return int64_t(cache->capacity()); }, cache_);
  }

 private:
  void check_dtype(const char* fn, const char* name, const at::Tensor& t) const {
    TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " is on ", t.device(),
                "; this build of dcmha_torch has CPU kernels only");
    TORCH_CHECK(t.scalar_type() == dtype_, fn, ": ", name, " has dtype ", t.scalar_type(),
                ", expected the cache's ", dtype_);
  }
  void check_entries(const char* fn, const char* side, const ComposeEntries& e) const {
    for (int i = 0; i < kComposeEntries; ++i) {
      if (!e[i].defined()) continue;
      check_dtype(fn, side, e[i]);
      TORCH_CHECK(e[i].dim() == dcmha_rank(i) || e[i].dim() == dcmha_rank(i) - 1, fn, ": ", side,
                  " ", i < kSideEntries ? "pre " : "post ", entry_name(i), ": expected ",
                  dcmha_rank(i) - 1, " or ", dcmha_rank(i), " dims, got ", e[i].dim());
    }
  }
  void check_sequence(int64_t b) const {
    const int64_t B = std::visit([](const auto& cache) { return int64_t(cache->batch()); }, cache_);
    TORCH_CHECK(b >= 0 && b < B, "dcmha.DecodeCache: sequence ", b, ": expected 0 <= b < ", B);
  }

  std::variant<std::unique_ptr<dcmha::DecodeCache<float>>,
               std::unique_ptr<dcmha::DecodeCache<double>>,
               std::unique_ptr<dcmha::DecodeCache<dcmha::bf16>>,
               std::unique_ptr<dcmha::DecodeCache<dcmha::half>>>
      cache_;
  at::ScalarType dtype_ = at::kFloat;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(dcmha, m) {
  m.class_<DecodeCacheHolder>("DecodeCache")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool,
                       int64_t, int64_t, int64_t, std::string>())
      .def("append", &DecodeCacheHolder::append)
      .def("decode", &DecodeCacheHolder::decode)
      .def("reset", &DecodeCacheHolder::reset)
      .def("length", &DecodeCacheHolder::length)
      .def("kept", &DecodeCacheHolder::kept)
      .def("capacity", &DecodeCacheHolder::capacity);
}

}  // namespace dcmha_torch
