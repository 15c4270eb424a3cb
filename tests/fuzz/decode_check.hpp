#pragma once
// Decode schedules (decode_run.hpp) and the misuse of DecodeCache and decode: a broken append
// or decode between the valid steps must throw dcmha::Error and leave the cache (its lengths,
// counts and every byte of its memory) and the output as they were; the schedule then goes on,
// so a rejected call that changed the cache anyway also shows in the rows decoded after it.
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "any_view.hpp"
#include "decode_input.hpp"
#include "decode_run.hpp"
#include "report.hpp"

namespace dcmha::fuzz {

enum class DecodeBreak {
  decode_without_append,  // decode on a fresh cache of the same config
  append_past_capacity,   // a global cache: one sequence one token past its capacity
  append_too_many,        // n = max_step + 1
  counts_out_of_range,    // a count < 0 or > n, or B +- 1 of them
  append_shape,           // one dim of k_new, v_new or a key-wise tensor off by one
  key_side_switch,        // key_side's switches not the cache's, or static / query-wise terms in it
  decode_mask_full,       // cfg.mask = Mask::full
  decode_window,          // cfg.window neither 0 nor the cache's
  decode_lengths,         // cfg.query_lengths or key_lengths given
  q_new_shape,            // one dim of q_new off by one (n: not the last append's)
  query_side_key_wise,    // query_side with key-wise terms on
  query_side_group,       // query_side with another G than the cache's
  out_overlaps_cache,     // decode's output inside the cache's memory (or inside q_new)
  append_negative_stride,  // k_new, v_new or a key-wise tensor walked backwards
  out_shape,               // one dim of out off by one, or its head dim strided
  count
};
static_assert(int(DecodeBreak::count) == kDecodeBreakKinds, "decode_input.hpp's count");

template <class T>
class DecodeBreaker {
 public:
  DecodeBreaker(DecodeRun<T>& run, const Break& b) : run_(run), d_(run.spec()), b_(b) {}

  void apply() {
    const auto before = run_.state();
    const DecodeBreak kind = DecodeBreak(b_.kind);
    if (breaks_append(kind))
      broken_append(kind);
    else
      broken_decode(kind);
    if (!(run_.state() == before)) mismatch(what_ + ": the rejected call changed the cache");
  }

 private:
  static bool breaks_append(DecodeBreak k) {
    return k == DecodeBreak::append_past_capacity || k == DecodeBreak::append_too_many ||
           k == DecodeBreak::counts_out_of_range || k == DecodeBreak::append_shape ||
           k == DecodeBreak::key_side_switch || k == DecodeBreak::append_negative_stride;
  }

  // --- append
  // -------------------------------------------------------------------------------------

  void broken_append(DecodeBreak kind) {
    const DecodeCacheConfig& cc = run_.config();
    std::int64_t n = 1 + b_.a % cc.max_step;
    std::vector<std::int64_t> counts(size_t(d_.B), n);
    if (kind == DecodeBreak::append_past_capacity && !past_capacity(n, counts))
      kind = DecodeBreak::append_too_many;
    if (kind == DecodeBreak::append_too_many) n = cc.max_step + 1, counts.assign(size_t(d_.B), n);
    std::unique_ptr<StepTensors<T>> s =
        run_.make_step(n, counts, kind == DecodeBreak::append_past_capacity);
    TensorView<const T, 4> k = s->k.cview(), v = s->v.cview();
    ComposeWeights<T> key_side = s->key_side();
    TensorView<const index_t, 1> cv = s->counts_view();
    std::vector<AnyView> views{any_view("k_new", k, false, "BHnD"),
                               any_view("v_new", v, false, "BHnD")};
    add_key_views(views, key_side);
    switch (kind) {
      case DecodeBreak::append_past_capacity:
        what_ = "one sequence one token past its capacity";
        break;
      case DecodeBreak::append_too_many:
        what_ = "n = max_step + 1 = " + std::to_string(n);
        break;
      case DecodeBreak::append_shape:
        what_ = resize_some(views);
        break;
      case DecodeBreak::key_side_switch:
        what_ = bad_key_side(key_side, views, n);
        break;
      case DecodeBreak::append_negative_stride:
        what_ = reverse_some(views);
        break;
      default:
        break;
    }
    if (what_.empty()) what_ = bad_counts(n, cv);
    const auto moved = arena_.snapshot();
    expect_error("DecodeCache::append with " + what_,
                 [&] { run_.cache().append(k, v, key_side, cv); });
    if (!arena_.same_as(moved)) mismatch(what_ + ": the rejected append wrote to its arguments");
  }

  /// One sequence (the longest) takes one token more than its global cache has room for.
  bool past_capacity(std::int64_t& n, std::vector<std::int64_t>& counts) {
    if (d_.window) return false;
    std::int64_t longest = 0;
    for (std::int64_t b = 1; b < d_.B; ++b)
      if (run_.cache().length(b) > run_.cache().length(longest)) longest = b;
    const std::int64_t over = d_.capacity - run_.cache().length(longest) + 1;
    if (over > d_.max_step) return false;
    n = over;
    counts.assign(size_t(d_.B), 0);
    counts[size_t(longest)] = over;
    return true;
  }

  std::string bad_counts(std::int64_t n, TensorView<const index_t, 1>& cv) {
    index_t* p = arena_.alloc_elems<index_t>(d_.B + 1);
    for (std::int64_t b = 0; b <= d_.B; ++b) p[b] = 0;
    const std::int64_t at = b_.b / 4 % d_.B;
    std::int64_t size = d_.B;
    switch (b_.b % 4) {
      case 0:
        p[at] = n + 1;
        break;
      case 1:
        p[at] = -1;
        break;
      case 2:
        size = d_.B + 1;
        break;
      default:
        if (d_.B > 1)
          size = d_.B - 1;
        else
          p[at] = n + 1;
        break;
    }
    cv = view<1>(static_cast<const index_t*>(p), {size});
    return "counts: " + std::to_string(size) + " values, [" + std::to_string(at) +
           "] = " + std::to_string(p[at]);
  }

  static void add_key_views(std::vector<AnyView>& views, ComposeWeights<T>& ks) {
    for (ComposeTerms<T>* t : {&ks.pre, &ks.post}) {
      const std::string p = t == &ks.pre ? "key_side.pre." : "key_side.post.";
      views.push_back(any_view(p + "kw1", t->kw1, false, "BnGRM"));
      views.push_back(any_view(p + "kw2", t->kw2, false, "BnGRM"));
      views.push_back(any_view(p + "kdd", t->kdd, false, "BnGM"));
    }
  }

  std::string resize_some(std::vector<AnyView>& views) {
    AnyView* v = choose(given(views, false), b_.a);
    return resize_dim(*v, int(b_.b % unsigned(v->rank)));
  }

  std::string reverse_some(std::vector<AnyView>& views) {
    std::vector<AnyView*> c;
    for (AnyView* v : given(views, false))
      if (!v->long_dims().empty()) c.push_back(v);
    AnyView* v = choose(c, b_.a);
    if (!v) return "";
    const std::vector<int> d = v->long_dims();
    return reverse_dim(*v, d[b_.b % d.size()]);
  }

  std::string bad_key_side(ComposeWeights<T>& ks, std::vector<AnyView>& views, std::int64_t n) {
    const bool post = b_.a & 1;
    ComposeTerms<T>& t = post ? ks.post : ks.pre;
    const std::string side = post ? "key_side.post" : "key_side.pre";
    switch (b_.b % 4) {
      case 0:
        t.key_wise = !t.key_wise;
        return side + ".key_wise flipped";
      case 1:
        t.static_w = true;
        return side + ".static_w on";
      case 2:
        t.query_wise = true;
        return side + ".query_wise on";
      default: {
        if (t.key_wise) return resize_some(views);
        // A side the cache keeps no key-wise state for, given a kdd anyway.
        const index_t shape[4] = {d_.B, n, d_.G, d_.H / d_.G};
        AnyView v = any_view(side + ".kdd", t.kdd, false, "BnGM");
        place_dense(v, shape, arena_);
        return side + ".kdd given, key_wise off";
      }
    }
  }

  // --- decode
  // -------------------------------------------------------------------------------------

  void broken_decode(DecodeBreak kind) {
    const StepTensors<T>* last = run_.last();
    const std::int64_t n = last ? last->n : 1;
    Strided<T, 4> q_fresh;
    TensorView<const T, 4> q;
    if (last) {
      q = last->q.cview();
    } else {  // no append since reset: any decode is rejected, this break or not
      q_fresh = Strided<T, 4>({d_.B, d_.H, 1, d_.D}, d_.act[0]);
      q_fresh.set(std::vector<double>(size_t(d_.B * d_.H * d_.D), 0.5));
      q = q_fresh.cview();
    }
    ComposeWeights<T> qs = last ? last->query_side() : ComposeWeights<T>{};
    Strided<T, 4> out_buf = run_.new_out(n);
    TensorView<T, 4> out = out_buf.view();
    AttentionConfig cfg = run_.decode_config();
    what_ = break_decode_args(kind, cfg, q, qs, out, n);
    const auto before = out_buf.bytes();
    const auto moved = arena_.snapshot();
    if (kind == DecodeBreak::decode_without_append) {
      DecodeCache<T> fresh(run_.config());
      expect_error("decode on " + what_, [&] { dcmha::decode(cfg, q, fresh, qs, out); });
    } else {
      expect_error("decode with " + what_, [&] { run_.decode_into(cfg, q, qs, out); });
    }
    if (out_buf.bytes() != before || !arena_.same_as(moved))
      mismatch(what_ + ": the rejected decode wrote its output");
  }

  std::string break_decode_args(DecodeBreak kind, AttentionConfig& cfg, TensorView<const T, 4>& q,
                                ComposeWeights<T>& qs, TensorView<T, 4>& out, std::int64_t n) {
    AnyView qv = any_view("q_new", q, false, "BHnD"), ov = any_view("out", out, true, "BHnD");
    switch (kind) {
      case DecodeBreak::decode_without_append:
        return "a fresh cache (no append)";
      case DecodeBreak::decode_mask_full:
        cfg.mask = Mask::full;
        return "cfg.mask = full";
      case DecodeBreak::decode_window:
        cfg.window = d_.window + 1 + b_.a % 3;
        return "cfg.window = " + std::to_string(cfg.window);
      case DecodeBreak::decode_lengths: {
        index_t* p = arena_.alloc_elems<index_t>(d_.B);
        for (std::int64_t b = 0; b < d_.B; ++b) p[b] = run_.cache().kept(b);
        (b_.a & 1 ? cfg.query_lengths : cfg.key_lengths) =
            view<1>(static_cast<const index_t*>(p), {d_.B});
        return b_.a & 1 ? "cfg.query_lengths given" : "cfg.key_lengths given";
      }
      case DecodeBreak::q_new_shape:
        return resize_dim(qv, int(b_.b % 4));
      case DecodeBreak::query_side_key_wise:
        (b_.a & 1 ? qs.post : qs.pre).key_wise = true;
        return "query_side key_wise on";
      case DecodeBreak::query_side_group:
        return other_group(qs);
      case DecodeBreak::out_overlaps_cache:
        return out_in_cache(qv, ov, n);
      default:
        if ((b_.b & 4) && d_.Dv > 1) {
          out.stride[3] = 2;
          return "out.stride[3] = 2";
        }
        return resize_dim(ov, int(b_.b % 4));
    }
  }

  /// A static W of G + 1 groups (read through a zero stride), or the first query-side tensor's G.
  std::string other_group(ComposeWeights<T>& qs) {
    ComposeTerms<T>& t = b_.a & 1 ? qs.post : qs.pre;
    const index_t G = d_.G + 1, M = d_.H / d_.G;
    if (!t.static_w) {
      t.static_w = true;
      AnyView w = any_view("query_side.w", t.w, false, "GMM");
      const index_t shape[3] = {G, M, M};
      place_dense(w, shape, arena_);
    }
    t.w.shape[0] = G;
    t.w.stride[0] = 0;
    return "query_side static W with G = " + std::to_string(G);
  }

  std::string out_in_cache(AnyView& q, AnyView& out, std::int64_t n) {
    const index_t need = d_.B * d_.H * n * d_.Dv;
    if (DecodeCache<T>::required_elements(run_.config()) < need)
      return overlap(q, out, arena_, false);
    index_t run = 1;
    for (int d = 3; d >= 0; --d) out.stride[d] = run, run *= out.shape[d];
    out.set_data(reinterpret_cast<unsigned char*>(run_.cache().k_slots().data));
    return "out inside the cache's K";
  }

  DecodeRun<T>& run_;
  const DecodeCase& d_;
  const Break& b_;
  Arena arena_;
  std::string what_;
};

// --- the cache's config -----------------------------------------------------------------------

enum class ConfigBreak {
  kv_heads,
  groups,
  rank,
  window_with_capacity,
  no_capacity,
  no_max_step,
  small_buffer,
  negative_window,
  count
};
static_assert(int(ConfigBreak::count) == kConfigBreakKinds, "decode_input.hpp's count");

inline std::string break_config(DecodeCacheConfig& cc, const Break& b) {
  switch (ConfigBreak(b.kind)) {
    case ConfigBreak::kv_heads:
      cc.Hk = non_divisor_of(cc.H);
      return "config.Hk = " + std::to_string(cc.Hk);
    case ConfigBreak::groups:
      cc.G = non_divisor_of(cc.H);
      return "config.G = " + std::to_string(cc.G);
    case ConfigBreak::rank:
      cc.Rk = cc.pre_key_wise || cc.post_key_wise ? 0 : 1 + b.a % 2;
      return "config.Rk = " + std::to_string(cc.Rk);
    case ConfigBreak::window_with_capacity:
      cc.window = 1 + b.a % 5, cc.capacity = 1 + b.b % 5;
      return "config.window and config.capacity both set";
    case ConfigBreak::no_capacity:
      cc.window = 0, cc.capacity = -(b.a % 2);
      return "config.capacity = " + std::to_string(cc.capacity) + " for a global layer";
    case ConfigBreak::no_max_step:
      cc.max_step = -(b.a % 2);
      return "config.max_step = " + std::to_string(cc.max_step);
    case ConfigBreak::negative_window:
      cc.window = -1 - b.a % 3;
      return "config.window = " + std::to_string(cc.window);
    default:
      return "";
  }
}

/// Constructors and required_elements must reject a broken config; a caller buffer that is too
/// small (or null) must be rejected without being written.
template <class T>
void check_config_break(const FuzzCase& c) {
  DecodeCacheConfig cc = cache_config(c.dec);
  const std::string what = break_config(cc, c.dec.config_break);
  if (!what.empty()) {
    expect_error("DecodeCache with " + what, [&] { DecodeCache<T> cache(cc); });
    expect_error("DecodeCache::required_elements with " + what,
                 [&] { DecodeCache<T>::required_elements(cc); });
    std::vector<T> buf(64, T(0.5));
    expect_error("DecodeCache (caller memory) with " + what,
                 [&] { DecodeCache<T> cache(cc, buf.data(), index_t(buf.size())); });
    return;
  }
  const index_t need = DecodeCache<T>::required_elements(cc);
  std::vector<T> buf(size_t(need), T(0.5));
  const std::vector<T> before = buf;
  if (c.dec.config_break.a & 1)
    expect_error("DecodeCache with a null buffer",
                 [&] { DecodeCache<T> cache(cc, nullptr, need); });
  else
    expect_error("DecodeCache with a buffer one element short",
                 [&] { DecodeCache<T> cache(cc, buf.data(), need - 1); });
  if (buf != before) mismatch("a rejected DecodeCache wrote to the caller's buffer");
}

template <class T>
void run_decode_case(const FuzzCase& c) {
  const std::string problem = current_problem();
  if (c.dec.config_break.on()) check_config_break<T>(c);
  DecodeRun<T> run(c);
  run.start_episode(0);
  for (size_t i = 0; i < c.dec.steps.size(); ++i) {
    const DecodeStep& st = c.dec.steps[i];
    current_problem() = problem + " (at step " + std::to_string(i) + ")";
    switch (st.kind) {
      case DecodeStep::append:
        run.append(st);
        break;
      case DecodeStep::repeat:
        run.repeat();
        break;
      case DecodeStep::reset:
        run.reset(i);
        break;
      case DecodeStep::broken:
        DecodeBreaker<T>(run, st.brk).apply();
        break;
    }
  }
}

inline void check_decode(const FuzzCase& c) {
  if (c.scalar == Scalar::f64)
    run_decode_case<double>(c);
  else
    run_decode_case<float>(c);
}

}  // namespace dcmha::fuzz
