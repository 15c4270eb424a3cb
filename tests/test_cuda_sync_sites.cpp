// Every synchronization of the CUDA kernels is needed, and the emulator proves it: each block
// barrier, cluster barrier, warp sync and asynchronous-copy wait that a set of small problems
// reaches is deleted in turn (emulator::Mutation makes its calls do nothing), and each deletion
// must be caught: a race the emulator reports, a deadlock or divergent warp, or results off the
// reference. The test prints the list.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "support/emulated_kernels.hpp"

#include "reference/reference.hpp"
#include "support/backend_cases.hpp"
#include "support/decode_steps.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"

namespace {

namespace em = dcmha::cuda::emulator;
using dcmha::bf16;
using dcmha::cuda::LaunchOptions;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;

/// A forward + backward of a problem in the emulator; returns the largest relative error of out
/// and every gradient against the reference (inputs rounded to T).
template <class T>
double forward_backward_error(const ProblemSpec& s, const LaunchOptions& launch, uint64_t seed,
                              bool given_output = false) {
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<T>(dcmha::test::random_problem(s, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = dcmha::test::round_to<T>(x);
  const auto [out, grads] = dcmha::reference::forward_and_backward(p, dout);
  TypedProblem<T> tp(p);
  tp.set_dout(dout);
  dcmha::cuda::emulate::forward<T>(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                   tp.compose(), launch);
  dcmha::cuda::emulate::backward<T>(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(),
                                    tp.dq(), tp.dk(), tp.dv(), tp.compose(), tp.dcompose(), launch,
                                    given_output ? tp.out() : dcmha::TensorView<const T, 4>{});
  double worst = dcmha::test::max_rel_error(out, tp.out_values());
  for (const auto& e : dcmha::test::gradient_errors(grads, tp.gradients()))
    worst = std::max(worst, e.rel);
  return worst;
}

/// The problems: each kernel's paths (MHA in fragments, one pass, two passes, statistics by key
/// column, float through tiles), clusters, static W, GQA, split keys (kept scores too); every one
/// crosses several key and query tiles.
struct SyncCase {
  std::string name;
  double tolerance;
  std::function<double()> run;
};

std::vector<SyncCase> cases() {
  ProblemSpec s;
  s.B = 1, s.H = 4, s.Hk = 2, s.G = 1, s.T = 40, s.S = 70, s.D = 16, s.Dv = 16, s.Rq = 2, s.Rk = 1;
  s.causal = true;
  std::vector<SyncCase> out;
  ProblemSpec mha = s;
  mha.G = 4, mha.pre = mha.post = SideSpec::none();
  out.push_back(
      {"mha bf16 (fragments)", 3e-2, [=] { return forward_backward_error<bf16>(mha, {}, 1); }});
  out.push_back(
      {"mha float (tiles)", 2e-4, [=] { return forward_backward_error<float>(mha, {}, 2); }});
  ProblemSpec pre = s;
  pre.pre = SideSpec::dynamic(), pre.post = SideSpec::none();
  out.push_back({"pre only bf16 (one pass)", 3e-2,
                 [=] { return forward_backward_error<bf16>(pre, dcmha::test::tiles(0, 2), 3); }});
  ProblemSpec dynamic = s;
  dynamic.pre = dynamic.post = SideSpec::dynamic();
  out.push_back({"dynamic terms bf16, cluster 2 (two passes)", 3e-2, [=] {
                   return forward_backward_error<bf16>(dynamic, dcmha::test::tiles(0, 2), 7);
                 }});
  // 8 heads in a group: the compose lanes keep the row statistics by key column.
  ProblemSpec eight = dynamic;
  eight.H = 8, eight.Hk = 4;
  out.push_back({"dynamic terms bf16, 8 heads, cluster 4 (statistics by key column)", 3e-2, [=] {
                   return forward_backward_error<bf16>(eight, dcmha::test::tiles(0, 4), 10);
                 }});
  ProblemSpec all = s;
  all.pre = all.post = SideSpec::all();
  out.push_back({"all terms float, cluster 2", 2e-4,
                 [=] { return forward_backward_error<float>(all, dcmha::test::tiles(16, 2), 4); }});
  // 32 heads in a group: the compose items' heads split over lanes, static W mixing them.
  ProblemSpec wide = s;
  wide.H = wide.Hk = 32, wide.T = 20, wide.S = 40, wide.pre = wide.post = SideSpec::all();
  out.push_back({"32 heads, all terms float, cluster 8", 2e-4,
                 [=] { return forward_backward_error<float>(wide, {}, 6); }});
  LaunchOptions one_split;  // the one pass in two rounds of one key block
  one_split.key_splits = 1;
  ProblemSpec one_pass = mha;
  one_pass.T = 140, one_pass.S = 150;
  out.push_back({"mha bf16, one pass (two rounds)", 3e-2,
                 [=] { return forward_backward_error<bf16>(one_pass, one_split, 8, true); }});
  ProblemSpec split = s;
  split.T = 3, split.S = 140;
  out.push_back({"split keys bf16", 3e-2, [=] {
                   return forward_backward_error<bf16>(split, dcmha::test::tiles(0, 4, 3), 5);
                 }});
  LaunchOptions kept = dcmha::test::tiles(0, 4, 3);  // the values launch reads kept scores
  kept.split_scores = dcmha::cuda::SplitScores::kept;
  out.push_back({"split keys bf16, kept scores", 3e-2,
                 [=] { return forward_backward_error<bf16>(split, kept, 9); }});
  return out;
}

TEST(CudaSyncSites, EveryBarrierWarpSyncAndCopyWaitIsNeeded) {
  em::Mutation& mutation = em::Mutation::get();
  const std::vector<SyncCase> all = cases();
  // The sites each case reaches, unmutated (and the case passing).
  std::map<em::SyncSite, std::vector<size_t>> reached;
  for (size_t i = 0; i < all.size(); ++i) {
    mutation.forget_seen();
    const double error = all[i].run();
    ASSERT_LE(error, all[i].tolerance) << all[i].name;
    for (const em::SyncSite& site : mutation.seen()) reached[site].push_back(i);
  }
  ASSERT_GT(reached.size(), 10u);
  std::printf("%-64s  %s\n", "synchronization deleted", "caught by");
  int uncaught = 0;
  for (const auto& [site, users] : reached) {
    mutation.disable(site);
    std::string how;
    for (size_t i : users) {
      try {
        const double error = all[i].run();
        if (error > all[i].tolerance) how = "wrong results (" + all[i].name + ")";
      } catch (const em::EmulationError& e) {
        const std::string what = e.what();
        how = (what.find("deadlock") != std::string::npos ? "deadlock"
               : what.find("exit") != std::string::npos   ? "a peer's exit"
                                                          : "divergent warp") +
              std::string(" (") + all[i].name + ")";
      } catch (const std::logic_error&) {
        how = "race report (" + all[i].name + ")";
      }
      if (!how.empty()) break;
    }
    mutation.clear();
    if (how.empty()) ++uncaught;
    std::printf("%-64s  %s\n", site.str().c_str(), how.empty() ? "NOT CAUGHT" : how.c_str());
  }
  EXPECT_EQ(uncaught, 0);
}

}  // namespace
