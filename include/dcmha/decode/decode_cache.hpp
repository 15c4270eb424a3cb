#pragma once
// DecodeCache: what one attention layer keeps between decode steps (spec section 3).
//
// Per sequence b of a batch of B: K (B, Hk, cap, D), V (B, Hk, cap, Dv) and, for each compose
// side whose key-wise terms are on, the key-wise compose state of every cached key:
// kw1, kw2 (B, cap, G, Rk, M) and kdd (B, cap, G, M), stored slot-fastest ([b][g][r][m][slot], the
// compose kernels' layout; the accessors return strided views). Key-wise terms depend only on the
// key position, so they are computed once, when the token is appended, and never again.
//
// The state is kept in the low-rank form rather than as the merged M x M matrices
// kw1^T kw2 + diag(kdd) the spec also allows: at DCFormer-6.9B's H32/D128/G1/R2/M32 the two sides
// cost 2 * (2R + 1) * M = 320 values per token, about 4% of K + V (2 * H * D = 8192), where merged
// matrices would cost 2 * M * M = 2048 (25%). The kernel applies the low-rank form directly.
//
// Global layers (window == 0) keep every token: `capacity` is the most tokens a sequence may
// ever hold, and appending past it is an Error (nothing is silently dropped). Local layers
// (window W > 0) keep a ring of W + max_step - 1 slots: enough that the first of max_step new
// tokens still sees its W - 1 predecessors, so the ring is never full. Token i of sequence b lives
// in slot i % cap in both cases.
//
// T: float, double, or bf16 / fp16 storage: the cache then holds K, V and the key-wise state in
// that type (half the bytes a decode step reads), and decode computes as the forward does on
// narrow storage (float arithmetic on the widened values, each output rounded once).
#include <algorithm>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "../compose_weights.hpp"
#include "../detail/checks.hpp"
#include "../error.hpp"
#include "../tensor.hpp"

namespace dcmha {

/// Plain data describing one layer's cache. Every field is checked by DecodeCache.
struct DecodeCacheConfig {
  index_t B = 1;   ///< sequences
  index_t H = 1;   ///< query heads (decode's q_new.shape[1]); needed for M = H / G
  index_t Hk = 1;  ///< key/value heads, a divisor of H
  index_t D = 1, Dv = 1;
  index_t G = 1;  ///< compose groups, a divisor of H
  /// Rank of the cached key-wise low-rank terms, shared by pre and post. Must be >= 1 when
  /// pre_key_wise or post_key_wise is on and 0 when both are off (a rank for state that is not
  /// kept would be ignored, which hides a forgotten switch).
  index_t Rk = 0;
  bool pre_key_wise = false, post_key_wise = false;
  /// Global layers: the most tokens one sequence may hold (>= 1). Local layers: must be 0, the
  /// ring size W + max_step - 1 is derived.
  index_t capacity = 0;
  /// 0: global layer; W > 0: sliding window of W keys (cfg.window of the layer)
  index_t window = 0;
  index_t max_step = 1;  ///< most tokens one append() may add per sequence (>= 1)
};

namespace detail {

inline void validate_cache_config(const char* fn, const DecodeCacheConfig& c) {
  const std::pair<const char*, index_t> positive[] = {{"B", c.B},
                                                      {"H", c.H},
                                                      {"Hk", c.Hk},
                                                      {"D", c.D},
                                                      {"Dv", c.Dv},
                                                      {"G", c.G},
                                                      {"max_step", c.max_step}};
  for (const auto& [name, value] : positive)
    if (value < 1) fail(fn, ": config.", name, ": expected >= 1, got ", value);
  if (c.H % c.Hk != 0)
    fail(fn, ": config.Hk: expected a divisor of H = ", c.H, " (config.H), got ", c.Hk);
  if (c.H % c.G != 0)
    fail(fn, ": config.G: expected a divisor of H = ", c.H, " (config.H), got ", c.G);
  const bool key_wise = c.pre_key_wise || c.post_key_wise;
  if (key_wise && c.Rk < 1)
    fail(fn,
         ": config.Rk: expected >= 1 because config.pre_key_wise or config.post_key_wise is on, "
         "got ",
         c.Rk);
  if (!key_wise && c.Rk != 0)
    fail(fn,
         ": config.Rk: expected 0 because config.pre_key_wise and config.post_key_wise are off, "
         "got ",
         c.Rk);
  if (c.window < 0) fail(fn, ": config.window: expected >= 0 (0 = global layer), got ", c.window);
  if (c.window == 0 && c.capacity < 1)
    fail(fn, ": config.capacity: expected >= 1 (max tokens per sequence of a global layer), got ",
         c.capacity);
  if (c.window > 0 && c.capacity != 0)
    fail(fn, ": config.capacity: expected 0 for a local layer (window ", c.window,
         "; its ring of window + max_step - 1 slots is derived), got ", c.capacity);
}

inline index_t cache_slots(const DecodeCacheConfig& c) {
  return c.window > 0 ? c.window + c.max_step - 1 : c.capacity;
}

}  // namespace detail

template <class T>
class DecodeCache {
 public:
  /// Elements of T a caller-provided buffer needs for this configuration (validates it).
  static index_t required_elements(const DecodeCacheConfig& c) {
    const char* fn = "dcmha::DecodeCache::required_elements";
    detail::validate_cache_config(fn, c);
    return layout(c, fn).total;
  }

  /// Library-owned memory (zero-initialized); dcmha::AllocationError if it cannot be allocated.
  explicit DecodeCache(const DecodeCacheConfig& c)
      : cfg_(checked(c)), lay_(layout(cfg_, "dcmha::DecodeCache")) {
    detail::with_allocation_errors(
        "dcmha::DecodeCache", [&] { owned_.assign(static_cast<std::size_t>(lay_.total), T(0)); });
    data_ = owned_.data();
    reset();
  }

  /// Caller-provided memory of at least required_elements(c) elements, used as-is (not cleared)
  /// and not owned: it must outlive the cache.
  DecodeCache(const DecodeCacheConfig& c, T* buffer, index_t buffer_elements)
      : cfg_(checked(c)), lay_(layout(cfg_, "dcmha::DecodeCache")), data_(buffer) {
    if (buffer == nullptr)
      detail::fail("dcmha::DecodeCache: buffer: expected memory for ", lay_.total,
                   " elements (required_elements(config)), got nullptr");
    if (buffer_elements < lay_.total)
      detail::fail("dcmha::DecodeCache: buffer_elements: expected >= ", lay_.total,
                   " (required_elements(config)), got ", buffer_elements);
    reset();
  }

  // The views point into the storage; a copy would alias the original's buffer.
  DecodeCache(const DecodeCache&) = delete;
  DecodeCache& operator=(const DecodeCache&) = delete;
  // std::vector's move keeps the heap buffer, so data_ stays valid.
  DecodeCache(DecodeCache&&) = default;
  DecodeCache& operator=(DecodeCache&&) = default;

  const DecodeCacheConfig& config() const { return cfg_; }
  index_t batch() const { return cfg_.B; }
  /// Slots per sequence: config.capacity (global) or window + max_step - 1 (local).
  index_t capacity() const { return lay_.cap; }
  bool local() const { return cfg_.window > 0; }

  /// Tokens appended to sequence b since the last reset() (including those a local layer has
  /// already overwritten).
  index_t length(index_t b) const {
    check_b(b);
    return length_[static_cast<std::size_t>(b)];
  }
  /// Keys of sequence b still held: length(b), or at most capacity() for a local layer.
  index_t kept(index_t b) const {
    check_b(b);
    return std::min(length_[static_cast<std::size_t>(b)], lay_.cap);
  }
  /// n of the last append() (0: none since reset()) and its per-sequence counts.
  index_t last_step() const { return last_n_; }
  index_t last_count(index_t b) const {
    check_b(b);
    return last_count_[static_cast<std::size_t>(b)];
  }

  /// Forgets every token of every sequence; memory is kept (and not cleared: a slot is always
  /// written by append() before decode can reach it).
  void reset() {
    length_.assign(static_cast<std::size_t>(cfg_.B), 0);
    last_count_.assign(static_cast<std::size_t>(cfg_.B), 0);
    last_n_ = 0;
  }

  /// Appends n new tokens per sequence; call it before decode() of the same tokens.
  ///   k_new (B, Hk, n, D), v_new (B, Hk, n, Dv), 1 <= n <= config.max_step.
  ///   key_side: the new tokens' key-wise compose terms, kw1/kw2 (B, n, G, Rk, M) and kdd
  ///     (B, n, G, M), with pre.key_wise / post.key_wise exactly config.pre_key_wise /
  ///     config.post_key_wise; static and query-wise terms belong to decode()'s query_side and
  ///     must be off here.
  ///   counts: optional (B,) values in [0, n]; sequence b appends only its first counts[b]
  ///     tokens (a right-padded batch). Empty: n for every sequence.
  /// Checks everything before writing anything: a rejected call leaves the cache unchanged.
  void append(TensorView<const T, 4> k_new, TensorView<const T, 4> v_new,
              const ComposeWeights<T>& key_side = {}, TensorView<const index_t, 1> counts = {}) {
    append_rows("dcmha::DecodeCache::append", k_new, v_new, key_side, counts,
                [&](index_t n, const index_t* lengths, const index_t* step_counts) {
                  (void)n;
                  for (index_t b = 0; b < cfg_.B; ++b)
                    for (index_t i = 0; i < step_counts[b]; ++i)
                      store_token(k_new, v_new, key_side, b, i, (lengths[b] + i) % lay_.cap);
                });
  }

  /// append() with the copy left to the caller (a backend whose slots live elsewhere, e.g. on a
  /// GPU): validates exactly as append(), calls copy_rows(n, lengths, counts), where token i <
  /// counts[b] of sequence b belongs in slot (lengths[b] + i) % capacity(), then records the
  /// tokens. Nothing is recorded when the checks or copy_rows throw.
  template <class CopyRows>
  void append_rows(const char* fn, TensorView<const T, 4> k_new, TensorView<const T, 4> v_new,
                   const ComposeWeights<T>& key_side, TensorView<const index_t, 1> counts,
                   CopyRows&& copy_rows) {
    index_t n = 0;
    std::vector<index_t> step_counts;
    detail::with_allocation_errors(fn, [&] {  // validation allocates (names in messages)
      n = validate_append(fn, k_new, v_new, key_side, counts);
      step_counts.resize(static_cast<std::size_t>(cfg_.B));
    });
    for (index_t b = 0; b < cfg_.B; ++b)
      step_counts[static_cast<std::size_t>(b)] = counts.empty() ? n : counts(b);
    copy_rows(n, static_cast<const index_t*>(length_.data()),
              static_cast<const index_t*>(step_counts.data()));
    for (index_t b = 0; b < cfg_.B; ++b) {
      length_[static_cast<std::size_t>(b)] += step_counts[static_cast<std::size_t>(b)];
      last_count_[static_cast<std::size_t>(b)] = step_counts[static_cast<std::size_t>(b)];
    }
    last_n_ = n;
  }

  /// Views of the stored state, slot-indexed (not logical positions); mainly for decode() and
  /// for tests. kw1/kw2/kdd are empty views for a side whose key-wise terms are off.
  TensorView<T, 4> k_slots() const {
    return view<4>(data_ + lay_.k, {cfg_.B, cfg_.Hk, lay_.cap, cfg_.D});
  }
  TensorView<T, 4> v_slots() const {
    return view<4>(data_ + lay_.v, {cfg_.B, cfg_.Hk, lay_.cap, cfg_.Dv});
  }
  TensorView<T, 5> kw1_slots(bool post) const { return lowrank(post, 0); }
  TensorView<T, 5> kw2_slots(bool post) const { return lowrank(post, 1); }
  TensorView<T, 4> kdd_slots(bool post) const {
    const SideLayout& s = lay_.side[post ? 1 : 0];
    if (!s.on) return {};
    const index_t G = cfg_.G, M = cfg_.H / G, cap = lay_.cap;
    return view<4>(data_ + s.kdd, {cfg_.B, cap, G, M}, {G * M * cap, 1, M * cap, cap});
  }

 private:
  struct SideLayout {
    bool on = false;
    index_t kw1 = 0, kw2 = 0, kdd = 0;  // element offsets
  };
  struct Layout {
    index_t cap = 0, k = 0, v = 0, total = 0;
    SideLayout side[2];
  };

  static Layout layout(const DecodeCacheConfig& c, const char* fn) {
    // A capacity read from a model file can be absurd; wrapping around would under-allocate.
    constexpr index_t lim = std::numeric_limits<index_t>::max();
    auto overflow = [fn] {
      detail::fail(fn,
                   ": config: expected a cache of at most 2^63 - 1 elements, got an "
                   "element count that overflows");
    };
    auto mul = [&](std::initializer_list<index_t> xs) {
      index_t p = 1;
      for (index_t x : xs) {
        if (x != 0 && p > lim / x) overflow();
        p *= x;
      }
      return p;
    };
    Layout l;
    l.cap = detail::cache_slots(c);
    const index_t M = c.H / c.G;
    const index_t parts[] = {mul({c.B, c.Hk, l.cap, c.D}), mul({c.B, c.Hk, l.cap, c.Dv}),
                             mul({c.B, l.cap, c.G, c.Rk, M}), mul({c.B, l.cap, c.G, M})};
    index_t off = 0;
    auto take = [&](index_t n) {
      const index_t at = off;
      if (off > lim - n) overflow();
      off += n;
      return at;
    };
    l.k = take(parts[0]);
    l.v = take(parts[1]);
    const bool on[2] = {c.pre_key_wise, c.post_key_wise};
    for (int s = 0; s < 2; ++s) {
      l.side[s].on = on[s];
      if (!on[s]) continue;
      l.side[s].kw1 = take(parts[2]);
      l.side[s].kw2 = take(parts[2]);
      l.side[s].kdd = take(parts[3]);
    }
    l.total = off;
    return l;
  }

  // Runs before the other members are initialized, so a bad config never allocates.
  static const DecodeCacheConfig& checked(const DecodeCacheConfig& c) {
    detail::validate_cache_config("dcmha::DecodeCache", c);
    return c;
  }

  void check_b(index_t b) const {
    if (b < 0 || b >= cfg_.B)
      detail::fail("dcmha::DecodeCache: b: expected a sequence index in [0, ", cfg_.B, "), got ",
                   b);
  }

  TensorView<T, 5> lowrank(bool post, int which) const {
    const SideLayout& s = lay_.side[post ? 1 : 0];
    if (!s.on) return {};
    const index_t G = cfg_.G, R = cfg_.Rk, M = cfg_.H / G, cap = lay_.cap;
    return view<5>(data_ + (which == 0 ? s.kw1 : s.kw2), {cfg_.B, cap, G, R, M},
                   {G * R * M * cap, 1, R * M * cap, M * cap, cap});
  }

  /// Token i of sequence b into slot p: its K and V rows and key-wise terms.
  void store_token(const TensorView<const T, 4>& k_new, const TensorView<const T, 4>& v_new,
                   const ComposeWeights<T>& key_side, index_t b, index_t i, index_t p) {
    const index_t Hk = cfg_.Hk, D = cfg_.D, Dv = cfg_.Dv, cap = lay_.cap;
    for (index_t h = 0; h < Hk; ++h) {
      copy_row(k_new, b, h, i, D, data_ + lay_.k + ((b * Hk + h) * cap + p) * D);
      copy_row(v_new, b, h, i, Dv, data_ + lay_.v + ((b * Hk + h) * cap + p) * Dv);
    }
    for (int side = 0; side < 2; ++side)
      if (lay_.side[side].on)
        store_key_wise(lay_.side[side], side == 0 ? key_side.pre : key_side.post, b, i, p);
  }

  static void copy_row(const TensorView<const T, 4>& src, index_t b, index_t h, index_t i,
                       index_t len, T* dst) {
    const T* p = src.data + b * src.stride[0] + h * src.stride[1] + i * src.stride[2];
    for (index_t e = 0; e < len; ++e) dst[e] = p[e * src.stride[3]];
  }

  void store_key_wise(const SideLayout& s, const ComposeTerms<T>& c, index_t b, index_t i,
                      index_t p) {
    // Kernel layout, [b][g][r][m][slot]: decode reads the keys of one (r, m) as a contiguous run
    // in place (cpu::KernelComposeTerms borrows it) instead of gathering every cached key every
    // step.
    const index_t G = cfg_.G, R = cfg_.Rk, M = cfg_.H / G, cap = lay_.cap;
    T* w1 = data_ + s.kw1 + b * G * R * M * cap + p;
    T* w2 = data_ + s.kw2 + b * G * R * M * cap + p;
    T* dd = data_ + s.kdd + b * G * M * cap + p;
    for (index_t g = 0; g < G; ++g)
      for (index_t m = 0; m < M; ++m) {
        for (index_t r = 0; r < R; ++r) {
          w1[((g * R + r) * M + m) * cap] = c.kw1(b, i, g, r, m);
          w2[((g * R + r) * M + m) * cap] = c.kw2(b, i, g, r, m);
        }
        dd[(g * M + m) * cap] = c.kdd(b, i, g, m);
      }
  }

  // append()'s checks, in order: k_new and v_new (which fix n), key_side, counts, capacity.
  index_t validate_append(const char* fn, const TensorView<const T, 4>& k_new,
                          const TensorView<const T, 4>& v_new, const ComposeWeights<T>& ks,
                          const TensorView<const index_t, 1>& counts) const {
    const index_t n = check_new_kv(fn, k_new, v_new);
    check_key_side(fn, "pre", ks.pre, cfg_.pre_key_wise, n);
    check_key_side(fn, "post", ks.post, cfg_.post_key_wise, n);
    check_counts(fn, counts, n);
    check_capacity(fn, counts, n);
    return n;
  }

  index_t check_new_kv(const char* fn, const TensorView<const T, 4>& k_new,
                       const TensorView<const T, 4>& v_new) const {
    detail::require_given(fn, "k_new", k_new, "(B, Hk, n, D)");
    detail::require_given(fn, "v_new", v_new, "(B, Hk, n, Dv)");
    const index_t n = k_new.shape[2];
    detail::check_positive(fn, "k_new", k_new, 2, "n");
    if (n > cfg_.max_step)
      detail::fail(fn, ": k_new.shape[2] (n): expected <= ", cfg_.max_step,
                   " (config.max_step), got ", n);
    detail::check_shape(fn, "k_new", k_new,
                        {{"B", cfg_.B, "config.B"},
                         {"Hk", cfg_.Hk, "config.Hk"},
                         {"n", n, "n"},
                         {"D", cfg_.D, "config.D"}});
    detail::check_strides(fn, "k_new", k_new);
    detail::check_shape(fn, "v_new", v_new,
                        {{"B", cfg_.B, "config.B"},
                         {"Hk", cfg_.Hk, "config.Hk"},
                         {"n", n, "k_new.shape[2]"},
                         {"Dv", cfg_.Dv, "config.Dv"}});
    detail::check_strides(fn, "v_new", v_new);
    return n;
  }

  // Static and query-wise terms belong to decode()'s query_side; the key-wise ones must match
  // the config's switch of this side.
  void check_key_side(const char* fn, const char* side, const ComposeTerms<T>& c, bool want,
                      index_t n) const {
    const std::string arg = std::string("key_side.") + side;
    if (c.static_w || !c.w.empty())
      detail::fail(
          fn, ": ", arg,
          ".static_w: expected off (the static W is passed to decode's query_side), got on");
    if (c.query_wise || !c.qw1.empty() || !c.qw2.empty() || !c.qdd.empty())
      detail::fail(
          fn, ": ", arg,
          ".query_wise: expected off (query-wise terms are passed to decode's query_side), got on");
    const std::string sw = std::string("config.") + side + "_key_wise";
    if (c.key_wise != want)
      detail::fail(fn, ": ", arg, ".key_wise: expected ", want ? "on" : "off", " (", sw, "), got ",
                   c.key_wise ? "on" : "off");
    if (!want) {
      const std::string why = "key_wise is off (" + sw + " == false)";
      detail::require_absent(fn, arg + ".kw1", c.kw1, why);
      detail::require_absent(fn, arg + ".kw2", c.kw2, why);
      detail::require_absent(fn, arg + ".kdd", c.kdd, why);
      return;
    }
    check_key_wise(fn, arg + ".kw1", c.kw1, sw + " is on", n);
    check_key_wise(fn, arg + ".kw2", c.kw2, sw + " is on", n);
    check_key_wise(fn, arg + ".kdd", c.kdd, sw + " is on", n);
  }

  // kw1, kw2 (B, n, G, Rk, M) or kdd (B, n, G, M) of the new tokens.
  template <class V>
  void check_key_wise(const char* fn, const std::string& name, const V& t, const std::string& why,
                      index_t n) const {
    const index_t M = cfg_.H / cfg_.G;
    if constexpr (V::rank == 5) {
      detail::require_given(fn, name, t, "(B, n, G, Rk, M)", why);
      detail::check_shape(fn, name, t,
                          {{"B", cfg_.B, "config.B"},
                           {"n", n, "k_new.shape[2]"},
                           {"G", cfg_.G, "config.G"},
                           {"R", cfg_.Rk, "config.Rk"},
                           {"M", M, "config.H / config.G"}});
    } else {
      detail::require_given(fn, name, t, "(B, n, G, M)", why);
      detail::check_shape(fn, name, t,
                          {{"B", cfg_.B, "config.B"},
                           {"n", n, "k_new.shape[2]"},
                           {"G", cfg_.G, "config.G"},
                           {"M", M, "config.H / config.G"}});
    }
    detail::check_strides(fn, name, t);
  }

  void check_counts(const char* fn, const TensorView<const index_t, 1>& counts, index_t n) const {
    if (counts.empty()) return;
    detail::check_dim(fn, "counts", counts, 0, "B", cfg_.B, "config.B");
    for (index_t b = 0; b < cfg_.B; ++b)
      if (counts(b) < 0 || counts(b) > n)
        detail::fail(fn, ": counts[", b, "]: expected a count in [0, ", n,
                     "] (k_new.shape[2]), got ", counts(b));
  }

  // A global layer keeps every token: appending past config.capacity would drop some.
  void check_capacity(const char* fn, const TensorView<const index_t, 1>& counts, index_t n) const {
    if (local()) return;
    for (index_t b = 0; b < cfg_.B; ++b) {
      const index_t nb = counts.empty() ? n : counts(b), len = length_[static_cast<std::size_t>(b)];
      if (len + nb > lay_.cap)
        detail::fail(fn, ": sequence ", b, ": expected at most ", lay_.cap,
                     " tokens (config.capacity), got ", len, " cached + ", nb,
                     " appended = ", len + nb);
    }
  }

  DecodeCacheConfig cfg_;
  Layout lay_;
  std::vector<T> owned_;
  T* data_ = nullptr;
  std::vector<index_t> length_, last_count_;
  index_t last_n_ = 0;
};

}  // namespace dcmha
