// Greedy generation with dcmha::DecodeCache, MHA and DCMHA, checked against the full forward.
//
// A small DCFormer-style model (tiny_model.hpp: attention-only blocks, the official "LGLL" window
// pattern, random weights from a seed) prefills a random prompt in chunks and generates token by
// token (decoder.hpp). Then the full-sequence forward runs over the prompt and the generated
// tokens, and every layer's attention output and the logits at every position must agree with
// the decoder's, and so must every greedy token. Prints the check and a table of prefill and
// decode speed. Exit status 0 only when every check passes.
//
//   decode_example                 default sizes (prompt 300 > window 256: the rings wrap)
//   decode_example --test          small sizes for CI (window 8), also requires the rings to wrap
//   options: --window N --prompt N --tokens N --chunk N --layers N --seed N --repeats N
//            --mode mha|dcmha|both
#include "decoder.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using tiny::index_t;

// Both paths compute the same float32 math; only the order of the sums differs (the dense
// products over n new rows against all T rows, the attention core's key tiles against the
// decode's ring). Each such difference is a few float ulps (1.2e-7) per sum, grown somewhat
// through the layers; 1e-4 of the tensor's largest value leaves a wide margin above that while
// any real error (a wrong key, position, window or compose term) is of the order of the values.
constexpr double kTolerance = 1e-4;

const char* const kUsage =
    "usage: decode_example [--test] [--window N] [--prompt N] [--tokens N] [--chunk N]\n"
    "                      [--layers N] [--seed N] [--repeats N] [--mode mha|dcmha|both]\n";

struct Options {
  tiny::ModelConfig model;
  index_t prompt = 300, new_tokens = 256, chunk = 64;
  int repeats = 3;  // generations per mode; the fastest is reported
  bool test = false, run_mha = true, run_dcmha = true, help = false;
};

/// Small sizes for CI: a prompt longer than the window, GQA, a few tokens.
void use_test_sizes(Options& o) {
  o.test = true;
  o.model.vocab = 64;
  o.model.E = 64;
  o.model.H = 4;
  o.model.Hk = 2;
  o.model.D = 16;
  o.model.window = 8;
  o.prompt = 20;
  o.new_tokens = 12;
  o.chunk = 4;
  o.repeats = 1;
}

index_t parse_count(const char* flag, const char* text) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < 1)
    throw std::invalid_argument(std::string(flag) + ": expected a positive integer, got '" + text +
                                "'");
  return static_cast<index_t>(v);
}

void apply_flag(Options& o, const std::string& flag, const char* value) {
  if (flag == "--mode") {
    const std::string m = value;
    if (m != "mha" && m != "dcmha" && m != "both")
      throw std::invalid_argument("--mode: expected mha, dcmha or both, got '" + m + "'");
    o.run_mha = m != "dcmha";
    o.run_dcmha = m != "mha";
    return;
  }
  const index_t v = parse_count(flag.c_str(), value);
  if (flag == "--window")
    o.model.window = v;
  else if (flag == "--prompt")
    o.prompt = v;
  else if (flag == "--tokens")
    o.new_tokens = v;
  else if (flag == "--chunk")
    o.chunk = v;
  else if (flag == "--layers")
    o.model.layers = v;
  else if (flag == "--seed")
    o.model.seed = static_cast<std::uint32_t>(v);
  else if (flag == "--repeats")
    o.repeats = static_cast<int>(v);
  else
    throw std::invalid_argument("unknown option " + flag);
}

/// --test first (it sets the sizes), then every other flag over it, in order.
Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--test") == 0) use_test_sizes(o);
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--test") continue;
    if (flag == "--help") {
      o.help = true;
      return o;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": expected a value");
    apply_flag(o, flag, argv[++i]);
  }
  return o;
}

std::vector<int> random_prompt(const tiny::ModelConfig& m, index_t length) {
  std::mt19937 rng(m.seed + 1);
  std::uniform_int_distribution<int> token(0, static_cast<int>(m.vocab) - 1);
  std::vector<int> p(tiny::sz(length));
  for (int& t : p) t = token(rng);
  return p;
}

/// max |got - want| / max |want|.
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return diff / std::max(scale, 1e-30);
}

struct CheckResult {
  double attention_error = 0.0;  // the worst layer's relative error
  index_t worst_layer = 0;
  double logits_error = 0.0;
  index_t tokens_checked = 0, token_mismatches = 0, near_ties = 0;
  bool passed = false;
};

/// Each generated token against the full forward's argmax at the position before it. A different
/// token counts as a near tie, not a mismatch, where the full forward's two logits are within the
/// tolerance (the two paths may then round either way).
void check_tokens(const tiny::ModelConfig& m, const tiny::Generation& g, const tiny::Trace& full,
                  CheckResult& r) {
  const index_t positions = static_cast<index_t>(g.tokens.size()) - 1;
  for (index_t p = g.prompt_length - 1; p < positions; ++p) {
    const float* row = full.logits.data() + p * m.vocab;
    const int want = tiny::argmax(row, m.vocab), got = g.tokens[tiny::sz(p + 1)];
    ++r.tokens_checked;
    if (got == want) continue;
    double scale = 0.0;
    for (index_t v = 0; v < m.vocab; ++v) scale = std::max(scale, std::fabs(double(row[v])));
    if (double(row[want]) - double(row[got]) <= kTolerance * scale)
      ++r.near_ties;
    else
      ++r.token_mismatches;
  }
}

CheckResult check_against_full(const tiny::ModelConfig& m, const tiny::ModelWeights& w,
                               const tiny::Generation& g) {
  const std::vector<int> fed(g.tokens.begin(), g.tokens.end() - 1);  // the last was never fed
  const tiny::Trace full = tiny::full_forward(m, w, fed);
  CheckResult r;
  for (index_t l = 0; l < m.layers; ++l) {
    const double e = relative_error(g.trace.attention[tiny::sz(l)], full.attention[tiny::sz(l)]);
    if (e > r.attention_error) {
      r.attention_error = e;
      r.worst_layer = l;
    }
  }
  r.logits_error = relative_error(g.trace.logits, full.logits);
  check_tokens(m, g, full, r);
  r.passed =
      r.attention_error <= kTolerance && r.logits_error <= kTolerance && r.token_mismatches == 0;
  return r;
}

struct ModeReport {
  const char* name = "";
  tiny::Generation best;  // the fastest generation (all give the same tokens)
  CheckResult check;
  bool passed = false;
};

ModeReport run_mode(const Options& o, bool compose) {
  tiny::ModelConfig m = o.model;
  m.compose = compose;
  const tiny::ModelWeights w = tiny::random_weights(m);
  const std::vector<int> prompt = random_prompt(m, o.prompt);
  ModeReport r;
  r.name = compose ? "DCMHA" : "MHA";
  double best_prefill = 0.0;
  for (int i = 0; i < o.repeats; ++i) {
    tiny::Generation g = tiny::generate(m, w, prompt, o.new_tokens, o.chunk);
    best_prefill = i == 0 ? g.prefill_seconds : std::min(best_prefill, g.prefill_seconds);
    if (i == 0 || g.decode_seconds < r.best.decode_seconds) r.best = std::move(g);
  }
  r.best.prefill_seconds = best_prefill;
  r.check = check_against_full(m, w, r.best);
  // The test must cover the local layers' ring buffers wrapping around.
  const bool rings_ok = !o.test || r.best.wrapped_rings == r.best.local_layers;
  r.passed = r.check.passed && rings_ok;
  return r;
}

void print_setup(const Options& o) {
  const tiny::ModelConfig& m = o.model;
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  std::printf(
      "model: vocab %lld, E %lld, H %lld, Hk %lld, D %lld, %lld layers %s (G global, L local: "
      "window %lld), qk-norm, RoPE; DCMHA G %lld R %lld; seed %u\n",
      (long long)m.vocab, (long long)m.E, (long long)m.H, (long long)m.Hk, (long long)m.D,
      (long long)m.layers, m.pattern().c_str(), (long long)m.window, (long long)m.G, (long long)m.R,
      m.seed);
  std::printf(
      "prompt %lld tokens (prefill chunks of %lld), %lld new tokens, greedy; OpenMP threads: %d\n",
      (long long)o.prompt, (long long)o.chunk, (long long)o.new_tokens, threads);
}

void print_check(const ModeReport& r) {
  const CheckResult& c = r.check;
  std::printf(
      "%-5s decode vs full forward: attention max rel err %.2e (layer %lld), logits %.2e "
      "(tolerance %.0e); tokens %lld/%lld equal, %lld near ties; rings wrapped %lld/%lld (%lld "
      "slots, %lld tokens): %s\n",
      r.name, c.attention_error, (long long)c.worst_layer, c.logits_error, kTolerance,
      (long long)(c.tokens_checked - c.token_mismatches - c.near_ties), (long long)c.tokens_checked,
      (long long)c.near_ties, (long long)r.best.wrapped_rings, (long long)r.best.local_layers,
      (long long)r.best.ring_slots, (long long)r.best.tokens.size() - 1,
      r.passed ? "PASS" : "FAIL");
}

void print_table(const std::vector<ModeReport>& reports, index_t prompt) {
  std::printf("\n| mode  | prefill (ms) | prefill tokens/s | decode tokens/s | ms/token |\n");
  std::printf("|-------|-------------:|-----------------:|----------------:|---------:|\n");
  for (const ModeReport& r : reports) {
    const tiny::Generation& g = r.best;
    std::printf("| %-5s | %12.1f | %16.0f |", r.name, 1e3 * g.prefill_seconds,
                double(prompt) / g.prefill_seconds);
    if (g.decode_steps == 0) {  // --tokens 1: the one token comes from the prefill
      std::printf(" %15s | %8s |\n", "-", "-");
      continue;
    }
    const double per_token = g.decode_seconds / double(g.decode_steps);
    std::printf(" %15.0f | %8.3f |\n", 1.0 / per_token, 1e3 * per_token);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_example: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (o.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  print_setup(o);
  std::vector<ModeReport> reports;
  bool passed = true;
  try {
    for (const bool compose : {false, true}) {
      if (!(compose ? o.run_dcmha : o.run_mha)) continue;
      reports.push_back(run_mode(o, compose));
      print_check(reports.back());
      passed = passed && reports.back().passed;
    }
  } catch (const std::exception& e) {  // dcmha::Error names the argument and the expected value
    std::fprintf(stderr, "decode_example: %s\n", e.what());
    return 1;
  }
  print_table(reports, o.prompt);
  std::printf("\n%s\n", passed ? "PASS" : "FAIL");
  return passed ? 0 : 1;
}
