#pragma once
// ByteReader: turns the fuzzer's input bytes into decisions.
//
// One byte per decision, read front to back, so that a mutation of one byte changes one choice
// and the structure libFuzzer learns from coverage stays local. An exhausted input reads as
// zeros: every decision then takes its first (smallest, simplest) option, so every byte string,
// the empty one included, decodes into some problem. Works without clang's FuzzedDataProvider.h.
#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace dcmha::fuzz {

class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}

  std::uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  bool flag() { return (byte() & 1) != 0; }
  /// True with probability about k / 256.
  bool chance(int k) { return byte() < k; }

  /// An integer in [lo, hi]: one byte when the range has at most 256 values, two otherwise.
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    if (hi <= lo) return lo;
    const std::uint64_t span = std::uint64_t(hi - lo) + 1;
    std::uint64_t v = byte();
    if (span > 256) v |= std::uint64_t(byte()) << 8;
    return lo + std::int64_t(v % span);
  }

  template <class T>
  T pick(std::initializer_list<T> options) {
    return options.begin()[byte() % options.size()];
  }

  std::uint64_t u32() {
    std::uint64_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint64_t(byte()) << (8 * i);
    return v;
  }

  bool exhausted() const { return p_ >= end_; }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

}  // namespace dcmha::fuzz
