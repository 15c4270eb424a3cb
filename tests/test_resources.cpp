// Resource failures. This binary replaces the global operator new (as a program may): while a
// test arms it, it counts the allocations a call makes and can fail any one of them. Failing each
// allocation of forward, backward and decode in turn, every failure must leave the call as
// dcmha::AllocationError (a std::bad_alloc) with every output untouched and nothing the call
// allocated still held; and sizes beyond the address space must be refused, never wrapped around.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "reference/reference.hpp"
#include "support/problem.hpp"

// ---------------------------------------------------------------------------------------------
// The fault injector
// ---------------------------------------------------------------------------------------------

namespace fault {

/// Allocations made while armed, until freed (a fixed table: it must not allocate itself).
struct Tracker {
  std::mutex mutex;
  void* live[1 << 15] = {};
  int count = 0;
  bool overflowed = false;

  void add(void* p) {
    std::lock_guard<std::mutex> lock(mutex);
    if (count == int(std::size(live))) {
      overflowed = true;
      return;
    }
    live[count++] = p;
  }
  void remove(void* p) {
    std::lock_guard<std::mutex> lock(mutex);
    for (int i = count - 1; i >= 0; --i)
      if (live[i] == p) {
        live[i] = live[--count];
        return;
      }
  }
  int held() {
    std::lock_guard<std::mutex> lock(mutex);
    return count;
  }
};

struct Injector {
  std::atomic<bool> armed{false};
  std::atomic<long> seen{0};     // allocations while armed
  std::atomic<long> fail_at{0};  // the one to fail, counting from 1; 0: none
  // Whether it was a nothrow allocation, which the caller may handle (std::stable_sort, say,
  // then sorts without a buffer): the call must then succeed.
  std::atomic<bool> failed_nothrow{false};
  Tracker tracker;
};

Injector& injector() {
  static Injector instance;  // constant-initialized members: safe before main
  return instance;
}

void* allocate(std::size_t n, std::size_t align, bool nothrow) {
  Injector& in = injector();
  const bool armed = in.armed.load(std::memory_order_acquire);
  if (armed && in.seen.fetch_add(1) + 1 == in.fail_at.load()) {
    in.failed_nothrow = nothrow;
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  n = std::max<std::size_t>(n, 1);
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n);
  if (!p) {
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  if (armed) in.tracker.add(p);
  return p;
}

void release(void* p) {
  if (!p) return;
  injector().tracker.remove(p);
  std::free(p);
}

/// Arms the injector for one scope: counts allocations, fails number `fail_at` (0: none).
class Armed {
 public:
  explicit Armed(long fail_at) {
    injector().seen = 0;
    injector().fail_at = fail_at;
    injector().failed_nothrow = false;
    injector().armed.store(true, std::memory_order_release);
  }
  ~Armed() { injector().armed.store(false, std::memory_order_release); }
  long seen() const { return injector().seen.load(); }
};

}  // namespace fault

// ThreadSanitizer's runtime defines the global operator new itself (statically linked: a
// second definition does not link), so under TSan the allocation-failure tests skip; the rest run.
#if defined(__SANITIZE_THREAD__)
#define DCMHA_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DCMHA_TEST_TSAN 1
#endif
#endif

#ifndef DCMHA_TEST_TSAN
void* operator new(std::size_t n) { return fault::allocate(n, 0, false); }
void* operator new[](std::size_t n) { return fault::allocate(n, 0, false); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return fault::allocate(n, 0, true);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return fault::allocate(n, 0, true);
}
void* operator new(std::size_t n, std::align_val_t a) {
  return fault::allocate(n, std::size_t(a), false);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return fault::allocate(n, std::size_t(a), false);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return fault::allocate(n, std::size_t(a), true);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return fault::allocate(n, std::size_t(a), true);
}
void operator delete(void* p) noexcept { fault::release(p); }
void operator delete[](void* p) noexcept { fault::release(p); }
void operator delete(void* p, std::size_t) noexcept { fault::release(p); }
void operator delete[](void* p, std::size_t) noexcept { fault::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { fault::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { fault::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { fault::release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { fault::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { fault::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { fault::release(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  fault::release(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  fault::release(p);
}
#endif

namespace {

using dcmha::index_t;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;

constexpr double kSentinel = 12288.0;  // what every output holds before a call (exact in bf16)

// ---------------------------------------------------------------------------------------------
// Calls under test: each writes its outputs into buffers the test can read back
// ---------------------------------------------------------------------------------------------

/// One public call on a prepared problem. run() makes the call (with the Workspace, or without
/// one when null); outputs() reads every output the call may write, in a fixed order.
struct Call {
  std::string name;
  std::function<void(dcmha::Workspace*)> run;
  std::function<std::vector<double>()> outputs;
  std::function<void()> reset;  // every output back to kSentinel
};

template <class T, int N>
void fill(const dcmha::TensorView<T, N>& v) {
  if (!v.empty()) dcmha::test::from_canonical(v, std::vector<double>(size_t(v.numel()), kSentinel));
}

template <class T>
void fill_grads(const dcmha::ComposeTermGrads<T>& g) {
  fill(g.w);
  fill(g.qw1);
  fill(g.qw2);
  fill(g.qdd);
  fill(g.kw1);
  fill(g.kw2);
  fill(g.kdd);
}

std::vector<double> with(std::vector<double> all, const std::vector<double>& more) {
  all.insert(all.end(), more.begin(), more.end());
  return all;
}

/// forward or backward of `spec` (backward from the lse of one forward made first).
template <class T>
Call attention_call(const ProblemSpec& spec, int threads, bool backward) {
  const auto p = dcmha::test::random_problem(spec, 5);
  auto tp = std::make_shared<TypedProblem<T>>(p);
  tp->num_threads = threads;
  tp->set_dout(dcmha::test::random_dout(p, 5));
  dcmha::forward(tp->config(), tp->q(), tp->k(), tp->v(), tp->out(), tp->lse(), tp->compose());
  Call c;
  c.name = std::string(backward ? "backward " : "forward ") + spec.str() + " threads " +
           std::to_string(threads);
  if (!backward) {
    c.run = [tp](dcmha::Workspace* ws) {
      if (ws)
        dcmha::forward(tp->config(), tp->q(), tp->k(), tp->v(), tp->out(), tp->lse(), tp->compose(),
                       *ws);
      else
        dcmha::forward(tp->config(), tp->q(), tp->k(), tp->v(), tp->out(), tp->lse(),
                       tp->compose());
    };
    c.outputs = [tp] { return with(tp->out_values(), tp->lse_values()); };
    c.reset = [tp] {
      fill(tp->out());
      fill(tp->lse());
    };
  } else {
    c.run = [tp](dcmha::Workspace* ws) {
      if (ws)
        dcmha::backward(tp->config(), tp->q(), tp->k(), tp->v(), tp->lse(), tp->dout(), tp->dq(),
                        tp->dk(), tp->dv(), tp->compose(), tp->dcompose(), *ws);
      else
        dcmha::backward(tp->config(), tp->q(), tp->k(), tp->v(), tp->lse(), tp->dout(), tp->dq(),
                        tp->dk(), tp->dv(), tp->compose(), tp->dcompose());
    };
    c.outputs = [tp] {
      const dcmha::reference::Gradients g = tp->gradients();
      std::vector<double> all;
      for (auto& [name, values] : dcmha::test::named_gradients(g)) all = with(all, *values);
      return all;
    };
    c.reset = [tp] {
      fill(tp->dq());
      fill(tp->dk());
      fill(tp->dv());
      fill_grads(tp->dcompose().pre);
      fill_grads(tp->dcompose().post);
    };
  }
  c.reset();
  return c;
}

/// One decode step of B sequences after a prefill, DCMHA with key-wise state in the cache.
Call decode_call(int threads) {
  struct State {
    dcmha::DecodeCacheConfig cc;
    std::unique_ptr<dcmha::DecodeCache<float>> cache;
    std::vector<float> q, out, qw1, qw2, qdd;
    dcmha::ComposeWeights<float> query_side;
    dcmha::AttentionConfig cfg;
  };
  auto st = std::make_shared<State>();
  const index_t B = 2, H = 4, D = 8, R = 2, n = 3, prompt = 40;
  st->cc.B = B;
  st->cc.H = H;
  st->cc.Hk = H;
  st->cc.D = D;
  st->cc.Dv = D;
  st->cc.G = 1;
  st->cc.Rk = R;
  st->cc.pre_key_wise = st->cc.post_key_wise = true;
  st->cc.capacity = prompt + n;
  st->cc.max_step = prompt;
  st->cache = std::make_unique<dcmha::DecodeCache<float>>(st->cc);
  dcmha::test::Rng rng(9);
  auto normal = [&](index_t count, double sd) {
    const auto x = rng.normal(size_t(count), sd);
    return std::vector<float>(x.begin(), x.end());
  };
  for (index_t len : {prompt, n}) {  // the prompt, then the step that decode() computes
    std::vector<float> k = normal(B * H * len * D, 1), v = normal(B * H * len * D, 1);
    std::vector<float> kw1 = normal(B * len * R * H, 0.3), kw2 = normal(B * len * R * H, 0.3),
                       kdd = normal(B * len * H, 0.3);
    dcmha::ComposeWeights<float> key_side;
    for (auto* side : {&key_side.pre, &key_side.post}) {
      side->key_wise = true;
      side->kw1 = dcmha::view<5>(kw1.data(), {B, len, 1, R, H});
      side->kw2 = dcmha::view<5>(kw2.data(), {B, len, 1, R, H});
      side->kdd = dcmha::view<4>(kdd.data(), {B, len, 1, H});
    }
    st->cache->append(dcmha::view<4>(k.data(), {B, H, len, D}),
                      dcmha::view<4>(v.data(), {B, H, len, D}), key_side);
  }
  st->q = normal(B * H * n * D, 1);
  st->out.assign(size_t(B * H * n * D), float(kSentinel));
  st->qw1 = normal(B * n * R * H, 0.3);
  st->qw2 = normal(B * n * R * H, 0.3);
  st->qdd = normal(B * n * H, 0.3);
  for (auto* side : {&st->query_side.pre, &st->query_side.post}) {
    side->query_wise = true;
    side->qw1 = dcmha::view<5>(static_cast<const float*>(st->qw1.data()), {B, n, 1, R, H});
    side->qw2 = dcmha::view<5>(static_cast<const float*>(st->qw2.data()), {B, n, 1, R, H});
    side->qdd = dcmha::view<4>(static_cast<const float*>(st->qdd.data()), {B, n, 1, H});
  }
  st->cfg.num_threads = threads;
  Call c;
  c.name = "decode threads " + std::to_string(threads);
  c.run = [st](dcmha::Workspace* ws) {
    auto q = dcmha::view<4>(static_cast<const float*>(st->q.data()), {B, H, n, D});
    auto out = dcmha::view<4>(st->out.data(), {B, H, n, D});
    if (ws)
      dcmha::decode(st->cfg, q, *st->cache, st->query_side, out, *ws);
    else
      dcmha::decode(st->cfg, q, *st->cache, st->query_side, out);
  };
  c.outputs = [st] { return std::vector<double>(st->out.begin(), st->out.end()); };
  c.reset = [st] { std::fill(st->out.begin(), st->out.end(), float(kSentinel)); };
  return c;
}

// ---------------------------------------------------------------------------------------------
// The check
// ---------------------------------------------------------------------------------------------

bool all_sentinel(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double v) { return v == kSentinel; });
}

/// The failure numbers to try out of `total` allocations: all of them when few, else the first
/// and last 6 and an even spread between (the per-row buffers of a call repeat one pattern).
std::vector<long> failure_points(long total) {
  std::vector<long> k;
  for (long i = 1; i <= total; ++i)
    if (total <= 24 || i <= 6 || i > total - 6 || i % (total / 12) == 0) k.push_back(i);
  return k;
}

/// Fails each allocation of `call` in turn, with and without a Workspace.
void check_every_allocation_failure(Call& call) {
  SCOPED_TRACE(call.name);
  call.run(nullptr);
  const std::vector<double> expected = call.outputs();
  ASSERT_FALSE(all_sentinel(expected)) << "the call wrote nothing";
  for (bool kept_workspace : {false, true}) {
    SCOPED_TRACE(kept_workspace ? "with a Workspace" : "without a Workspace");
    long total = 0;
    {
      dcmha::Workspace ws;
      fault::Armed count_only(0);
      call.run(kept_workspace ? &ws : nullptr);
      total = count_only.seen();
    }
    ASSERT_GT(total, 0);
    for (long k : failure_points(total)) {
      SCOPED_TRACE("failing allocation " + std::to_string(k) + " of " + std::to_string(total));
      call.reset();
      {
        dcmha::Workspace ws;
        dcmha::Workspace* given = kept_workspace ? &ws : nullptr;
        bool thrown = false;
        {
          fault::Armed fail(k);
          try {
            call.run(given);
          } catch (const dcmha::AllocationError& e) {
            thrown = std::string(e.what()).find("dcmha::") == 0;
          } catch (const std::exception& e) {
            ADD_FAILURE() << "unexpected exception: " << e.what();
          }
        }
        if (fault::injector().failed_nothrow) {  // handled by the call: it must have succeeded
          ASSERT_FALSE(thrown);
          ASSERT_EQ(call.outputs(), expected);
        } else {
          ASSERT_TRUE(thrown) << "expected dcmha::AllocationError naming the call";
          ASSERT_TRUE(all_sentinel(call.outputs())) << "an output was written";
          if (given) {  // the Workspace stays usable: the same call again gives the same results
            call.run(given);
            ASSERT_EQ(call.outputs(), expected);
          }
        }
        call.reset();
      }
      ASSERT_EQ(fault::injector().tracker.held(), 0)
          << "an allocation of the failed call is still held";
    }
  }
  ASSERT_FALSE(fault::injector().tracker.overflowed);
}

/// The fault injector replaces operator new, except under ThreadSanitizer (see there).
bool have_injector() {
#ifdef DCMHA_TEST_TSAN
  return false;
#else
  return true;
#endif
}

ProblemSpec spec_of(int64_t B, int64_t H, int64_t G, int64_t T, int64_t S, SideSpec side) {
  ProblemSpec s;
  s.B = B;
  s.H = H;
  s.Hk = H;
  s.G = G;
  s.T = T;
  s.S = S;
  s.D = 8;
  s.Dv = 8;
  s.causal = true;
  s.pre = s.post = side;
  return s;
}

// The forward's three ways to share work (whole items per thread, whole query blocks per thread,
// a team on every block's keys) and the backward's two, with and without compose.
TEST(AllocationFailure, ForwardLeavesOutputsUntouched) {
  if (!have_injector()) GTEST_SKIP() << "operator new is ThreadSanitizer's in this build";
  for (int threads : {1, 2}) {
    for (SideSpec side : {SideSpec::none(), SideSpec::all()}) {
      auto items = attention_call<float>(spec_of(2, 4, 2, 20, 20, side), threads, false);
      check_every_allocation_failure(items);
      // At least 4 query blocks of 64 rows per thread.
      auto blocks = attention_call<float>(spec_of(1, 2, 1, 260 * threads, 260 * threads, side),
                                          threads, false);
      check_every_allocation_failure(blocks);
      auto team = attention_call<dcmha::bf16>(spec_of(1, 4, 1, 5, 70, side), threads, false);
      check_every_allocation_failure(team);
    }
  }
}

TEST(AllocationFailure, BackwardLeavesGradientsUntouched) {
  if (!have_injector()) GTEST_SKIP() << "operator new is ThreadSanitizer's in this build";
  for (int threads : {1, 2}) {
    for (SideSpec side : {SideSpec::none(), SideSpec::all()}) {
      auto items = attention_call<double>(spec_of(2, 4, 2, 20, 20, side), threads, true);
      check_every_allocation_failure(items);
      auto team = attention_call<dcmha::bf16>(spec_of(1, 4, 1, 40, 70, side), threads, true);
      check_every_allocation_failure(team);
    }
  }
}

TEST(AllocationFailure, DecodeLeavesOutputsUntouched) {
  if (!have_injector()) GTEST_SKIP() << "operator new is ThreadSanitizer's in this build";
  for (int threads : {1, 2}) {
    Call c = decode_call(threads);
    check_every_allocation_failure(c);
  }
}

// ---------------------------------------------------------------------------------------------
// Sizes no memory can hold
// ---------------------------------------------------------------------------------------------

/// forward over keys that are one broadcast row (stride 0), S of them: nothing but the kernels'
/// own buffers grows with S.
void forward_broadcast_keys(index_t S, const char* expect_in_message) {
  SCOPED_TRACE("S = " + std::to_string(S));
  std::vector<float> q(8, 1.0f), k(8, 0.5f), v(8, 2.0f), out(8, float(kSentinel));
  const auto kv = [&](std::vector<float>& x) {
    return dcmha::view<4>(static_cast<const float*>(x.data()), {1, 1, S, 8}, {0, 0, 0, 1});
  };
  dcmha::AttentionConfig cfg;
  cfg.mask = dcmha::Mask::full;
  try {
    dcmha::forward(cfg, dcmha::view<4>(static_cast<const float*>(q.data()), {1, 1, 1, 8}), kv(k),
                   kv(v), dcmha::view<4>(out.data(), {1, 1, 1, 8}));
    FAIL() << "no error";
  } catch (const dcmha::AllocationError& e) {
    EXPECT_NE(std::string(e.what()).find(expect_in_message), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == float(kSentinel); }));
}

TEST(AllocationFailure, SizesBeyondMemoryAreRefused) {
  // The panels would take terabytes: the allocation itself fails. ThreadSanitizer's throwing
  // operator new (LLVM 14) ends the process on a failed allocation instead of throwing, whatever
  // allocator_may_return_null says; the other builds check this case.
#ifndef DCMHA_TEST_TSAN
  forward_broadcast_keys(index_t(1) << 38, "dcmha::forward: out of memory");
#endif
  // The sizes would overflow index_t: refused before any is computed.
  forward_broadcast_keys(index_t(1) << 56, "exceed the address space");
  forward_broadcast_keys(std::numeric_limits<index_t>::max(), "exceed the address space");
}

TEST(AllocationFailure, DecodeCacheTooLargeForMemory) {
  dcmha::DecodeCacheConfig cc;
  cc.H = cc.Hk = 1;
  cc.D = cc.Dv = 1024;
// As in SizesBeyondMemoryAreRefused.
#ifndef DCMHA_TEST_TSAN
  cc.capacity = index_t(1) << 40;  // 8 PiB of float
  try {
    dcmha::DecodeCache<float> cache(cc);
    FAIL() << "no error";
  } catch (const dcmha::AllocationError& e) {
    EXPECT_EQ(std::string(e.what()).find("dcmha::DecodeCache: "), 0u) << e.what();
  }
#endif
  cc.capacity = index_t(1) << 62;  // an element count that overflows: an argument error
  EXPECT_THROW(dcmha::DecodeCache<float>{cc}, dcmha::Error);
}

}  // namespace
