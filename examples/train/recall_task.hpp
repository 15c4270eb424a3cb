#pragma once
// Two-hop associative recall, the task train_recall learns.
//
// A sequence lists N key -> value pairs over an alphabet of S symbols, one pair per position,
// then a query key a at the last position. The N keys are distinct and every value is itself one
// of the sequence's keys, so the pairs define a map f from the keys to the keys; the answer to
// the query is f(f(a)): look up a's value b, then b's value. Nothing about f carries over from
// one sequence to the next: the model has to read both hops out of the context.
//
// Tokens are rows of one embedding table of 3S rows, one block per role: key k is row k, value v
// row S + v, query a row 2S + a. A pair position carries two tokens, its key and its value (the
// model sums their embeddings: a pair token with a factored embedding), the query position one.
#include <dcmha/tensor.hpp>

#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace recall {

using dcmha::index_t;

struct TaskConfig {
  index_t symbols = 32;  ///< S: the alphabet of keys and values, and the answer's classes
  index_t pairs = 12;    ///< N <= S pairs per sequence (keys are distinct)

  index_t length() const { return pairs + 1; }   ///< T: the pairs and the query
  index_t vocab() const { return 3 * symbols; }  ///< embedding rows: keys, values, queries
};

/// A batch of B sequences of T positions.
struct Batch {
  index_t B = 0, T = 0;
  std::vector<int> tokens;   ///< (B, T, 2) embedding rows; -1: none (the query's second slot)
  std::vector<int> answers;  ///< (B): f(f(query)), a symbol in [0, S)
};

inline int uniform_below(int n, std::mt19937& rng) {
  return std::uniform_int_distribution<int>(0, n - 1)(rng);
}

/// One sequence: tokens (T, 2) and its answer.
inline void write_sequence(const TaskConfig& task, std::mt19937& rng, int* tokens, int* answer) {
  const int S = static_cast<int>(task.symbols), N = static_cast<int>(task.pairs);
  // The first N entries of a partial shuffle: N distinct keys, in random order.
  std::vector<int> keys(static_cast<std::size_t>(S));
  std::iota(keys.begin(), keys.end(), 0);
  for (int i = 0; i < N; ++i) std::swap(keys[i], keys[i + uniform_below(S - i, rng)]);
  // f as indices: the value of pair i is the key of pair next[i].
  std::vector<int> next(static_cast<std::size_t>(N));
  for (int& n : next) n = uniform_below(N, rng);
  for (int i = 0; i < N; ++i) {
    tokens[2 * i] = keys[i];
    tokens[2 * i + 1] = S + keys[next[i]];
  }
  const int query = uniform_below(N, rng);
  tokens[2 * N] = 2 * S + keys[query];
  tokens[2 * N + 1] = -1;
  *answer = keys[next[next[query]]];
}

inline Batch make_batch(const TaskConfig& task, index_t B, std::mt19937& rng) {
  Batch batch;
  batch.B = B;
  batch.T = task.length();
  batch.tokens.resize(static_cast<std::size_t>(B * batch.T * 2));
  batch.answers.resize(static_cast<std::size_t>(B));
  for (index_t b = 0; b < B; ++b)
    write_sequence(task, rng, &batch.tokens[static_cast<std::size_t>(b * batch.T * 2)],
                   &batch.answers[static_cast<std::size_t>(b)]);
  return batch;
}

}  // namespace recall
