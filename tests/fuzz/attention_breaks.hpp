#pragma once
// Invalid forward and backward calls: a valid call with exactly one thing broken. The library
// must throw dcmha::Error and leave every output as it was (attention_check.hpp checks both).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "any_view.hpp"
#include "attention_tensors.hpp"
#include "decode_input.hpp"

namespace dcmha::fuzz {

enum class AttentionBreak {
  shape,                    // one dim of q, k, v, out, lse, dout or a gradient off by one
  compose_missing,          // a term switched on without (one of) its tensors
  compose_extra,            // a tensor given for a term that is off
  dcompose_missing,         // backward: a gradient missing for a term that is on
  dcompose_extra,           // backward: a gradient given for a term that is off
  compose_shape,            // one dim of a compose tensor (or its gradient) off by one
  groups_not_dividing,      // every compose tensor with a G that does not divide H
  kv_heads_not_dividing,    // k and v with an Hk that does not divide H
  length_out_of_range,      // a query or key length < 0 or > T / S, or B + 1 of them
  negative_stride,          // any tensor walked backwards along one dim
  head_dim_not_contiguous,  // an activation's head dim with stride 2
  output_overlaps_input,    // an output's memory inside an input's
  outputs_overlap,          // two outputs sharing memory
  output_self_overlap,      // an output with a zero stride on a dim of size > 1
  bad_config,               // negative window or thread count, non-finite scale
  missing_tensor,           // q, k, v, forward's out (backward: lse, dout, dq, dk, dv) not given
  zero_size,                // a zero dim in q, k or v
  count
};
static_assert(int(AttentionBreak::count) == kAttentionBreakKinds, "decode_input.hpp's count");

/// Edits the arguments of one call. Each break returns what it did (for the report), or an
/// empty string where the problem has nothing to break that way; bad_config always applies.
template <class T>
class AttentionBreaker {
 public:
  AttentionBreaker(const AttentionCase& a, AttentionConfig& cfg, ComposeWeights<T>& compose,
                   ComposeGrads<T>* dcompose, std::vector<AnyView>& views, Arena& arena)
      : a_(a), cfg_(cfg), compose_(compose), dcompose_(dcompose), views_(views), arena_(arena) {}

  std::string apply(const Break& b) {
    std::string what = dispatch(AttentionBreak(b.kind), b.a, b.b);
    return what.empty() ? bad_config(b.a) : what;
  }

 private:
  std::string dispatch(AttentionBreak kind, unsigned x, unsigned y) {
    switch (kind) {
      case AttentionBreak::shape:
        return shape(x, y);
      case AttentionBreak::compose_missing:
        return missing_term(x, y, false);
      case AttentionBreak::compose_extra:
        return extra_term(x, y, false);
      case AttentionBreak::dcompose_missing:
        return missing_term(x, y, dcompose_ != nullptr);
      case AttentionBreak::dcompose_extra:
        return extra_term(x, y, dcompose_ != nullptr);
      case AttentionBreak::compose_shape:
        return compose_shape(x, y);
      case AttentionBreak::groups_not_dividing:
        return groups_not_dividing();
      case AttentionBreak::kv_heads_not_dividing:
        return kv_heads_not_dividing();
      case AttentionBreak::length_out_of_range:
        return length_out_of_range(x, y);
      case AttentionBreak::negative_stride:
        return negative_stride(x, y);
      case AttentionBreak::head_dim_not_contiguous:
        return head_dim_not_contiguous(x);
      case AttentionBreak::output_overlaps_input:
        return output_overlaps_input(x, y);
      case AttentionBreak::outputs_overlap:
        return outputs_overlap(x, y);
      case AttentionBreak::output_self_overlap:
        return output_self_overlap(x, y);
      case AttentionBreak::bad_config:
        return bad_config(x);
      case AttentionBreak::missing_tensor:
        return missing_tensor(x);
      case AttentionBreak::zero_size:
        return zero_size(x);
      default:
        return "";
    }
  }

  bool is_activation(const AnyView& v) const {
    return v.rank == 4 && v.name.find('.') == std::string::npos;
  }

  std::string shape(unsigned x, unsigned y) {
    std::vector<AnyView*> c;
    for (AnyView& v : views_)
      if (v.given() && (is_activation(v) || v.name == "lse")) c.push_back(&v);
    AnyView* v = choose(c, x);
    return v ? resize_dim(*v, int(y % unsigned(v->rank))) : "";
  }

  /// The views of one term (0 static, 1 query-wise, 2 key-wise) of one side.
  std::vector<AnyView*> term_views(bool post, int term, bool grads) {
    const std::string prefix =
        std::string(grads ? "dcompose." : "compose.") + (post ? "post." : "pre.");
    static const char* const names[3][3] = {
        {"w", "", ""}, {"qw1", "qw2", "qdd"}, {"kw1", "kw2", "kdd"}};
    std::vector<AnyView*> r;
    for (AnyView& v : views_)
      for (const char* n : names[term])
        if (*n && v.name == prefix + n) r.push_back(&v);
    return r;
  }
  bool& switch_of(bool post, int term) {
    ComposeTerms<T>& s = post ? compose_.post : compose_.pre;
    return term == 0 ? s.static_w : term == 1 ? s.query_wise : s.key_wise;
  }

  std::string missing_term(unsigned x, unsigned y, bool grads) {
    const bool post = x & 1;
    const int term = int(y % 3);
    std::vector<AnyView*> vs = term_views(post, term, grads);
    if (switch_of(post, term)) {  // on: drop one tensor (its input or its gradient)
      AnyView* v = choose(vs, y / 3);
      v->set_data(nullptr);
      return v->name + " not given although its term is on";
    }
    if (grads) return extra_term(x, y, true);  // off: a gradient then is an extra one
    switch_of(post, term) = true;              // off: switched on without tensors
    return std::string(post ? "post" : "pre") + " term " + std::to_string(term) +
           " on without tensors";
  }

  std::string extra_term(unsigned x, unsigned y, bool grads) {
    const bool post = x & 1;
    const int term = int(y % 3);
    if (switch_of(post, term)) {
      if (grads) return missing_term(x, y, true);
      switch_of(post, term) = false;  // on: switched off, its tensors still given
      return std::string(post ? "post" : "pre") + " term " + std::to_string(term) +
             " off with its tensors given";
    }
    // Off: one tensor of the right shape given for it (inputs' from the spec's ranks).
    const SideSpec& s = post ? a_.post : a_.pre;
    const ComposeShapes sh(s, a_.B, a_.T, a_.S, a_.G, a_.H / a_.G);
    AnyView* v = choose(term_views(post, term, grads), y / 3);
    const index_t* shape = v->rank == 3   ? sh.w.data()
                           : v->rank == 5 ? (term == 1 ? sh.qw.data() : sh.kw.data())
                                          : (term == 1 ? sh.qdd.data() : sh.kdd.data());
    place_dense(*v, shape, arena_);
    return v->name + " given although its term is off";
  }

  std::vector<AnyView*> compose_views(bool grads) {
    std::vector<AnyView*> r;
    for (AnyView& v : views_)
      if (v.given() && v.name.rfind(grads ? "dcompose." : "compose.", 0) == 0) r.push_back(&v);
    return r;
  }

  std::string compose_shape(unsigned x, unsigned y) {
    AnyView* v = choose(compose_views(dcompose_ && (x & 1)), x / 2);
    if (!v) v = choose(compose_views(false), x / 2);
    return v ? resize_dim(*v, int(y % unsigned(v->rank))) : "";
  }

  std::string groups_not_dividing() {
    const index_t g = non_divisor_of(a_.H);
    std::vector<AnyView*> vs = compose_views(false);
    for (AnyView* v : vs) {
      const int d = v->dim_of('G');
      v->shape[d] = g;
      v->stride[d] = 0;
    }
    return vs.empty() ? "" : "every compose tensor with G = " + std::to_string(g);
  }

  std::string kv_heads_not_dividing() {
    const index_t hk = non_divisor_of(a_.H);
    for (AnyView& v : views_)
      if (v.name == "k" || v.name == "v") v.shape[1] = hk, v.stride[1] = 0;
    return "k, v with Hk = " + std::to_string(hk);
  }

  std::string length_out_of_range(unsigned x, unsigned y) {
    const bool keys = x & 1;
    const index_t limit = keys ? a_.S : a_.T;
    const std::vector<std::int64_t>& given_lengths = keys ? a_.klen : a_.qlen;
    index_t* p = arena_.alloc_elems<index_t>(a_.B + 1);
    for (index_t b = 0; b <= a_.B; ++b)
      p[b] = given_lengths.empty() || b == a_.B ? limit : given_lengths[size_t(b)];
    const index_t at = index_t(y / 4) % a_.B;
    index_t n = a_.B;
    switch (y % 4) {
      case 0:
        p[at] = limit + 1;
        break;
      case 1:
        p[at] = -1;
        break;
      case 2:
        n = a_.B + 1;
        break;
      default:  // one value too few (or, for B = 1, one out of range)
        if (a_.B > 1)
          n = a_.B - 1;
        else
          p[at] = limit + 1;
        break;
    }
    (keys ? cfg_.key_lengths : cfg_.query_lengths) = view<1>(static_cast<const index_t*>(p), {n});
    return std::string(keys ? "key" : "query") + "_lengths: " + std::to_string(n) + " values, [" +
           std::to_string(at) + "] = " + std::to_string(p[at]);
  }

  std::string negative_stride(unsigned x, unsigned y) {
    std::vector<AnyView*> c;
    for (AnyView& v : views_)
      if (v.given() && !v.long_dims().empty()) c.push_back(&v);
    AnyView* v = choose(c, x);
    if (!v) return "";
    const std::vector<int> d = v->long_dims();
    return reverse_dim(*v, d[y % d.size()]);
  }

  std::string head_dim_not_contiguous(unsigned x) {
    std::vector<AnyView*> c;
    for (AnyView& v : views_)
      if (v.given() && is_activation(v) && v.shape[3] > 1) c.push_back(&v);
    AnyView* v = choose(c, x);
    if (!v) return "";
    v->stride[3] = 2;
    return v->name + ".stride[3] = 2";
  }

  std::string output_overlaps_input(unsigned x, unsigned y) {
    AnyView* out = choose(given(views_, true), x);
    AnyView* in = choose(given(views_, false), y);
    return out && in ? overlap(*in, *out, arena_, y & 128) : "";
  }

  std::string outputs_overlap(unsigned x, unsigned y) {
    std::vector<AnyView*> outs = given(views_, true);
    if (outs.size() < 2) return output_overlaps_input(x, y);
    AnyView* a = outs[x % outs.size()];
    AnyView* b = outs[(x % outs.size() + 1 + y % (outs.size() - 1)) % outs.size()];
    return overlap(*a, *b, arena_, y & 128);
  }

  std::string output_self_overlap(unsigned x, unsigned y) {
    std::vector<AnyView*> c;
    for (AnyView* v : given(views_, true))
      if (!v->long_dims().empty()) c.push_back(v);
    AnyView* v = choose(c, x);
    if (!v) return "";
    const std::vector<int> d = v->long_dims();
    const int dim = d[y % d.size()];
    v->stride[dim] = 0;
    return v->name + ".stride[" + std::to_string(dim) + "] = 0";
  }

  std::string bad_config(unsigned x) {
    switch (x % 5) {
      case 0:
        cfg_.window = -1 - index_t(x % 3);
        return "cfg.window = " + std::to_string(cfg_.window);
      case 1:
        cfg_.num_threads = -1;
        return "cfg.num_threads = -1";
      case 2:
        cfg_.scale = std::numeric_limits<double>::quiet_NaN();
        return "cfg.scale = NaN";
      case 3:
        cfg_.scale = std::numeric_limits<double>::infinity();
        return "cfg.scale = inf";
      default:
        cfg_.scale = -std::numeric_limits<double>::infinity();
        return "cfg.scale = -inf";
    }
  }

  std::string missing_tensor(unsigned x) {
    // The backward's `out` is optional (not given: D from a pass over the keys), so never broken.
    std::vector<AnyView*> c;
    for (AnyView& v : views_)
      if (v.given() && (is_activation(v) || (v.name == "lse" && !v.output)) &&
          !(dcompose_ && v.name == "out"))
        c.push_back(&v);
    AnyView* v = choose(c, x);
    v->set_data(nullptr);
    return v->name + " not given";
  }

  std::string zero_size(unsigned x) {
    // The dims the entry points take the problem's sizes from.
    static const std::pair<const char*, int> dims[] = {{"q", 0}, {"q", 1}, {"q", 2}, {"q", 3},
                                                       {"k", 1}, {"k", 2}, {"v", 3}};
    const auto& [name, d] = dims[x % 7];
    for (AnyView& v : views_)
      if (v.name == name) v.shape[d] = 0;
    return std::string(name) + ".shape[" + std::to_string(d) + "] = 0";
  }

  const AttentionCase& a_;
  AttentionConfig& cfg_;
  ComposeWeights<T>& compose_;
  ComposeGrads<T>* dcompose_;
  std::vector<AnyView>& views_;
  Arena& arena_;
};

// --- the views of a call ------------------------------------------------------------------------

template <class Side>
void add_side_views(std::vector<AnyView>& out, Side& s, const std::string& prefix, bool output) {
  out.push_back(any_view(prefix + "w", s.w, output, "GMM"));
  out.push_back(any_view(prefix + "qw1", s.qw1, output, "BTGRM"));
  out.push_back(any_view(prefix + "qw2", s.qw2, output, "BTGRM"));
  out.push_back(any_view(prefix + "qdd", s.qdd, output, "BTGM"));
  out.push_back(any_view(prefix + "kw1", s.kw1, output, "BSGRM"));
  out.push_back(any_view(prefix + "kw2", s.kw2, output, "BSGRM"));
  out.push_back(any_view(prefix + "kdd", s.kdd, output, "BSGM"));
}

template <class T>
std::vector<AnyView> views_of(ForwardCall<T>& c) {
  std::vector<AnyView> v{any_view("q", c.q, false, "BHTD"), any_view("k", c.k, false, "BHSD"),
                         any_view("v", c.v, false, "BHSD"), any_view("out", c.out, true, "BHTD"),
                         any_view("lse", c.lse, true, "BHT")};
  add_side_views(v, c.compose.pre, "compose.pre.", false);
  add_side_views(v, c.compose.post, "compose.post.", false);
  return v;
}

template <class T>
std::vector<AnyView> views_of(BackwardCall<T>& c) {
  std::vector<AnyView> v{
      any_view("q", c.q, false, "BHTD"),       any_view("k", c.k, false, "BHSD"),
      any_view("v", c.v, false, "BHSD"),       any_view("lse", c.lse, false, "BHT"),
      any_view("dout", c.dout, false, "BHTD"), any_view("dq", c.dq, true, "BHTD"),
      any_view("dk", c.dk, true, "BHSD"),      any_view("dv", c.dv, true, "BHSD")};
  add_side_views(v, c.compose.pre, "compose.pre.", false);
  add_side_views(v, c.compose.post, "compose.post.", false);
  add_side_views(v, c.dcompose.pre, "dcompose.pre.", true);
  add_side_views(v, c.dcompose.post, "dcompose.post.", true);
  if (!c.out.empty()) v.push_back(any_view("out", c.out, false, "BHTD"));
  return v;
}

}  // namespace dcmha::fuzz
