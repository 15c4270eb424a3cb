#pragma once
// What one fuzz input decodes into (decode_input.hpp reads it from the bytes): the operation,
// the scalar type, the problem's sizes, switches, masks and memory layouts, and, for an invalid
// problem, the one thing that is broken.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "strided.hpp"

namespace dcmha::fuzz {

enum class Op : std::uint8_t { forward, backward, decode, projection };
enum class Scalar : std::uint8_t { f32, f64, bf16 };

inline const char* op_name(Op op) {
  static const char* const names[] = {"forward", "backward", "decode", "projection"};
  return names[int(op)];
}
inline const char* scalar_name(Scalar s) {
  static const char* const names[] = {"float", "double", "bf16"};
  return names[int(s)];
}

/// One compose side: its switches and ranks.
struct SideSpec {
  bool static_w = false, query_wise = false, key_wise = false;
  std::int64_t Rq = 1, Rk = 1;
  bool enabled() const { return static_w || query_wise || key_wise; }
  std::string str() const {
    std::string s;
    if (static_w) s += "W";
    if (query_wise) s += "q" + std::to_string(Rq);
    if (key_wise) s += "k" + std::to_string(Rk);
    return s.empty() ? "-" : s;
  }
};

/// The one defect of an invalid problem: `kind` indexes the operation's list of breaks
/// (attention_breaks.hpp, decode_check.hpp, projection_check.hpp); a and b pick what exactly.
struct Break {
  int kind = -1;
  std::uint8_t a = 0, b = 0;
  bool on() const { return kind >= 0; }
  std::string str() const {
    return on() ? " break=" + std::to_string(kind) + "/" + std::to_string(a) + "/" +
                      std::to_string(b)
                : "";
  }
};

/// The attention activations, in the order of AttentionCase::act.
enum Act { kQ, kK, kV, kOut, kDout, kDq, kDk, kDv, kActs };

struct AttentionCase {
  std::int64_t B = 1, H = 1, Hk = 1, G = 1, T = 1, S = 1, D = 1, Dv = 1;
  SideSpec pre, post;
  bool causal = false;
  std::int64_t window = 0;
  double scale = 0;                       // <= 0: 1/sqrt(D)
  double score_scale = 1;                 // q and k values ~ N(0, score_scale^2)
  std::vector<std::int64_t> qlen, klen;   // empty: T and S for every sequence
  std::array<MemLayout<4>, kActs> act{};  // q, k, v, out, dout, dq, dk, dv
  MemLayout<3> lse = MemLayout<3>::dense();
  std::uint8_t compose_layout = 0;  // 0: dense; else permuted and padded (seeded)
  bool with_lse = true;             // forward: lse given (inference passes none)
  bool workspace = false;           // calls through one Workspace
  bool with_out = false;            // backward: given the forward's output

  std::string str() const;
};

/// One step of a decode schedule.
struct DecodeStep {
  enum Kind : std::uint8_t { append, repeat, reset, broken };
  Kind kind = append;
  std::int64_t n = 1;                // tokens per sequence in the new-token tensors
  std::vector<std::int64_t> counts;  // tokens each sequence appends; empty: n for every one
  Break brk;                         // kind == broken
};

struct DecodeCase {
  std::int64_t B = 1, H = 1, Hk = 1, G = 1, D = 1, Dv = 1, Rk = 0;
  SideSpec pre, post;         // pre.Rk == post.Rk == Rk: the cache keeps one rank
  std::int64_t window = 0;    // 0: global layer
  std::int64_t capacity = 1;  // global layers; 0 for local ones
  std::int64_t max_step = 1;
  double scale = 0;
  bool cfg_window = false;  // decode's cfg.window = the cache's instead of 0
  bool workspace = false, caller_memory = false;
  std::array<MemLayout<4>, 4> act{};  // q_new, k_new, v_new, out
  std::uint8_t compose_layout = 0;
  std::vector<DecodeStep> steps;
  Break config_break;  // an invalid DecodeCacheConfig or buffer

  std::string str() const;
};

struct ProjectionCase {
  std::int64_t B = 1, L = 1, E = 1, G = 1, K = 1, R = 1, M = 1;
  bool tanh_gelu = false;
  double eps = 1e-6;
  std::uint8_t in_layout = 0, out_layout = 0;  // 0: dense; else permuted and padded (seeded)
  bool backward = false;                       // forward, then backward
  bool keep = false;                           // backward from kept activations too

  std::string str() const;
};

struct FuzzCase {
  Op op = Op::forward;
  Scalar scalar = Scalar::f32;
  int threads = 1;
  std::uint64_t seed = 0;  // values (and the seeded layouts)
  AttentionCase attn;
  DecodeCase dec;
  ProjectionCase proj;
  Break brk;  // forward, backward, projection: the broken argument of an invalid call

  std::string str() const {
    std::string s = std::string(op_name(op)) + " " + scalar_name(scalar) + " threads" +
                    std::to_string(threads) + " seed" + std::to_string(seed) + " ";
    if (op == Op::forward || op == Op::backward) s += attn.str();
    if (op == Op::decode) s += dec.str();
    if (op == Op::projection) s += proj.str();
    return s + brk.str();
  }
};

inline std::string lengths_str(const char* name, const std::vector<std::int64_t>& v) {
  if (v.empty()) return "";
  std::string s = std::string(" ") + name + "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

inline std::string AttentionCase::str() const {
  static const char* const names[] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};
  std::string s = "B" + std::to_string(B) + " H" + std::to_string(H) + " Hk" + std::to_string(Hk) +
                  " G" + std::to_string(G) + " T" + std::to_string(T) + " S" + std::to_string(S) +
                  " D" + std::to_string(D) + " Dv" + std::to_string(Dv) + " pre=" + pre.str() +
                  " post=" + post.str() + (causal ? " causal" : " full");
  if (window) s += " window" + std::to_string(window);
  if (scale > 0) s += " scale" + std::to_string(scale);
  if (score_scale != 1) s += " score_scale" + std::to_string(score_scale);
  s += lengths_str("qlen", qlen) + lengths_str("klen", klen);
  for (int i = 0; i < kActs; ++i)
    if (!act[size_t(i)].is_dense()) s += std::string(" ") + names[i] + "=" + act[size_t(i)].str();
  if (!lse.is_dense()) s += " lse=" + lse.str();
  if (compose_layout) s += " compose_layout" + std::to_string(compose_layout);
  if (!with_lse) s += " no-lse";
  if (workspace) s += " workspace";
  if (with_out) s += " out-given";
  return s;
}

inline std::string DecodeCase::str() const {
  static const char* const names[] = {"q_new", "k_new", "v_new", "out"};
  std::string s =
      "B" + std::to_string(B) + " H" + std::to_string(H) + " Hk" + std::to_string(Hk) + " G" +
      std::to_string(G) + " D" + std::to_string(D) + " Dv" + std::to_string(Dv) +
      " pre=" + pre.str() + " post=" + post.str() +
      (window ? " window" + std::to_string(window) : " capacity" + std::to_string(capacity)) +
      " max_step" + std::to_string(max_step);
  if (scale > 0) s += " scale" + std::to_string(scale);
  if (cfg_window) s += " cfg-window";
  if (workspace) s += " workspace";
  if (caller_memory) s += " caller-memory";
  for (int i = 0; i < 4; ++i)
    if (!act[size_t(i)].is_dense()) s += std::string(" ") + names[i] + "=" + act[size_t(i)].str();
  if (compose_layout) s += " compose_layout" + std::to_string(compose_layout);
  s += " steps:";
  for (const DecodeStep& st : steps) {
    if (st.kind == DecodeStep::reset) s += " reset";
    if (st.kind == DecodeStep::repeat) s += " again";
    if (st.kind == DecodeStep::broken) s += " broken" + st.brk.str().substr(6);
    if (st.kind != DecodeStep::append) continue;
    s += " " + std::to_string(st.n);
    if (!st.counts.empty()) s += lengths_str("", st.counts).substr(1);
  }
  return s + (config_break.on() ? " config" + config_break.str() : "");
}

inline std::string ProjectionCase::str() const {
  return "B" + std::to_string(B) + " L" + std::to_string(L) + " E" + std::to_string(E) + " G" +
         std::to_string(G) + " K" + std::to_string(K) + " R" + std::to_string(R) + " M" +
         std::to_string(M) + (tanh_gelu ? " tanh" : " erf") + " eps" + std::to_string(eps) +
         " in_layout" + std::to_string(in_layout) + " out_layout" + std::to_string(out_layout) +
         (backward ? " backward" : "") + (keep ? " keep" : "");
}

}  // namespace dcmha::fuzz
