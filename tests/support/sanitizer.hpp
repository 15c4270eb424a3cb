#pragma once
// Whether this test binary runs under a sanitizer (CMake: DCMHA_SANITIZE=address or thread).
// Sanitized code runs 3 to 30 times slower, so the few tests whose problems are large for their
// purpose (long rows, many query blocks) take smaller ones there; every test still runs.
namespace dcmha::test {

#ifdef DCMHA_TEST_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

/// `full` in a plain build, `small` under a sanitizer.
template <class T>
constexpr T sanitized_or(T small, T full) {
  return kSanitized ? small : full;
}

}  // namespace dcmha::test
