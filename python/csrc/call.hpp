#pragma once
// One attention call as the PyTorch operators receive it: the tensors, the compose entries in the
// official order, and the settings; and the typed CPU calls that carry it out (one translation
// unit per scalar type: call_float.cpp, call_double.cpp, call_bf16.cpp, call_half.cpp).
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

namespace dcmha_torch {

/// The compose entries of one side, in the order the official `_atten_context` takes them.
constexpr int kSideEntries = 7;  // sw, qw1, qw2, kw1, kw2, qdd, kdd
/// Both sides: pre-softmax entries first, then post-softmax.
constexpr int kComposeEntries = 2 * kSideEntries;
/// Entry names, for messages ("pre qw1", ...).
const char* entry_name(int entry);

/// The compose entries, an undefined tensor wherever the configuration lacks one (all undefined:
/// multi-head attention).
using ComposeEntries = std::array<at::Tensor, kComposeEntries>;

/// Everything of a call that is not differentiable.
struct Settings {
  bool causal = true;
  std::int64_t window = 0;  // 0: no window; W: a query sees W keys up to its own position
  double scale = 0.0;       // 0: 1/sqrt(D)
  at::Tensor query_lengths, key_lengths;  // int64 (B) or undefined
  bool storage_type_products = false;     // dcmha::Products::storage_type, else exact
};

struct ForwardResult {
  at::Tensor out, lse;
};

struct BackwardResult {
  at::Tensor dq, dk, dv;
  ComposeEntries dcompose;  // defined where the entry is
};

struct ForwardArgs {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const ComposeEntries& compose;
  const Settings& settings;
};

struct BackwardArgs {
  ForwardArgs inputs;
  const at::Tensor& lse;
  const at::Tensor& dout;
};

/// Checks devices, dtypes and ranks that the C++ library cannot see (it takes typed views), with
/// the argument's name; dcmha's own validation checks the rest.
void check_arguments(const char* fn, const ForwardArgs& a);

/// The typed CPU calls (T: float, double, dcmha::bf16, dcmha::half). dcmha::Error becomes
/// c10::Error with the library's message.
template <class T>
ForwardResult forward_cpu(const ForwardArgs& a);
template <class T>
BackwardResult backward_cpu(const BackwardArgs& a);

}  // namespace dcmha_torch
