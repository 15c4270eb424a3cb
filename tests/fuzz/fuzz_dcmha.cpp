// The fuzzer: input bytes -> one problem (decode_input.hpp) -> the library against the
// reference, or, for an invalid problem, against the contract that it throws dcmha::Error and
// writes nothing. Any finding prints "fuzz mismatch: ..." and aborts.
//
// Built two ways from this one file:
//   - with clang's libFuzzer (-fsanitize=fuzzer, DCMHA_FUZZ_LIBFUZZER defined):
//   LLVMFuzzerTestOneInput
//     only; libFuzzer supplies main(), the corpus handling and the mutations;
//   - otherwise as a plain driver with its own main(): it runs every file of the corpus
//     directories and files given, then random byte strings for --seconds or --runs, and prints
//     a summary line. An input that fails is saved as fuzz-mismatch-<hash> in the working dir.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "attention_check.hpp"
#include "byte_reader.hpp"
#include "decode_check.hpp"
#include "decode_input.hpp"
#include "projection_check.hpp"
#include "report.hpp"

namespace dcmha::fuzz {

/// DCMHA_FUZZ_VERBOSE=1 prints every problem before it runs (to see what a corpus holds).
inline bool verbose() {
  static const bool on = [] {
    const char* v = std::getenv("DCMHA_FUZZ_VERBOSE");
    return v && *v && *v != '0';
  }();
  return on;
}

inline void run_input(const std::uint8_t* data, std::size_t size) {
  ByteReader in(data, size);
  const FuzzCase c = CaseDecoder(in).read();
  current_problem() = c.str();
  if (verbose()) std::fprintf(stderr, "fuzz problem: %s\n", current_problem().c_str());
  switch (c.op) {
    case Op::forward:
    case Op::backward:
      check_attention(c);
      break;
    case Op::decode:
      check_decode(c);
      break;
    case Op::projection:
      check_projection(c);
      break;
  }
}

}  // namespace dcmha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dcmha::fuzz::run_input(data, size);
  return 0;
}

#ifndef DCMHA_FUZZ_LIBFUZZER
namespace {

namespace fs = std::filesystem;

/// The input being run, saved by the mismatch hook before abort().
std::vector<std::uint8_t>& current_input() {
  static std::vector<std::uint8_t> bytes;
  return bytes;
}

void save_current_input() {
  const std::vector<std::uint8_t>& in = current_input();
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (std::uint8_t b : in) h = (h ^ b) * 1099511628211ull;
  char name[64];
  std::snprintf(name, sizeof name, "fuzz-mismatch-%016llx", static_cast<unsigned long long>(h));
  std::ofstream(name, std::ios::binary)
      .write(reinterpret_cast<const char*>(in.data()), std::streamsize(in.size()));
  std::fprintf(stderr, "fuzz_dcmha: input saved as %s\n", name);
}

void run(const std::vector<std::uint8_t>& bytes) {
  current_input() = bytes;
  LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
}

std::vector<std::uint8_t> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f),
                                   std::istreambuf_iterator<char>());
}

/// Every file given, and every regular file of every directory given, in name order.
std::vector<fs::path> corpus_files(const std::vector<std::string>& paths) {
  std::vector<fs::path> files;
  for (const std::string& p : paths) {
    if (!fs::is_directory(p)) {
      files.emplace_back(p);
      continue;
    }
    std::vector<fs::path> dir;
    for (const auto& e : fs::directory_iterator(p))
      if (e.is_regular_file()) dir.push_back(e.path());
    std::sort(dir.begin(), dir.end());
    files.insert(files.end(), dir.begin(), dir.end());
  }
  return files;
}

struct Options {
  double seconds = 0;
  long runs = 0;
  std::uint64_t seed = 1;
  std::size_t max_len = 512;
  std::vector<std::string> paths;
};

int usage() {
  std::fprintf(
      stderr,
      "usage: fuzz_dcmha [--seconds S] [--runs N] [--seed X] [--max-len N] [corpus dir or "
      "file]...\n"
      "Runs every corpus file, then random inputs for S seconds or N runs (whichever ends first\n"
      "when both are given).\n");
  return 2;
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--seconds" && has_value)
      o.seconds = std::stod(argv[++i]);
    else if (a == "--runs" && has_value)
      o.runs = std::stol(argv[++i]);
    else if (a == "--seed" && has_value)
      o.seed = std::stoull(argv[++i]);
    else if (a == "--max-len" && has_value)
      o.max_len = std::stoul(argv[++i]);
    else if (a.rfind("--", 0) == 0)
      return false;
    else
      o.paths.push_back(a);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return usage();
  dcmha::fuzz::on_mismatch() = &save_current_input;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  long files = 0, random = 0;
  for (const fs::path& f : corpus_files(o.paths)) {
    run(read_file(f));
    ++files;
  }
  std::mt19937_64 rng(o.seed);
  const bool by_time = o.seconds > 0, by_runs = o.runs > 0;
  double report_at = 10;
  while ((by_time || by_runs) && (!by_time || elapsed() < o.seconds) &&
         (!by_runs || random < o.runs)) {
    std::vector<std::uint8_t> bytes(rng() % (o.max_len + 1));
    for (std::uint8_t& b : bytes) b = static_cast<std::uint8_t>(rng());
    run(bytes);
    ++random;
    if (elapsed() >=
        report_at) {  // progress, and a run count for scripts/fuzz.sh if a later input fails
      std::printf("fuzz_dcmha: %ld runs so far\n", files + random);
      std::fflush(stdout);
      report_at += 10;
    }
  }
  std::printf(
      "fuzz_dcmha: %ld runs (%ld corpus files, %ld random inputs) in %.1f s, 0 mismatches\n",
      files + random, files, random, elapsed());
  return 0;
}
#endif
