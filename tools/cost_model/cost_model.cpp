// The CUDA kernels' cost model: our MHA and DCMHA forward and backward at the GPU benchmark's
// shapes (bf16, B4/H32/D128, causal, T 2048 and 4096), from the emulator's counts (emulated
// on small problems with the benchmark's launch plans, extrapolated in T), over the H200's
// ceilings, beside FlashAttention-2's algorithm for MHA counted the same way; then a decode
// step (B8/H32, a cache of 4096 keys) beside the time of reading its cache once from HBM. A
// model, not a measurement: the GPU benchmark (scripts/gpu_check.sh) replaces it.
//
//   dcmha_cost_model [--sites] [--head-dim D] [T...]     (default: D 128, T 2048 4096)
//
// --sites: each kernel's call sites by their share of its shared-memory cycles, DSMEM bytes and
// L2 sectors, in the longest emulated run (where a kernel's cycles go, for its next change).
// --head-dim: D = Dv of every case, a multiple of 8 from 72 to 128 (FlashAttention-2's tiles for
// its head-dim classes 96 and 128 are the ones modeled); DCFormer-2.8B's is 80.
#include <algorithm>
#include <array>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "decode_work.hpp"
#include "emulated_work.hpp"
#include "flash_attention_model.hpp"
#include "h200_model.hpp"

namespace {

using dcmha::index_t;
using namespace dcmha::cost_model;

/// The scaling check's limit: with every array aligned as on the device, the counts are
/// quadratics in T, so anything beyond rounding means the extrapolation's premise broke.
constexpr double kLargestFitError = 1e-6;

/// An operation's modeled time: each launch bounded by its slowest unit (overlapped) or by the
/// sum of its units (serialized); launches run one after another.
struct Modeled {
  double overlapped = 0, serialized = 0;
  ModeledTime units;  // summed over launches

  void add_launch(const Work& w) {
    const ModeledTime t = modeled_time(w);
    overlapped += t.overlapped(), serialized += t.serialized();
    units += t;
  }
  Modeled& operator+=(const Modeled& o) {
    overlapped += o.overlapped, serialized += o.serialized, units += o.units;
    return *this;
  }
};

Modeled ours(const OperationWork& op) {
  Modeled m;
  for (const auto& [kernel, w] : op.kernels) m.add_launch(w);
  // The compulsory HBM traffic bounds the operation as a whole (each launch's L2 traffic bounds
  // the launch); serialized, HBM and L2 count as the larger of the two over the operation.
  const double hbm = modeled_time(op.total).hbm;
  m.overlapped = std::max(m.overlapped, hbm);
  m.serialized += std::max(0.0, hbm - m.units.l2);
  m.units.hbm = hbm;
  return m;
}

Modeled flash(const Work& w) {
  Modeled m;
  m.add_launch(w);
  return m;
}

double ms(double seconds) { return seconds * 1e3; }

void print_units(const char* what, const Modeled& m) {
  const ModeledTime& u = m.units;
  std::printf(
      "  %-20s tensor %6.3f  fma %6.3f  exp %6.3f  shared %6.3f  L2 %6.3f  HBM %6.3f  "
      "DSMEM %6.3f ms  (largest: %s)\n",
      what, ms(u.tensor), ms(u.fma), ms(u.exp), ms(u.shared), ms(u.l2), ms(u.hbm), ms(u.peer),
      u.bound());
}

/// An operation's launches one by one: each kernel's modeled time (overlapped) and its
/// largest unit, where an operation's time goes before its call sites are read.
void print_kernels(const char* what, const OperationWork& op) {
  std::printf("  %-20s", what);
  const char* separator = "";
  for (const auto& [kernel, w] : op.kernels) {
    const ModeledTime t = modeled_time(w);
    std::printf("%s %s %.3f ms (%s)", separator, kernel.c_str(), ms(t.overlapped()), t.bound());
    separator = ",";
  }
  std::printf("\n");
}

/// The step of a barrier's latency the barrier lines price (a sensitivity, not a figure of the
/// H200's: the ceilings are throughputs, and a barrier's wait is latency).
constexpr double kBarrierLatencyStep = 100e-9;

/// The barriers an operation's blocks wait at, per multiprocessor, and what each
/// kBarrierLatencyStep of a barrier's latency adds where no other block on the multiprocessor
/// has work to fill the wait (DCMHA's blocks take a multiprocessor each).
void print_barriers(const char* what, const Work& w) {
  const Ceilings c;
  const double block = w.block_barriers / c.multiprocessors;
  const double cluster = w.cluster_barriers / c.multiprocessors;
  std::printf("  %-28s block %7.0f (%6.3f ms)  cluster %7.0f (%6.3f ms)\n", what, block,
              ms(block * kBarrierLatencyStep), cluster, ms(cluster * kBarrierLatencyStep));
}

/// The step of the time between two launches the launch lines price (a sensitivity, as the
/// barriers': the model runs an operation's launches back to back).
constexpr double kLaunchGapStep = 1e-6;

/// An operation's launches and what each kLaunchGapStep between launches adds.
void print_launches(const char* what, int launches) {
  std::printf("  %-28s %3d (%6.3f ms)\n", what, launches, ms(launches * kLaunchGapStep));
}

const char* verdict(double ratio, double target) { return ratio <= target ? "met" : "missed"; }

/// One row of the table: FA2, ours, the ratio and its target.
void print_row(const std::string& what, const Modeled& fa2, const Modeled& mine, double target) {
  const double r_over = mine.overlapped / fa2.overlapped;
  const double r_serial = mine.serialized / fa2.serialized;
  std::printf("| %-26s | %7.3f / %7.3f | %7.3f / %7.3f | %5.2fx / %5.2fx | <= %.1fx: %s / %s |\n",
              what.c_str(), ms(fa2.overlapped), ms(fa2.serialized), ms(mine.overlapped),
              ms(mine.serialized), r_over, r_serial, target, verdict(r_over, target),
              verdict(r_serial, target));
}

/// Each operation's work per (query, key) pair the causal mask lets through, B H T (T + 1) / 2
/// of them (the table docs/design.md quotes).
void print_per_pair(const BenchmarkShape& s,
                    const std::vector<std::pair<const char*, const Work*>>& rows) {
  const double pairs = double(s.B) * double(s.H) * double(s.T) * double(s.T + 1) / 2;
  std::printf(
      "per (query, key) pair:\n| | tensor-core FLOP | CUDA-core FLOP | exp | shared B | L2 B | "
      "HBM B | DSMEM B |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto& [what, w] : rows)
    std::printf("| %s | %.0f | %.0f | %.2f | %.0f | %.1f | %.2f | %.0f |\n", what,
                w->mma * 4096 / pairs, w->fma * 2 / pairs, w->exp / pairs,
                w->shared_wavefronts * 128 / pairs, w->l2_bytes / pairs, w->hbm_bytes / pairs,
                w->peer_bytes / pairs);
}

void print_plan(const Plans& p, bool dcmha) {
  const auto& f = p.forward.geo;
  const auto& q = p.backward.query;
  const auto& k = p.backward.key;
  std::printf(
      "  %s plan: forward %d rows x %d-block cluster, %d warps of %d rows, %lld B shared, "
      "%d split(s); ",
      dcmha ? "DCMHA" : "MHA", f.rows, f.cluster, f.warps, f.warp_rows, (long long)f.shared_bytes,
      f.splits);
  if (p.backward.one_pass)
    std::printf(
        "backward in one pass, %d keys a block over %d-row query tiles, %lld B shared, "
        "%d split(s) a round, %d rounds\n",
        k.rows, k.stream_rows, (long long)k.shared_bytes, k.key_splits, p.backward.key_rounds);
  else
    std::printf("backward query side %d rows, key side %d keys, cluster %d, %lld / %lld B\n",
                q.rows, k.rows, q.cluster, (long long)q.shared_bytes, (long long)k.shared_bytes);
}

double percent(double part, double whole) { return whole > 0 ? 100.0 * part / whole : 0.0; }

/// The share of a unit's counts (percent) that gives a call site its own row.
constexpr double kLeastSiteShare = 1.0;

/// One kernel's call sites with at least kLeastSiteShare of a unit's counts, the largest
/// shared-memory users first, then the rest together.
void print_kernel_sites(const std::string& kernel, const dcmha::cuda::emulator::Counters& c) {
  using dcmha::cuda::emulator::SiteCounts;
  auto shared = [](const SiteCounts& s) { return double(s.shared_wavefronts + s.shuffles); };
  SiteCounts total;
  std::vector<std::pair<std::string, SiteCounts>> sites(c.sites.begin(), c.sites.end());
  for (const auto& [site, counts] : sites) total += counts;
  std::stable_sort(sites.begin(), sites.end(), [&](const auto& x, const auto& y) {
    return shared(x.second) > shared(y.second);
  });
  auto shares = [&](const SiteCounts& s) {  // shared cycles, DSMEM bytes, L2 sectors
    return std::array<double, 3>{
        percent(shared(s), shared(total)),
        percent(double(s.peer_shared_bytes), double(total.peer_shared_bytes)),
        percent(double(s.global_sectors), double(total.global_sectors))};
  };
  auto row = [&](const std::string& name, const SiteCounts& s) {
    const std::array<double, 3> p = shares(s);
    std::printf("| %s | %.1f%% | %.1f%% | %.1f%% |\n", name.c_str(), p[0], p[1], p[2]);
  };
  std::printf("\n%s: %zu sites\n| site | shared | DSMEM | L2 |\n|---|---|---|---|\n",
              kernel.c_str(), sites.size());
  SiteCounts rest;
  int rest_sites = 0;
  for (const auto& [site, s] : sites) {
    const std::array<double, 3> p = shares(s);
    if (*std::max_element(p.begin(), p.end()) >= kLeastSiteShare)
      row(site, s);
    else
      rest += s, ++rest_sites;
  }
  if (rest_sites > 0) row(std::to_string(rest_sites) + " other sites", rest);
}

void print_sites(const char* what, const EmulatedWork& w) {
  const char* operation[2] = {"forward", "backward"};
  for (int op = 0; op < 2; ++op) {
    std::printf("\n%s %s, call sites' shares per kernel (emulated at T = %lld, one %s)\n", what,
                operation[op], (long long)w.lengths[3],
                std::string(what) == "DCMHA" ? "compose group" : "pair of heads");
    for (const auto& [kernel, c] : w.longest[op]) print_kernel_sites(kernel, c);
  }
}

/// Emulated runs, kept while the next shape's plan launches the same blocks.
class RunCache {
 public:
  EmulatedWork work(const BenchmarkShape& s) {
    const Plans plans = plans_of(s);
    std::vector<EmulatedRuns>& kept = s.dcmha ? dcmha_ : s.two_sided ? two_sided_ : mha_;
    for (const EmulatedRuns& r : kept)
      if (same_blocks(r.plans, plans)) return emulated_work(s, r, plans);
    kept.push_back(emulated_runs(s, plans));
    return emulated_work(s, kept.back(), plans);
  }

 private:
  std::vector<EmulatedRuns> mha_, two_sided_, dcmha_;
};

/// Every case at one shape: ours emulated (MHA, MHA with its two-sided backward, DCMHA) and
/// FlashAttention-2's MHA counted.
struct ShapeModel {
  BenchmarkShape s;  // MHA's backward shape
  EmulatedWork mha, two_sided, dcmha;
  Work fa2_forward, fa2_backward;
};

ShapeModel shape_model(index_t T, index_t head_dim, RunCache& cache) {
  ShapeModel m;
  BenchmarkShape s;
  s.T = T, s.D = head_dim;
  m.mha = cache.work(s);
  s.two_sided = true;
  m.two_sided = cache.work(s);
  s.two_sided = false, s.dcmha = true;
  m.dcmha = cache.work(s);
  s.dcmha = false;
  m.fa2_forward = flash_forward(s);
  s.backward = true;
  m.fa2_backward = flash_backward(s);
  m.s = s;
  return m;
}

/// The table: ours against FA2's, forward and forward+backward, the targets.
void print_table(const ShapeModel& m) {
  const Modeled fa2_fwd = flash(m.fa2_forward);
  Modeled fa2_all = fa2_fwd, mha_all = ours(m.mha.forward), dcmha_all = ours(m.dcmha.forward);
  Modeled two_sided_all = ours(m.mha.forward);
  fa2_all += flash(m.fa2_backward), mha_all += ours(m.mha.backward);
  dcmha_all += ours(m.dcmha.backward), two_sided_all += ours(m.two_sided.backward);
  const std::string shape = "T" + std::to_string(m.s.T);
  std::printf("\nbf16 B4/H32/D%lld %s causal (ms, overlapped / serialized)\n", (long long)m.s.D,
              shape.c_str());
  std::printf("| case | FA2 MHA | ours | ours / FA2 | target |\n|---|---|---|---|---|\n");
  print_row("MHA forward " + shape, fa2_fwd, ours(m.mha.forward), 1.3);
  print_row("MHA forward+backward " + shape, fa2_all, mha_all, 1.3);
  print_row("MHA forward+backward, two-sided " + shape, fa2_all, two_sided_all, 1.3);
  print_row("DCMHA forward " + shape, fa2_fwd, ours(m.dcmha.forward), 2.0);
  print_row("DCMHA forward+backward " + shape, fa2_all, dcmha_all, 2.5);
}

/// Where the time goes: each unit summed over launches, each backward launch, per pair.
void print_breakdown(const ShapeModel& m) {
  std::printf("units, summed over launches:\n");
  print_units("FA2 MHA forward", flash(m.fa2_forward));
  print_units("FA2 MHA backward", flash(m.fa2_backward));
  print_units("our MHA forward", ours(m.mha.forward));
  print_units("our MHA backward", ours(m.mha.backward));
  print_units("our MHA backward, two-sided", ours(m.two_sided.backward));
  print_units("our DCMHA forward", ours(m.dcmha.forward));
  print_units("our DCMHA backward", ours(m.dcmha.backward));
  std::printf("kernels, overlapped:\n");
  print_kernels("our MHA backward", m.mha.backward);
  print_kernels("our MHA backward, two-sided", m.two_sided.backward);
  print_kernels("our DCMHA backward", m.dcmha.backward);
  std::printf(
      "barriers waited at per multiprocessor, and what each %.0f ns of a barrier's latency adds "
      "where nothing fills the wait:\n",
      kBarrierLatencyStep * 1e9);
  print_barriers("our MHA forward", m.mha.forward.total);
  print_barriers("our MHA backward", m.mha.backward.total);
  print_barriers("our MHA backward, two-sided", m.two_sided.backward.total);
  print_barriers("our DCMHA forward", m.dcmha.forward.total);
  print_barriers("our DCMHA backward", m.dcmha.backward.total);
  std::printf(
      "launches an operation makes, and what each %.0f us between launches adds where nothing "
      "fills the gap:\n",
      kLaunchGapStep * 1e6);
  print_launches("FA2 MHA forward", kFlashForwardLaunches);
  print_launches("FA2 MHA backward", kFlashBackwardLaunches);
  print_launches("our MHA forward", m.mha.plans.forward_launches);
  print_launches("our MHA backward", m.mha.plans.backward_launches);
  print_launches("our MHA backward, two-sided", m.two_sided.plans.backward_launches);
  print_launches("our DCMHA forward", m.dcmha.plans.forward_launches);
  print_launches("our DCMHA backward", m.dcmha.plans.backward_launches);
  print_per_pair(m.s, {{"FA2 MHA forward", &m.fa2_forward},
                       {"our MHA forward", &m.mha.forward.total},
                       {"our DCMHA forward", &m.dcmha.forward.total},
                       {"FA2 MHA backward", &m.fa2_backward},
                       {"our MHA backward", &m.mha.backward.total},
                       {"our MHA backward, two-sided", &m.two_sided.backward.total},
                       {"our DCMHA backward", &m.dcmha.backward.total}});
  print_plan(m.mha.plans, false);
  print_plan(m.two_sided.plans, false);
  print_plan(m.dcmha.plans, true);
}

/// Prints the data check and fails where two draws of the inputs gave different counts: the
/// counts then follow the data and no extrapolation of them holds.
void check_data_independence(double difference) {
  std::printf(
      "  data check: each plan's counts at its shortest length, on a second draw of the inputs, "
      "differ by %.2g\n",
      difference);
  if (difference > 0)
    throw std::runtime_error("the data check failed: a count depends on the inputs' values, by " +
                             std::to_string(difference));
}

void model(index_t T, index_t head_dim, RunCache& cache, bool sites) {
  const ShapeModel m = shape_model(T, head_dim, cache);
  print_table(m);
  print_breakdown(m);
  const double fit =
      std::max({m.mha.forward.fit_error, m.mha.backward.fit_error, m.two_sided.backward.fit_error,
                m.dcmha.forward.fit_error, m.dcmha.backward.fit_error});
  const auto& lengths = m.dcmha.lengths;
  std::printf(
      "  scaling check: counts emulated at T = %lld, %lld, %lld predict T = %lld's within "
      "%.2g (relative)\n",
      (long long)lengths[0], (long long)lengths[1], (long long)lengths[2], (long long)lengths[3],
      fit);
  check_data_independence(std::max({m.mha.forward.data_error, m.mha.backward.data_error,
                                    m.two_sided.backward.data_error, m.dcmha.forward.data_error,
                                    m.dcmha.backward.data_error}));
  // Counts that are not the quadratic the extrapolation assumes make the table meaningless.
  if (fit > kLargestFitError)
    throw std::runtime_error("the scaling check failed: a count is off its quadratic by " +
                             std::to_string(fit));
  if (sites) {
    print_sites("MHA", m.mha);
    print_sites("MHA two-sided", m.two_sided);
    print_sites("DCMHA", m.dcmha);
  }
}

/// One decode row: ours against the floor of reading the cache (and the step's own tensors)
/// once from HBM, which a decode kernel of any design needs.
void print_decode_row(const char* what, const DecodeWork& w) {
  Work cache_once;
  cache_once.hbm_bytes = w.floor_bytes;
  const double floor = modeled_time(cache_once).hbm;
  const Modeled m = ours(w.step);
  std::printf("| %-12s | %7.3f | %7.3f / %7.3f | %5.2fx / %5.2fx |\n", what, ms(floor),
              ms(m.overlapped), ms(m.serialized), m.overlapped / floor, m.serialized / floor);
}

/// The decode step of the GPU benchmark (B8/H32, a cache of 4096 keys, one new token).
void model_decode(index_t head_dim) {
  DecodeShape s;
  s.D = head_dim;
  const DecodeWork mha = decode_work(s);
  s.dcmha = true;
  const DecodeWork dcmha = decode_work(s);
  std::printf(
      "\ndecode, bf16 B%lld/H%lld/D%lld, a cache of %lld keys a sequence, one new token (ms, "
      "overlapped / serialized)\n| case | HBM floor | ours | ours / floor |\n|---|---|---|---|\n",
      (long long)s.B, (long long)s.H, (long long)s.D, (long long)s.S);
  print_decode_row("MHA decode", mha);
  print_decode_row("DCMHA decode", dcmha);
  if (dcmha.plan.geo.scores_kept)
    std::printf(
        "DCMHA's values launch reads the composed scores its statistics launch kept (%.1f MB "
        "written and read back) instead of K and the pre-compose key-wise terms again (%.0f "
        "MB)\n",
        dcmha.kept_scores_bytes / 1e6, decode_twice_read_bytes(s) / 1e6);
  else
    std::printf(
        "DCMHA reads K and the key-wise terms twice (%.0f MB), %.0f MB of them again from HBM "
        "(past the L2's %.0f MB)\n",
        decode_twice_read_bytes(s) / 1e6, dcmha.reread_bytes / 1e6,
        dcmha.ceilings.l2_capacity / 1e6);
  std::printf("units, summed over launches:\n");
  print_units("our MHA decode", ours(mha.step));
  print_units("our DCMHA decode", ours(dcmha.step));
  std::printf("kernels, overlapped:\n");
  print_kernels("our MHA decode", mha.step);
  print_kernels("our DCMHA decode", dcmha.step);
  for (const DecodeWork* w : {&mha, &dcmha}) {
    const auto& g = w->plan.geo;
    std::printf(
        "  %s decode plan: %d rows x %d-block cluster, %d warps, %lld B shared, %d split(s)\n",
        w == &mha ? "MHA" : "DCMHA", g.rows, g.cluster, g.warps, (long long)g.shared_bytes,
        g.splits);
  }
  const double fit = std::max(mha.step.fit_error, dcmha.step.fit_error);
  std::printf(
      "  scaling check: counts emulated at S = %lld, %lld, %lld (DCMHA) predict S = %lld's "
      "within %.2g (relative)\n",
      (long long)dcmha.lengths[0], (long long)dcmha.lengths[1], (long long)dcmha.lengths[2],
      (long long)dcmha.lengths[3], fit);
  check_data_independence(std::max(mha.step.data_error, dcmha.step.data_error));
  if (fit > kLargestFitError)
    throw std::runtime_error("the decode scaling check failed: a count is off its line by " +
                             std::to_string(fit));
}

/// The command line: --sites, --head-dim D and sequence lengths, each a positive integer.
struct Arguments {
  bool sites = false;
  index_t head_dim = 128;
  std::vector<index_t> lengths;
};

/// arg as a whole integer, or -1.
long long integer_of(const std::string& arg) {
  std::size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(arg, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  return used == arg.size() ? value : -1;
}

Arguments parse_arguments(int argc, char** argv) {
  Arguments a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sites") {
      a.sites = true;
    } else if (arg == "--head-dim") {
      const std::string value = i + 1 < argc ? argv[++i] : "";
      const long long D = integer_of(value);
      if (D < 72 || D > 128 || D % 8 != 0)
        throw std::invalid_argument("--head-dim '" + value +
                                    "': expected a multiple of 8 from 72 to 128");
      a.head_dim = index_t(D);
    } else {
      const long long T = integer_of(arg);
      if (T < 1)
        throw std::invalid_argument(
            "argument '" + arg + "': expected --sites, --head-dim D or a sequence length T >= 1");
      a.lengths.push_back(index_t(T));
    }
  }
  if (a.lengths.empty()) a.lengths = {2048, 4096};
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Arguments arguments;
  try {
    arguments = parse_arguments(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "dcmha_cost_model: %s\nusage: dcmha_cost_model [--sites] [--head-dim D] [T...]\n",
                 e.what());
    return 2;
  }
  dcmha::cuda::emulator::Counting::sites() = arguments.sites;
  const Ceilings c;
  std::printf(
      "dcmha cost model (a model, not a measurement): H200 ceilings %.0f TFLOP/s bf16, "
      "%.0f TFLOP/s fp32, %.1f TB/s HBM; assumed %.0f TB/s L2, %.1f TB/s DSMEM, %.2f GHz\n",
      c.tensor_flops / 1e12, c.fp32_flops / 1e12, c.hbm_bytes / 1e12, c.l2_bytes / 1e12,
      c.peer_bytes / 1e12, c.clock_hz / 1e9);
  std::printf(
      "overlapped: each launch takes its slowest unit's time (tensor cores, FMA, "
      "exponentials, shared memory, L2, HBM and DSMEM run concurrently); serialized: "
      "the units' times add up\n");
  try {
    RunCache cache;
    for (index_t T : arguments.lengths) model(T, arguments.head_dim, cache, arguments.sites);
    model_decode(arguments.head_dim);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcmha_cost_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
