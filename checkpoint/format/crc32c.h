#pragma once
// Block checksum for checkpoint datasets (Note [Block checksums] in h5_checksums.cpp).
//
// crc_block(p, n): four CRC32C (Castagnoli) lanes over interleaved 8-byte words (word i
// goes to lane i % 4), each started at 0xFFFFFFFF; bytes after the last whole 32-byte
// group go to lane 0; the result is the CRC32C of the four lane values (16 bytes, little
// endian). Four independent lanes let the SSE4.2 instruction run at full throughput;
// a table-driven version gives the same values on other CPUs.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fsdp::h5 {
namespace crc_detail {

inline const uint32_t* table() {
  static const auto* t = [] {
    static uint32_t tab[256];
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      tab[i] = c;
    }
    return tab;
  }();
  return t;
}

inline uint32_t sw_u8(uint32_t c, uint8_t b) { return table()[(c ^ b) & 0xFFu] ^ (c >> 8); }
inline uint32_t sw_u64(uint32_t c, uint64_t w) {
  for (int i = 0; i < 8; ++i) c = sw_u8(c, static_cast<uint8_t>(w >> (8 * i)));
  return c;
}

template <class U64, class U8>
uint32_t lanes(const uint8_t* p, size_t n, U64 u64, U8 u8) {
  uint32_t c[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    c[0] = u64(c[0], w[0]);
    c[1] = u64(c[1], w[1]);
    c[2] = u64(c[2], w[2]);
    c[3] = u64(c[3], w[3]);
  }
  for (; i < n; ++i) c[0] = u8(c[0], p[i]);
  uint8_t tail[16];
  std::memcpy(tail, c, 16);
  uint32_t r = 0xFFFFFFFFu;
  for (uint8_t b : tail) r = u8(r, b);
  return r;
}

#if defined(__x86_64__)
// Whole 32-byte groups into the four lanes `c`, word i to lane i % 4: lanes()'s loop,
// spelled out (lambdas would not inherit the target).
__attribute__((target("sse4.2"))) inline void hw_groups(uint32_t* c, const uint8_t* p, size_t n) {
  uint64_t c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  for (size_t i = 0; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    c0 = _mm_crc32_u64(c0, w[0]);
    c1 = _mm_crc32_u64(c1, w[1]);
    c2 = _mm_crc32_u64(c2, w[2]);
    c3 = _mm_crc32_u64(c3, w[3]);
  }
  c[0] = static_cast<uint32_t>(c0), c[1] = static_cast<uint32_t>(c1);
  c[2] = static_cast<uint32_t>(c2), c[3] = static_cast<uint32_t>(c3);
}

// lanes() with the hardware instruction.
__attribute__((target("sse4.2"))) inline uint32_t hw(const uint8_t* p, size_t n) {
  uint32_t c[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  const size_t whole = n / 32 * 32;
  hw_groups(c, p, whole);
  for (size_t i = whole; i < n; ++i) c[0] = _mm_crc32_u8(c[0], p[i]);
  uint8_t tail[16];
  std::memcpy(tail, c, 16);
  uint32_t r = 0xFFFFFFFFu;
  for (uint8_t b : tail) r = _mm_crc32_u8(r, b);
  return r;
}
#endif

}  // namespace crc_detail

inline uint32_t crc_block(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  if (sse42) return crc_detail::hw(p, n);
#endif
  return crc_detail::lanes(p, n, crc_detail::sw_u64, crc_detail::sw_u8);
}

/// crc_block of bytes that arrive in pieces: update() with each piece in order, then
/// value() gives crc_block of their concatenation.
class BlockCrc {
 public:
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    if (held_ > 0) {  // complete the held 32-byte group first
      const size_t k = std::min(n, sizeof(group_) - held_);
      std::memcpy(group_ + held_, p, k);
      held_ += k, p += k, n -= k;
      if (held_ < sizeof(group_)) return;
      groups(group_, sizeof(group_));
      held_ = 0;
    }
    const size_t whole = n / 32 * 32;
    groups(p, whole);
    std::memcpy(group_, p + whole, n - whole);
    held_ = n - whole;
  }
  uint32_t value() const {
    uint32_t c[4] = {c_[0], c_[1], c_[2], c_[3]};
    for (size_t i = 0; i < held_; ++i) c[0] = crc_detail::sw_u8(c[0], group_[i]);
    uint8_t tail[16];
    std::memcpy(tail, c, 16);
    uint32_t r = 0xFFFFFFFFu;
    for (uint8_t b : tail) r = crc_detail::sw_u8(r, b);
    return r;
  }

 private:
  // Whole 32-byte groups, each word to its lane, as crc_block does.
  void groups(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
    static const bool sse42 = __builtin_cpu_supports("sse4.2");
    if (sse42) return crc_detail::hw_groups(c_, p, n);
#endif
    for (size_t i = 0; i < n; i += 32) {
      uint64_t w[4];
      std::memcpy(w, p + i, 32);
      for (int l = 0; l < 4; ++l) c_[l] = crc_detail::sw_u64(c_[l], w[l]);
    }
  }
  uint32_t c_[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  uint8_t group_[32] = {};
  size_t held_ = 0;
};

}  // namespace fsdp::h5
