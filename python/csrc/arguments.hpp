#pragma once
// Argument plumbing the operators share: compose entry lists, per-sequence length tensors, and
// the library's errors as torch's.
#include <ATen/ATen.h>

#include <dcmha/config.hpp>
#include <dcmha/error.hpp>

#include <new>

#include "call.hpp"

namespace dcmha_torch {

using OptionalTensorList = c10::List<c10::optional<at::Tensor>>;

/// A `Tensor?[]` argument of 0 or 14 compose entries as ComposeEntries (undefined where None).
inline ComposeEntries entries_of(const char* fn, const char* name, const OptionalTensorList& list) {
  TORCH_CHECK(list.size() == 0 || list.size() == kComposeEntries, fn, ": ", name,
              ": expected 0 entries (none) or ", kComposeEntries,
              " (pre, then post: sw, qw1, qw2, kw1, kw2, qdd, kdd), got ", list.size());
  ComposeEntries e;
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::optional<at::Tensor> t = list.get(i);
    if (t.has_value()) e[i] = *t;
  }
  return e;
}

/// f(T{}) for the storage type T of dtype (float32, float64, bfloat16, float16); any other dtype
/// is an error naming `name`, the tensor whose dtype the call takes.
template <class F>
decltype(auto) typed(const char* fn, const char* name, at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kDouble:
      return f(double{});
    case at::kBFloat16:
      return f(dcmha::bf16{});
    case at::kHalf:
      return f(dcmha::half{});
    default:
      TORCH_CHECK(false, fn, ": ", name, " has dtype ", dtype,
                  ", expected float32, float64, bfloat16 or float16");
  }
}

/// Per-sequence lengths (or counts): undefined, or a 1-d int64 CPU tensor.
inline void check_lengths(const char* fn, const char* name, const at::Tensor& t) {
  if (!t.defined()) return;
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " is on ", t.device(),
              ", expected a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1, fn, ": ", name,
              ": expected a 1-d int64 tensor of B values, got ", t.scalar_type(), " of ", t.dim(),
              " dims");
}

/// Runs f, turning the library's errors into c10::Error (RuntimeError in Python) with its
/// message.
template <class F>
void translating_errors(F&& f) {
  try {
    f();
  } catch (const dcmha::Error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK(false, "dcmha: out of memory: ", e.what());
  }
}

}  // namespace dcmha_torch
