// Concurrent callers: host threads calling dcmha at the same time, each with its own Workspace
// and DecodeCache; callers already inside an OpenMP parallel region; and one Workspace that two
// threads try to use at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "reference/reference.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"
#include "support/sanitizer.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using dcmha::index_t;
using dcmha::reference::Problem;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;
namespace ref = dcmha::reference;
namespace dt = dcmha::test;

/// Lets a group of threads start a round together (C++17 has no std::barrier).
class StartLine {
 public:
  explicit StartLine(int threads) : threads_(threads) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int round = round_;
    if (++waiting_ == threads_) {
      waiting_ = 0;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int threads_;
  int waiting_ = 0, round_ = 0;
};

/// Tokens per decode step after the prompt: 2, or an eighth of a long sequence.
inline int64_t step_of(int64_t T) { return T > 100 ? T / 8 : 2; }

/// One caller's work, with its own problem, Workspace and DecodeCache: forward, backward, and
/// the problem's tokens decoded in steps (prefill 5, then step_of(T) at a time). run() returns
/// every result (out, lse, gradients, decode rows) in one vector.
class CallerJob {
 public:
  virtual ~CallerJob() = default;
  virtual std::vector<double> run(int num_threads) = 0;
  virtual std::string name() const = 0;
  /// Largest relative error of run()'s out and decode rows against the reference.
  virtual double error_against_reference(const std::vector<double>& results) const = 0;
};

template <class T>
class TypedJob : public CallerJob {
 public:
  TypedJob(const ProblemSpec& spec, uint64_t seed)
      : spec_(spec),
        p_(dt::random_problem(spec, seed)),
        dout_(dt::random_dout(p_, seed)),
        schedule_(dt::uniform_schedule(spec.B, spec.T, 5, step_of(spec.T))),
        cache_(dt::cache_config(p_, spec.T, std::max<int64_t>(5, step_of(spec.T)))),
        reference_out_(ref::forward(p_)) {}

  std::vector<double> run(int num_threads) override {
    TypedProblem<T> tp(p_);
    tp.num_threads = num_threads;
    tp.set_dout(dout_);
    dt::forward_backward(tp, tp.config(), &workspace_);
    std::vector<double> all = dt::concatenated(dt::named_results(tp));
    dcmha::AttentionConfig cfg;
    cfg.num_threads = num_threads;
    for (const std::vector<double>& step :
         dt::decode_steps(p_, cache_, schedule_, cfg, &workspace_))
      all.insert(all.end(), step.begin(), step.end());
    return all;
  }

  std::string name() const override {
    return std::string(std::is_same_v<T, float> ? "float " : "double ") + spec_.str();
  }

  double error_against_reference(const std::vector<double>& results) const override {
    const std::vector<double>& want = reference_out_;
    const double out_err = dt::max_rel_error(want, results.data(), want.size());
    // The decode rows are the last values: one (B, H, n, Dv) block per step.
    size_t decoded = 0;
    for (const std::vector<int64_t>& step : schedule_)
      decoded += size_t(p_.B * p_.H * p_.Dv * step[0]);
    std::vector<std::vector<double>> steps;
    size_t at = results.size() - decoded;
    for (const std::vector<int64_t>& step : schedule_) {
      const size_t n = size_t(p_.B * p_.H * p_.Dv * step[0]);
      steps.emplace_back(results.begin() + std::ptrdiff_t(at),
                         results.begin() + std::ptrdiff_t(at + n));
      at += n;
    }
    int64_t padding_nonzero = 0;
    const double decode_err =
        dt::max_rel_error(want, dt::assemble_rows(p_, schedule_, steps, padding_nonzero));
    return std::max(out_err, decode_err);
  }

 private:
  ProblemSpec spec_;
  Problem p_;
  std::vector<double> dout_;
  dt::DecodeSchedule schedule_;
  dcmha::Workspace workspace_;
  dcmha::DecodeCache<T> cache_;
  std::vector<double> reference_out_;  // the same for every run
};

template <class T>
double tolerance() {
  return std::is_same_v<T, double> ? 1e-9 : 2e-4;
}

ProblemSpec job_spec(int64_t B, bool dcmha, int64_t T = 24) {
  ProblemSpec s;
  s.B = B;
  s.H = 4;
  s.Hk = 2;
  s.T = T;
  s.S = T;
  s.D = 8;
  s.Dv = 8;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = true;
  s.pre = s.post = dcmha ? SideSpec::all() : SideSpec::none();
  return s;
}

struct JobPlan {
  std::unique_ptr<CallerJob> job;
  int threads;
  double tolerance;
};

/// float and double, MHA and DCMHA, and both thread modes: G = 1, so B items, which 2 threads
/// take whole when B is even and split key by key when B = 1 or 3.
std::vector<JobPlan> mixed_jobs() {
  std::vector<JobPlan> jobs;
  jobs.push_back({std::make_unique<TypedJob<float>>(job_spec(2, true), 1), 2, tolerance<float>()});
  jobs.push_back(
      {std::make_unique<TypedJob<double>>(job_spec(1, false), 2), 2, tolerance<double>()});
  jobs.push_back({std::make_unique<TypedJob<float>>(job_spec(3, false), 3), 1, tolerance<float>()});
  jobs.push_back(
      {std::make_unique<TypedJob<double>>(job_spec(3, true), 4), 2, tolerance<double>()});
  return jobs;
}

// ---------------------------------------------------------------------------------------------
// 6. Host threads calling at the same time

TEST(ConcurrentCallers, EachBitwiseAsAlone) {
  std::vector<JobPlan> jobs = mixed_jobs();
  // One after another on this thread first: what each caller must get.
  std::vector<std::vector<double>> alone;
  for (JobPlan& j : jobs) {
    alone.push_back(j.job->run(j.threads));
    EXPECT_LE(j.job->error_against_reference(alone.back()), j.tolerance) << j.job->name();
  }
  const int rounds = dt::sanitized_or(2, 4);
  const int n = int(jobs.size());
  StartLine start(n);
  // differing[i][r]: first differing index of job i in round r (-1: bitwise the same).
  std::vector<std::vector<int64_t>> differing(size_t(n), std::vector<int64_t>(size_t(rounds), -2));
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> callers;
  for (int i = 0; i < n; ++i)
    callers.emplace_back([&, i] {
      for (int r = 0; r < rounds; ++r) {
        start.arrive_and_wait();
        try {
          differing[size_t(i)][size_t(r)] = dt::first_bitwise_difference(
              alone[size_t(i)], jobs[size_t(i)].job->run(jobs[size_t(i)].threads));
        } catch (const std::exception& e) {
          errors[size_t(i)] = e.what();
        }
      }
    });
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(errors[size_t(i)], "") << jobs[size_t(i)].job->name();
    for (int r = 0; r < rounds; ++r)
      EXPECT_EQ(differing[size_t(i)][size_t(r)], -1)
          << jobs[size_t(i)].job->name() << " round " << r;
  }
}

// ---------------------------------------------------------------------------------------------
// 7. Callers inside an OpenMP parallel region
//
// dcmha opens its own parallel region per call. Called from inside one, that region is nested:
// with nested parallelism off (max-active-levels 1, the default) it gets a team of one thread,
// with it on (max-active-levels >= 2) as many as asked. Either way every result must be right,
// and bitwise what a call from outside gets with the team size the nested call really had.

#ifdef _OPENMP
/// The team size a nested `parallel num_threads(request)` gets here (probed, not assumed).
int nested_team_size(int request) {
  int size = 0;
#pragma omp parallel num_threads(request)
  {
#pragma omp master
    size = omp_get_num_threads();
  }
  return size;
}

TEST(NestedCallers, InsideAnOpenMpParallelRegion) {
  const int old_levels = omp_get_max_active_levels();
  std::printf(
      "[ measured ] omp_get_max_active_levels() = %d by default, omp_get_max_threads() = %d\n",
      old_levels, omp_get_max_threads());
  // One item of many query blocks (B = 1, T = 1030: planned for one thread, 128-row blocks;
  // for two, 64-row blocks and other sums), and whole items per thread (B = 2). Each job starts
  // every run afresh, so the four settings below share them (and their reference).
  std::vector<JobPlan> jobs;
  jobs.push_back(
      {std::make_unique<TypedJob<float>>(job_spec(1, true, 1030), 11), 0, tolerance<float>()});
  jobs.push_back(
      {std::make_unique<TypedJob<double>>(job_spec(2, true), 12), 0, tolerance<double>()});
  for (int levels : {old_levels, 2})
    for (int cfg_threads : {0, 2}) {
      SCOPED_TRACE("max active levels " + std::to_string(levels) + ", cfg.num_threads " +
                   std::to_string(cfg_threads));
      std::vector<std::vector<double>> inside(2);
      std::vector<int> team(2, 0), request(2, 0);
      std::vector<std::string> errors(2);
      int outer = 0;
      omp_set_max_active_levels(levels);
#pragma omp parallel num_threads(2)
      {
        const int id = omp_get_thread_num();
#pragma omp master
        outer = omp_get_num_threads();
        // What the library asks for: cfg.num_threads, or omp_get_max_threads() for 0.
        request[size_t(id)] = cfg_threads > 0 ? cfg_threads : omp_get_max_threads();
        team[size_t(id)] = nested_team_size(request[size_t(id)]);
        try {
          inside[size_t(id)] = jobs[size_t(id)].job->run(cfg_threads);
        } catch (const std::exception& e) {  // nothing may leave a parallel region
          errors[size_t(id)] = e.what();
        }
      }
      omp_set_max_active_levels(old_levels);
      ASSERT_EQ(outer, 2) << "the outer region is meant to have two callers";
      for (size_t id = 0; id < 2; ++id) {
        SCOPED_TRACE(jobs[id].job->name());
        ASSERT_EQ(errors[id], "");
        if (levels < 2)
          EXPECT_EQ(team[id], 1) << "nested parallelism off: one thread";
        else
          EXPECT_EQ(team[id], request[id]);
        EXPECT_LE(jobs[id].job->error_against_reference(inside[id]), jobs[id].tolerance);
        const std::vector<double> outside = jobs[id].job->run(team[id]);
        EXPECT_EQ(dt::first_bitwise_difference(outside, inside[id]), -1)
            << "a nested call with a team of " << team[id] << " (asked for " << request[id]
            << ") against an outside call with num_threads " << team[id];
      }
    }
  EXPECT_EQ(omp_get_max_active_levels(), old_levels);
}

// A call plans its work for cfg.num_threads, but OpenMP may give its region fewer threads (a
// thread limit, OMP_DYNAMIC). CTest runs this test a second time under OMP_THREAD_LIMIT=1
// (test_concurrency_thread_limit), where every call below runs on a team smaller than planned.
TEST(SmallerTeams, ResultsMatchTheReference) {
  const int planned = 3;
  std::printf("[ measured ] a region asking for %d threads gets %d (thread limit %d)\n", planned,
              nested_team_size(planned), omp_get_thread_limit());
  // A key-split team (B = 1, few rows; decode), whole query blocks per thread (T = 1030), whole
  // items per thread (B = 3).
  std::vector<JobPlan> jobs;
  jobs.push_back(
      {std::make_unique<TypedJob<float>>(job_spec(1, true), 21), planned, tolerance<float>()});
  jobs.push_back({std::make_unique<TypedJob<float>>(job_spec(1, true, 1030), 22), planned,
                  tolerance<float>()});
  jobs.push_back(
      {std::make_unique<TypedJob<double>>(job_spec(3, true), 23), planned, tolerance<double>()});
  for (JobPlan& j : jobs)
    EXPECT_LE(j.job->error_against_reference(j.job->run(j.threads)), j.tolerance) << j.job->name();
}
#endif

// ---------------------------------------------------------------------------------------------
// 8. One Workspace, two threads
//
// A call holds its Workspace for its whole duration; a second call that finds it held throws
// dcmha::Error before touching any output, instead of sharing the buffers.

const char* const kBusyMessage =
    ": workspace: expected a Workspace no other call is using (keep one per calling thread), got "
    "one in use";

/// A DCMHA forward with its expected output (computed with a Workspace of its own).
struct ForwardCall {
  TypedProblem<float> tp;
  std::vector<double> expected;
  explicit ForwardCall(const ProblemSpec& s, uint64_t seed) : tp(dt::random_problem(s, seed)) {
    tp.num_threads = 1;
    dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    expected = tp.out_values();
  }
  /// Runs with ws: true if it ran, false if ws was in use (then out must be untouched, i.e.
  /// still the expected values of the previous run). Records any other outcome in `problems`.
  bool attempt(dcmha::Workspace& ws, std::string& problems) {
    bool ran = true;
    try {
      dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose(), ws);
    } catch (const dcmha::Error& e) {
      ran = false;
      if (std::string(e.what()) != std::string("dcmha::forward") + kBusyMessage)
        problems += e.what();
    }
    if (dt::first_bitwise_difference(expected, tp.out_values()) != -1) problems += " out differs;";
    return ran;
  }
};

ProblemSpec busy_spec(int64_t T) {
  ProblemSpec s;
  s.B = 1;
  s.H = 4;
  s.Hk = 4;
  s.T = T;
  s.S = T;
  s.D = 16;
  s.Dv = 16;
  s.G = 1;
  s.causal = true;
  s.pre = s.post = SideSpec::dynamic();
  return s;
}

/// Deterministic: while a call holds the Workspace (what every entry point takes for its whole
/// duration), forward, backward and decode with it throw and leave their outputs alone.
TEST(SharedWorkspace, CallsOnAHeldWorkspaceThrow) {
  ForwardCall call(busy_spec(8), 1);
  const Problem p = dt::random_problem(busy_spec(8), 2);
  dcmha::DecodeCache<float> cache(dt::cache_config(p, 8, 8));
  dcmha::Workspace ws;
  std::string problems;
  {
    dcmha::detail::WorkspaceAccess::Use held("test", ws);
    EXPECT_FALSE(call.attempt(ws, problems));
    TypedProblem<float> tp(p);
    try {
      dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                      tp.dv(), tp.compose(), tp.dcompose(), ws);
      ADD_FAILURE() << "backward ran on a held Workspace";
    } catch (const dcmha::Error& e) {
      EXPECT_EQ(std::string(e.what()), std::string("dcmha::backward") + kBusyMessage);
    }
    const std::vector<double> dq = tp.gradients().dq;
    EXPECT_TRUE(std::all_of(dq.begin(), dq.end(), [](double x) { return std::isnan(x); }))
        << "dq written (it starts as NaN)";
    dcmha::AttentionConfig cfg;
    try {
      dt::decode_steps(p, cache, {{8}}, cfg, &ws);
      ADD_FAILURE() << "decode ran on a held Workspace";
    } catch (const dcmha::Error& e) {
      EXPECT_EQ(std::string(e.what()), std::string("dcmha::decode") + kBusyMessage);
    }
  }
  EXPECT_EQ(problems, "");
  EXPECT_TRUE(call.attempt(ws, problems)) << "free again once the holder is gone";
  EXPECT_EQ(problems, "");
}

/// Two threads, one Workspace: a long forward runs again and again on one thread while the other
/// tries short forwards with the same Workspace until one finds it in use (bounded: 60 s). Every
/// call either runs and gives bitwise its expected output, or throws the documented error and
/// leaves its output alone; the long thread's calls may throw too, when the short one holds it.
TEST(SharedWorkspace, SecondConcurrentCallThrows) {
  ForwardCall long_call(busy_spec(dt::sanitized_or<int64_t>(192, 512)), 3);
  ForwardCall short_call(busy_spec(4), 4);
  dcmha::Workspace ws;
  std::atomic<bool> observed_busy{false}, long_started{false};
  std::string long_problems, short_problems;
  int long_runs = 0, long_refused = 0, short_runs = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::thread long_thread([&] {
    while (!observed_busy && std::chrono::steady_clock::now() < deadline) {
      long_started = true;
      (long_call.attempt(ws, long_problems) ? long_runs : long_refused) += 1;
    }
  });
  std::thread short_thread([&] {
    while (!long_started) std::this_thread::yield();
    while (!observed_busy && std::chrono::steady_clock::now() < deadline) {
      if (short_call.attempt(ws, short_problems))
        ++short_runs;
      else
        observed_busy = true;
    }
  });
  long_thread.join();
  short_thread.join();
  std::printf("[ measured ] busy after %d short calls ran; long calls: %d ran, %d refused\n",
              short_runs, long_runs, long_refused);
  EXPECT_TRUE(observed_busy) << "the short calls never found the Workspace in use within 60 s";
  EXPECT_EQ(long_problems, "");
  EXPECT_EQ(short_problems, "");
  EXPECT_TRUE(long_call.attempt(ws, long_problems)) << "usable again afterwards";
  EXPECT_EQ(long_problems, "");
}

}  // namespace
