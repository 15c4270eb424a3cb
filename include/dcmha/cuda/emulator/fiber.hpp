#pragma once
// Fibers for the emulator: each CUDA thread of an emulated block runs its kernel body on a stack
// of its own, and gives the host thread back (yield) wherever it must wait for other lanes: at a
// warp collective, a barrier. One host thread runs every lane of a cluster in turn, so the order in
// which lanes execute is fixed and the emulator sees every warp instruction lane by lane.
//
// On x86-64 the switch is a few instructions (callee-saved registers, MXCSR and the x87 control
// word, the stack pointer); elsewhere it is ucontext's swapcontext. AddressSanitizer and
// ThreadSanitizer are told of every switch, which they need to follow a program across stacks.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <stdexcept>

#if defined(__SANITIZE_ADDRESS__)
#define DCMHA_FIBER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DCMHA_FIBER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define DCMHA_FIBER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DCMHA_FIBER_TSAN 1
#endif
#endif
#if defined(DCMHA_FIBER_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(DCMHA_FIBER_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

#if defined(__x86_64__) && !defined(DCMHA_FIBER_UCONTEXT)
#define DCMHA_FIBER_X86_64 1
#else
#include <ucontext.h>
#endif

#if defined(DCMHA_FIBER_X86_64)
// dcmha_fiber_switch(&from_sp, to_sp): saves the caller's callee-saved state on its stack, stores
// its stack pointer in *from_sp and continues on to_sp. dcmha_fiber_start is where a new fiber
// begins: its entry function in r12 and argument in rbx, as Fiber::Fiber lays them out. Weak, so
// that every translation unit may carry the definition.
extern "C" void dcmha_fiber_switch(void** from_sp, void* to_sp);
extern "C" void dcmha_fiber_start();
asm(R"(
  .text
  .weak dcmha_fiber_switch
  .type dcmha_fiber_switch, @function
dcmha_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dcmha_fiber_switch, .-dcmha_fiber_switch
  .weak dcmha_fiber_start
  .type dcmha_fiber_start, @function
dcmha_fiber_start:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size dcmha_fiber_start, .-dcmha_fiber_start
)");
#endif

namespace dcmha::cuda::emulator {

/// A stack and a context that runs `entry(argument)` until it yields, resumable from the host
/// thread that created it. The entry must never return: it ends with finish(), which yields for
/// the last time.
class Fiber {
 public:
  using Entry = void (*)(void*);

  explicit Fiber(std::size_t stack_bytes) : stack_bytes_(round_to_pages(stack_bytes)) {
    const std::size_t guard = page_size();
    void* p = mmap(nullptr, stack_bytes_ + guard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    mapping_ = static_cast<char*>(p);
    mprotect(mapping_, guard, PROT_NONE);  // a stack overflow faults instead of corrupting
    stack_ = mapping_ + guard;
#if defined(DCMHA_FIBER_TSAN)
    tsan_fiber_ = __tsan_create_fiber(0);
#endif
  }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber() {
    forget_frames();
#if defined(DCMHA_FIBER_TSAN)
    __tsan_destroy_fiber(tsan_fiber_);
#endif
    munmap(mapping_, stack_bytes_ + page_size());
  }

  /// Prepares the stack to run entry(argument) at the next resume(); the fiber must not be
  /// suspended inside an earlier entry (it finished, or never started).
  void start(Entry entry, void* argument) {
    forget_frames();
#if defined(DCMHA_FIBER_X86_64)
    auto* top = reinterpret_cast<std::uintptr_t*>(
        (reinterpret_cast<std::uintptr_t>(stack_ + stack_bytes_)) & ~std::uintptr_t(15));
    // The frame dcmha_fiber_switch pops: control words, r15..r12, rbx, rbp, then the return
    // address; dcmha_fiber_start then calls the entry with the stack 16-byte aligned.
    std::uintptr_t* frame = top - 10;
    std::uint32_t control[2];
    asm volatile("stmxcsr %0" : "=m"(control[0]));
    asm volatile("fnstcw %0" : "=m"(control[1]));
    frame[0] = std::uintptr_t(control[0]) | (std::uintptr_t(control[1]) << 32);
    frame[1] = frame[2] = frame[3] = 0;                     // r15, r14, r13
    frame[4] = reinterpret_cast<std::uintptr_t>(entry);     // r12
    frame[5] = reinterpret_cast<std::uintptr_t>(argument);  // rbx
    frame[6] = 0;                                           // rbp
    frame[7] = reinterpret_cast<std::uintptr_t>(&dcmha_fiber_start);
    sp_ = frame;
#else
    getcontext(&context_);
    context_.uc_stack.ss_sp = stack_;
    context_.uc_stack.ss_size = stack_bytes_;
    context_.uc_link = nullptr;
    entry_ = entry;
    argument_ = argument;
    makecontext(&context_, &Fiber::trampoline, 0);
#endif
    first_entry_ = true;
  }

  /// Runs the fiber until it yields (or finishes); called from the host thread's own stack.
  void resume() {
#if defined(DCMHA_FIBER_ASAN)
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, stack_, stack_bytes_);
#endif
#if defined(DCMHA_FIBER_TSAN)
    host_tsan_fiber_ = __tsan_get_current_fiber();
    __tsan_switch_to_fiber(tsan_fiber_, 0);
#endif
#if defined(DCMHA_FIBER_X86_64)
    dcmha_fiber_switch(&host_sp_, sp_);
#else
    starting() = this;
    swapcontext(&host_context_, &context_);
#endif
#if defined(DCMHA_FIBER_ASAN)
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
  }

  /// Inside the fiber: gives the host thread back; returns at the next resume().
  void yield() {
    switch_to_host(false);
    arrived();
  }

  /// Inside the fiber, last: gives the host thread back for good (the stack may be reused).
  [[noreturn]] void finish() {
    switch_to_host(true);
    std::terminate();  // never resumed
  }

  /// Inside the fiber, first thing in its entry.
  void arrived() {
#if defined(DCMHA_FIBER_ASAN)
    __sanitizer_finish_switch_fiber(first_entry_ ? nullptr : fake_stack_, &host_stack_,
                                    &host_stack_bytes_);
#endif
    first_entry_ = false;
  }

 private:
  static std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
  static std::size_t round_to_pages(std::size_t n) {
    const std::size_t page = page_size();
    return (n + page - 1) / page * page;
  }

  /// The frames of an earlier run (finished, or abandoned where a launch failed) are gone:
  /// AddressSanitizer must not keep their red zones poisoned for the next run of the stack.
  void forget_frames() {
#if defined(DCMHA_FIBER_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(stack_, stack_bytes_);
#endif
  }

  void switch_to_host(bool last) {
#if defined(DCMHA_FIBER_ASAN)
    __sanitizer_start_switch_fiber(last ? nullptr : &fake_stack_, host_stack_, host_stack_bytes_);
#else
    (void)last;
#endif
#if defined(DCMHA_FIBER_TSAN)
    __tsan_switch_to_fiber(host_tsan_fiber_, 0);
#endif
#if defined(DCMHA_FIBER_X86_64)
    dcmha_fiber_switch(&sp_, host_sp_);
#else
    swapcontext(&context_, &host_context_);
#endif
  }

#if !defined(DCMHA_FIBER_X86_64)
  // makecontext passes int arguments only: the fiber being started is handed over here.
  static Fiber*& starting() {
    static thread_local Fiber* fiber = nullptr;
    return fiber;
  }
  static void trampoline() {
    Fiber* self = starting();
    self->entry_(self->argument_);
  }
  ucontext_t context_{}, host_context_{};
  Entry entry_ = nullptr;
  void* argument_ = nullptr;
#else
  void* sp_ = nullptr;
  void* host_sp_ = nullptr;
#endif
  std::size_t stack_bytes_;
  char* mapping_ = nullptr;
  char* stack_ = nullptr;
  bool first_entry_ = true;
#if defined(DCMHA_FIBER_ASAN)
  void* fake_stack_ = nullptr;
  const void* host_stack_ = nullptr;
  std::size_t host_stack_bytes_ = 0;
#endif
#if defined(DCMHA_FIBER_TSAN)
  void* tsan_fiber_ = nullptr;
  void* host_tsan_fiber_ = nullptr;
#endif
};

}  // namespace dcmha::cuda::emulator
