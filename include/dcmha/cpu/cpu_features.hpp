#pragma once
// What the CPU running the program can do, asked once at run time (CPUID and XGETBV), so that one
// binary built for any x86-64 picks the instructions of the machine it runs on.
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define DCMHA_X86_CPUID 1
#endif

namespace dcmha::cpu {

/// AVX-512 F, BW, VL and BF16 (vdpbf16ps, vcvtne2ps2bf16), with the operating system saving the
/// vector state: what the bf16 tile products (bf16_products.hpp) need.
inline bool cpu_has_avx512_bf16() {
#ifdef DCMHA_X86_CPUID
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned xcr0_low = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    // XMM, YMM, opmask, ZMM 0-15 upper halves, ZMM 16-31: all saved by the OS.
    if ((xcr0_low & 0xe6u) != 0xe6u) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const unsigned f = 1u << 16, bw = 1u << 30, vl = 1u << 31;
    if ((b & (f | bw | vl)) != (f | bw | vl)) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return (a & (1u << 5)) != 0;  // AVX512_BF16
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace dcmha::cpu
