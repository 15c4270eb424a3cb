#include "cuda/cpu_results.hpp"

#include "support/problem.hpp"
#include "support/runs.hpp"

namespace dcmha::test {

std::vector<double> cpu_results_bf16(const reference::Problem& p, const std::vector<double>& dout,
                                     const std::vector<int64_t>& query_lengths,
                                     const std::vector<int64_t>& key_lengths) {
  TypedProblem<bf16> tp(p);
  tp.set_dout(dout);
  AttentionConfig cfg = tp.config();
  if (!query_lengths.empty()) {
    cfg.query_lengths = view<1>(query_lengths.data(), {index_t(query_lengths.size())});
    cfg.key_lengths = view<1>(key_lengths.data(), {index_t(key_lengths.size())});
  }
  forward_backward(tp, cfg);
  std::vector<double> all = tp.out_values();
  const std::vector<double> lse = tp.lse_values();
  all.insert(all.end(), lse.begin(), lse.end());
  const reference::Gradients grads = tp.gradients();
  for (auto& [name, values] : named_gradients(grads))
    all.insert(all.end(), values->begin(), values->end());
  return all;
}

}  // namespace dcmha::test
