#pragma once
// Checks of the compose inputs (ComposeWeights) and of their gradients (ComposeGrads).
#include <string>
#include <vector>

#include "../compose_weights.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
#include "checks.hpp"

namespace dcmha::detail {

enum class ComposeTerm { static_w, query_wise, key_wise };

inline const char* term_name(ComposeTerm t) {
  switch (t) {
    case ComposeTerm::static_w:
      return "static_w";
    case ComposeTerm::query_wise:
      return "query_wise";
    default:
      return "key_wise";
  }
}

template <class T>
bool term_on(const ComposeTerms<T>& c, ComposeTerm t) {
  switch (t) {
    case ComposeTerm::static_w:
      return c.static_w;
    case ComposeTerm::query_wise:
      return c.query_wise;
    default:
      return c.key_wise;
  }
}

/// Visits the seven tensors of one side of two parallel structs (inputs and their gradients, or
/// the same struct twice). `dims` spells the logical shape one letter per dim, so shape checks
/// and messages are driven by one table instead of seven hand-written blocks.
template <class A, class B, class F>
void for_each_compose_pair(A& a, B& b, F&& f) {
  f("w", "GMM", ComposeTerm::static_w, a.w, b.w);
  f("qw1", "BTGRM", ComposeTerm::query_wise, a.qw1, b.qw1);
  f("qw2", "BTGRM", ComposeTerm::query_wise, a.qw2, b.qw2);
  f("qdd", "BTGM", ComposeTerm::query_wise, a.qdd, b.qdd);
  f("kw1", "BSGRM", ComposeTerm::key_wise, a.kw1, b.kw1);
  f("kw2", "BSGRM", ComposeTerm::key_wise, a.kw2, b.kw2);
  f("kdd", "BSGM", ComposeTerm::key_wise, a.kdd, b.kdd);
}

inline std::string shape_text(const char* dims) {
  std::string s = "(";
  for (const char* c = dims; *c; ++c) {
    if (c != dims) s += ", ";
    s += *c;
  }
  return s + ")";
}

/// An expected dim and the argument it was taken from, for messages.
struct DimRef {
  index_t value = 0;
  std::string source;
};

/// The dims compose tensors are checked against; G comes from the first compose tensor given.
struct ComposeRefs {
  DimRef B, T, S, G, M;
  const DimRef& operator[](char c) const {
    switch (c) {
      case 'B':
        return B;
      case 'T':
        return T;
      case 'S':
        return S;
      case 'G':
        return G;
      default:
        return M;
    }
  }
};

template <class T>
struct NamedComposeTerms {
  const char* name;
  const ComposeTerms<T>& terms;
};

/// A term that is on needs every one of its tensors; a tensor given for a term that is off
/// would be silently ignored, which hides caller bugs (e.g. a forgotten switch).
template <class T, class Side>
void check_compose_presence(const char* fn, const char* prefix, const char* side_name,
                            const ComposeTerms<T>& sw, const Side& side) {
  for_each_compose_pair(
      sw, side,
      [&](const char* name, const char* dims, ComposeTerm term, const auto&, const auto& t) {
        const std::string arg = std::string(prefix) + "." + side_name + "." + name;
        const std::string swname = std::string("compose.") + side_name + "." + term_name(term);
        if (term_on(sw, term))
          require_given(fn, arg, t, shape_text(dims), swname + " is on");
        else
          require_absent(fn, arg, t,
                         std::string(term_name(term)) + " is off (" + swname + " == false)");
      });
}

/// Validates the compose inputs after the attention tensors; returns G (H when compose is off)
/// and appends the footprints of the given tensors to `inputs`.
template <class T>
index_t validate_compose(const char* fn, const ComposeWeights<T>& c, index_t H, ComposeRefs refs,
                         std::vector<Footprint>& inputs) {
  check_compose_presence(fn, "compose", "pre", c.pre, c.pre);
  check_compose_presence(fn, "compose", "post", c.post, c.post);

  // Heads are mixed only inside a group, so every tensor on either side must agree on G.
  const NamedComposeTerms<T> sides[2] = {{"pre", c.pre}, {"post", c.post}};
  for (const NamedComposeTerms<T>& side : sides) {
    const char* side_name = side.name;
    for_each_compose_pair(
        side.terms, side.terms,
        [&](const char* name, const char* dims, ComposeTerm, const auto& t, const auto&) {
          if (t.empty() || !refs.G.source.empty()) return;
          int gd = 0;
          while (dims[gd] != 'G') ++gd;
          const std::string arg = std::string("compose.") + side_name + "." + name;
          check_positive(fn, arg, t, gd, "G");
          check_divisor(fn, arg, t, gd, "G", "H", H, "q.shape[1]");
          refs.G = {t.shape[gd], arg + ".shape[" + std::to_string(gd) + "]"};
        });
  }
  if (refs.G.source.empty()) return H;  // compose off: every head is its own group
  refs.M = {H / refs.G.value, "H / G"};

  for (const NamedComposeTerms<T>& side : sides) {
    const char* side_name = side.name;
    DimRef rq, rk;  // each low-rank pair shares its rank; the two pairs need not agree
    for_each_compose_pair(
        side.terms, side.terms,
        [&](const char* name, const char* dims, ComposeTerm term, const auto& t, const auto&) {
          if (t.empty()) return;
          const std::string arg = std::string("compose.") + side_name + "." + name;
          for (int d = 0; dims[d]; ++d) {
            const char what[2] = {dims[d], '\0'};
            if (dims[d] != 'R') {
              check_dim(fn, arg, t, d, what, refs[dims[d]].value, refs[dims[d]].source);
              continue;
            }
            DimRef& r = term == ComposeTerm::query_wise ? rq : rk;
            if (r.source.empty()) {
              check_positive(fn, arg, t, d, what);
              r = {t.shape[d], arg + ".shape[" + std::to_string(d) + "]"};
            } else {
              check_dim(fn, arg, t, d, what, r.value, r.source);
            }
          }
          check_strides(fn, arg, t);
          inputs.push_back(footprint(arg, t));
        });
  }
  return refs.G.value;
}

/// Validates the compose gradients against the already validated inputs and appends their
/// footprints to `outputs`.
template <class T>
void validate_compose_grads(const char* fn, const ComposeWeights<T>& c, const ComposeGrads<T>& g,
                            std::vector<Footprint>& outputs) {
  check_compose_presence(fn, "dcompose", "pre", c.pre, g.pre);
  check_compose_presence(fn, "dcompose", "post", c.post, g.post);
  const NamedComposeTerms<T> sides[2] = {{"pre", c.pre}, {"post", c.post}};
  const ComposeTermGrads<T>* grads[2] = {&g.pre, &g.post};
  for (int i = 0; i < 2; ++i) {
    const char* side_name = sides[i].name;
    for_each_compose_pair(
        sides[i].terms, *grads[i],
        [&](const char* name, const char* dims, ComposeTerm, const auto& in, const auto& t) {
          if (t.empty()) return;
          const std::string src = std::string("compose.") + side_name + "." + name;
          const std::string arg = "d" + src;
          for (int d = 0; dims[d]; ++d) {
            const char what[2] = {dims[d], '\0'};
            check_dim(fn, arg, t, d, what, in.shape[d], src + ".shape[" + std::to_string(d) + "]");
          }
          check_strides(fn, arg, t);
          check_no_self_overlap(fn, arg, t);
          outputs.push_back(footprint(arg, t));
        });
  }
}

}  // namespace dcmha::detail
