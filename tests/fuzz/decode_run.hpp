#pragma once
// DecodeRun: one DecodeCache driven through a schedule of appends and decodes, every decoded row
// compared with the row of the reference's full causal forward over the same tokens.
//
// An episode is the stretch between resets. Its tokens (q, k, v and the compose weights of every
// position of every sequence) are drawn up front, and one reference forward over all of them
// (query and key lengths = each sequence's total) gives every row any step of the episode will
// decode. A step gathers the next tokens of each sequence into the new-token tensors; positions
// past a sequence's count are padding: NaN in q, K, V and the key-wise terms (the cache must
// neither store nor read them), finite in the query-wise terms (a padding row's zero
// probabilities are multiplied by them).
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention_check.hpp"
#include "attention_tensors.hpp"
#include "dcmha/dcmha.hpp"
#include "fuzz_case.hpp"
#include "report.hpp"
#include "values.hpp"

namespace dcmha::fuzz {

/// Positions [start[b], start[b] + count[b]) of dim `td` of a canonical tensor of `shape`, into a
/// dense one whose dim td has n entries; everything else (padding, or a position the source does
/// not have) is `fill`.
inline std::vector<double> gather_tokens(const std::vector<double>& src,
                                         const std::vector<std::int64_t>& shape, int td,
                                         const std::vector<std::int64_t>& start,
                                         const std::vector<std::int64_t>& count, std::int64_t n,
                                         double fill) {
  std::vector<std::int64_t> out_shape = shape;
  out_shape[size_t(td)] = n;
  std::int64_t total = 1;
  for (std::int64_t s : out_shape) total *= s;
  std::vector<double> out(size_t(total), fill);
  std::vector<std::int64_t> idx(shape.size(), 0);
  for (std::int64_t flat = 0; flat < total; ++flat) {
    const std::int64_t b = idx[0], i = idx[size_t(td)], pos = start[size_t(b)] + i;
    if (i < count[size_t(b)] && pos < shape[size_t(td)]) {
      std::int64_t off = 0;
      for (size_t d = 0; d < shape.size(); ++d)
        off = off * shape[d] + (int(d) == td ? pos : idx[d]);
      out[size_t(flat)] = src[size_t(off)];
    }
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < out_shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

inline DecodeCacheConfig cache_config(const DecodeCase& d) {
  DecodeCacheConfig c;
  c.B = d.B;
  c.H = d.H;
  c.Hk = d.Hk;
  c.D = d.D;
  c.Dv = d.Dv;
  c.G = d.G;
  c.Rk = d.Rk;
  c.pre_key_wise = d.pre.key_wise;
  c.post_key_wise = d.post.key_wise;
  c.capacity = d.capacity;
  c.window = d.window;
  c.max_step = d.max_step;
  return c;
}

/// The tokens of one episode and the reference rows they give.
struct Episode {
  reference::Problem p;           // T = S = the longest sequence's total
  std::vector<double> want;       // reference forward (B, H, L, Dv)
  std::vector<std::int64_t> len;  // tokens appended so far per sequence

  Episode(const DecodeCase& d, const std::vector<std::int64_t>& totals, std::uint64_t seed)
      : len(totals.size(), 0) {
    const std::int64_t L =
        std::max<std::int64_t>(1, *std::max_element(totals.begin(), totals.end()));
    AttentionCase a;
    a.B = d.B;
    a.H = d.H;
    a.Hk = d.Hk;
    a.G = d.G;
    a.T = a.S = L;
    a.D = d.D;
    a.Dv = d.Dv;
    a.pre = d.pre;
    a.post = d.post;
    a.causal = true;
    a.window = d.window;
    a.scale = d.scale;
    a.qlen = a.klen = totals;
    p = attention_problem(a, seed);
    want = reference::forward(p);
  }
  std::int64_t L() const { return p.T; }
};

/// The tensors of one append and its decode.
template <class T>
struct StepTensors {
  std::int64_t n = 0;
  std::vector<index_t> counts;  // B values
  bool padded = false;          // counts passed to append (else every sequence takes n)
  Strided<T, 4> q, k, v;
  ComposeBuffers<T> key[2], query[2];  // key-wise terms (append); static and query-wise (decode)
  const DecodeCase* d = nullptr;

  ComposeWeights<T> key_side() const {
    ComposeWeights<T> w;
    w.pre = terms_of(key_only(d->pre), key[0]);
    w.post = terms_of(key_only(d->post), key[1]);
    return w;
  }
  ComposeWeights<T> query_side() const {
    ComposeWeights<T> w;
    w.pre = terms_of(query_only(d->pre), query[0]);
    w.post = terms_of(query_only(d->post), query[1]);
    return w;
  }
  TensorView<const index_t, 1> counts_view() const {
    return padded ? view<1>(counts.data(), {index_t(counts.size())})
                  : TensorView<const index_t, 1>{};
  }
  static SideSpec key_only(SideSpec s) {
    s.static_w = s.query_wise = false;
    return s;
  }
  static SideSpec query_only(SideSpec s) {
    s.key_wise = false;
    return s;
  }
};

template <class T>
class DecodeRun {
 public:
  using Memory = std::vector<unsigned char>;

  explicit DecodeRun(const FuzzCase& c) : c_(c), d_(c.dec), cc_(cache_config(c.dec)) {
    expect_success("DecodeCache construction", [&] {
      if (d_.caller_memory) {
        // NaN, not zero: the cache must never read a slot it has not written.
        memory_.assign(size_t(DecodeCache<T>::required_elements(cc_)),
                       std::numeric_limits<T>::quiet_NaN());
        cache_ = std::make_unique<DecodeCache<T>>(cc_, memory_.data(), index_t(memory_.size()));
      } else {
        cache_ = std::make_unique<DecodeCache<T>>(cc_);
      }
    });
  }

  const DecodeCase& spec() const { return d_; }
  const DecodeCacheConfig& config() const { return cc_; }
  DecodeCache<T>& cache() { return *cache_; }
  const StepTensors<T>* last() const { return last_.get(); }
  int threads() const { return c_.threads; }

  AttentionConfig decode_config() const {
    AttentionConfig cfg;
    cfg.scale = d_.scale;
    cfg.window = d_.cfg_window ? d_.window : 0;
    cfg.num_threads = c_.threads;
    return cfg;
  }

  /// Plans the episode that starts at step `from` (its tokens: every append up to the next reset).
  void start_episode(size_t from) {
    std::vector<std::int64_t> totals(size_t(d_.B), 0);
    for (size_t i = from; i < d_.steps.size() && d_.steps[i].kind != DecodeStep::reset; ++i) {
      const DecodeStep& st = d_.steps[i];
      if (st.kind != DecodeStep::append) continue;
      for (std::int64_t b = 0; b < d_.B; ++b)
        totals[size_t(b)] += st.counts.empty() ? st.n : st.counts[size_t(b)];
    }
    episode_ =
        std::make_unique<Episode>(d_, totals, c_.seed + 0x9e3779b97f4a7c15ull * (++episodes_));
  }

  /// New-token tensors for n tokens per sequence, sequence b taking counts[b] of them from the
  /// episode's next tokens (a break may ask for more than the episode has: those are `fill`).
  std::unique_ptr<StepTensors<T>> make_step(std::int64_t n, const std::vector<std::int64_t>& counts,
                                            bool padded) {
    auto s = std::make_unique<StepTensors<T>>();
    s->n = n;
    s->counts.assign(counts.begin(), counts.end());
    s->padded = padded;
    s->d = &d_;
    const reference::Problem& p = episode_->p;
    const std::vector<std::int64_t>& at = episode_->len;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::int64_t B = d_.B, L = episode_->L(), G = d_.G, M = d_.H / d_.G;
    auto tokens = [&](const std::vector<double>& src, std::int64_t X, std::int64_t Y,
                      const MemLayout<4>& l) {
      Strided<T, 4> t({B, X, n, Y}, l);
      t.set(gather_tokens(src, {B, X, L, Y}, 2, at, counts, n, nan));
      return t;
    };
    s->q = tokens(p.q, d_.H, d_.D, d_.act[0]);
    s->k = tokens(p.k, d_.Hk, d_.D, d_.act[1]);
    s->v = tokens(p.v, d_.Hk, d_.Dv, d_.act[2]);
    Rng rng(c_.seed ^ (0x5ca1eull + std::uint64_t(++steps_made_)));
    const reference::ComposeSide* ref[2] = {&p.pre, &p.post};
    const SideSpec* spec[2] = {&d_.pre, &d_.post};
    for (int side = 0; side < 2; ++side) {
      const ComposeShapes sh(*spec[side], B, n, n, G, M);
      s->key[side] =
          compose_buffers<T>(StepTensors<T>::key_only(*spec[side]), sh, rng, d_.compose_layout);
      s->query[side] =
          compose_buffers<T>(StepTensors<T>::query_only(*spec[side]), sh, rng, d_.compose_layout);
      const reference::ComposeSide& r = *ref[side];
      ComposeBuffers<T>& kb = s->key[side];
      ComposeBuffers<T>& qb = s->query[side];
      auto lowrank = [&](const std::vector<double>& x, std::int64_t R, double fill) {
        return gather_tokens(x, {B, L, G, R, M}, 1, at, counts, n, fill);
      };
      auto gate = [&](const std::vector<double>& x, double fill) {
        return gather_tokens(x, {B, L, G, M}, 1, at, counts, n, fill);
      };
      if (r.key_wise)
        kb.kw1.set(lowrank(r.kw1, r.Rk, nan)), kb.kw2.set(lowrank(r.kw2, r.Rk, nan)),
            kb.kdd.set(gate(r.kdd, nan));
      if (r.static_w) qb.w.set(r.w);
      if (r.query_wise)
        qb.qw1.set(lowrank(r.qw1, r.Rq, 0.25)), qb.qw2.set(lowrank(r.qw2, r.Rq, 0.25)),
            qb.qdd.set(gate(r.qdd, 0.25));
    }
    return s;
  }

  void decode_into(const AttentionConfig& cfg, TensorView<const T, 4> q,
                   const ComposeWeights<T>& qs, TensorView<T, 4> out) {
    if (d_.workspace)
      dcmha::decode(cfg, q, *cache_, qs, out, workspace_);
    else if (!qs.enabled())
      dcmha::decode(cfg, q, *cache_, out);  // the overload without query-side weights
    else
      dcmha::decode(cfg, q, *cache_, qs, out);
  }

  Strided<T, 4> new_out(std::int64_t n) const {
    return Strided<T, 4>({d_.B, d_.H, n, d_.Dv}, d_.act[3]);
  }

  // --- the steps
  // ----------------------------------------------------------------------------------

  void append(const DecodeStep& st) {
    const std::vector<std::int64_t> counts =
        st.counts.empty() ? std::vector<std::int64_t>(size_t(d_.B), st.n) : st.counts;
    std::unique_ptr<StepTensors<T>> s = make_step(st.n, counts, !st.counts.empty());
    expect_success("DecodeCache::append", [&] {
      cache_->append(s->k.cview(), s->v.cview(), s->key_side(), s->counts_view());
    });
    for (std::int64_t b = 0; b < d_.B; ++b) episode_->len[size_t(b)] += counts[size_t(b)];
    expect_state(st.n, episode_->len, counts);
    Strided<T, 4> out = new_out(st.n);
    expect_success(
        "decode", [&] { decode_into(decode_config(), s->q.cview(), s->query_side(), out.view()); });
    last_out_ = out.get();
    expect_rows(*s, last_out_);
    expect_untouched_outside("decode out", out);
    last_ = std::move(s);
  }

  /// decode() again without an append: the same step, the same bits.
  void repeat() {
    if (!last_)
      return expect_decode_rejected("decode without an append since construction or reset()");
    Strided<T, 4> out = new_out(last_->n);
    expect_success("decode (again)", [&] {
      decode_into(decode_config(), last_->q.cview(), last_->query_side(), out.view());
    });
    if (out.get() != last_out_) mismatch("decode again without append: a different result");
  }

  void reset(size_t step) {
    cache_->reset();
    last_.reset();
    const std::vector<std::int64_t> zeros(size_t(d_.B), 0);
    expect_state(0, zeros, zeros);
    expect_decode_rejected("decode right after reset()");
    start_episode(step + 1);
  }

  /// decode must throw when no append came since construction or reset().
  void expect_decode_rejected(const std::string& what) {
    Strided<T, 4> q({d_.B, d_.H, 1, d_.D}, d_.act[0]);
    q.set(std::vector<double>(size_t(d_.B * d_.H * d_.D), 0.5));
    Strided<T, 4> out = new_out(1);
    const Memory before = out.bytes();
    expect_error(what, [&] { decode_into(decode_config(), q.cview(), {}, out.view()); });
    if (out.bytes() != before) mismatch(what + ": the rejected decode wrote its output");
  }

  /// Lengths, counts and every byte of the cache: what a rejected call must leave as it was.
  struct State {
    std::vector<index_t> length, count;
    index_t last_step = 0;
    Memory memory;
    bool operator==(const State& o) const {
      return length == o.length && count == o.count && last_step == o.last_step &&
             memory == o.memory;
    }
  };
  State state() const {
    State s;
    for (std::int64_t b = 0; b < d_.B; ++b)
      s.length.push_back(cache_->length(b)), s.count.push_back(cache_->last_count(b));
    s.last_step = cache_->last_step();
    const auto* p = reinterpret_cast<const unsigned char*>(cache_->k_slots().data);
    s.memory.assign(p, p + size_t(DecodeCache<T>::required_elements(cc_)) * sizeof(T));
    return s;
  }

 private:
  void expect_state(std::int64_t n, const std::vector<std::int64_t>& lengths,
                    const std::vector<std::int64_t>& counts) {
    if (cache_->last_step() != n)
      mismatch("last_step() = " + std::to_string(cache_->last_step()) + ", expected " +
               std::to_string(n));
    for (std::int64_t b = 0; b < d_.B; ++b) {
      const std::int64_t len = lengths[size_t(b)];
      if (cache_->length(b) != len || cache_->last_count(b) != counts[size_t(b)])
        mismatch("sequence " + std::to_string(b) + ": length " + std::to_string(cache_->length(b)) +
                 " count " + std::to_string(cache_->last_count(b)) + ", expected " +
                 std::to_string(len) + " and " + std::to_string(counts[size_t(b)]));
    }
  }

  /// Real rows against the reference's rows of the same positions; padding rows exactly 0.
  void expect_rows(const StepTensors<T>& s, const std::vector<double>& got) {
    const std::int64_t H = d_.H, Dv = d_.Dv, n = s.n, L = episode_->L();
    std::vector<double> want_rows, got_rows;
    for (std::int64_t b = 0; b < d_.B; ++b) {
      const std::int64_t first = episode_->len[size_t(b)] - s.counts[size_t(b)];
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t e = 0; e < Dv; ++e) {
            const double x = got[size_t(((b * H + h) * n + i) * Dv + e)];
            if (i >= s.counts[size_t(b)]) {
              if (x != 0.0)
                mismatch("decode out: padding row b" + std::to_string(b) + " h" +
                         std::to_string(h) + " i" + std::to_string(i) + " = " + num(x) +
                         " (expected exactly 0)");
              continue;
            }
            want_rows.push_back(episode_->want[size_t(((b * H + h) * L + first + i) * Dv + e)]);
            got_rows.push_back(x);
          }
    }
    expect_close("decode out (rows of the full causal forward)", want_rows, got_rows,
                 tolerance<T>());
  }

  const FuzzCase& c_;
  const DecodeCase& d_;
  DecodeCacheConfig cc_;
  std::vector<T> memory_;
  std::unique_ptr<DecodeCache<T>> cache_;
  Workspace workspace_;
  std::unique_ptr<Episode> episode_;
  std::unique_ptr<StepTensors<T>> last_;
  std::vector<double> last_out_;
  int episodes_ = 0, steps_made_ = 0;
};

}  // namespace dcmha::fuzz
