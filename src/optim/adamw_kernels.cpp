// Fused AdamW kernels (see adamw_kernels.h).
//
// Per element, in the order torch::optim::AdamW uses:
//   p = p * (1 - lr * wd)
//   m = fma(g, 1 - b1, m * b1)                    (ATen's add with alpha is an fmadd)
//   v = v * b2 + ((1 - b2) * g) * g               (addcmul's order)
//   p = p - (step_size * m) / (sqrt(v) / sqrt(1 - b2^t) + eps)   (addcdiv's order)
// with step_size = lr / (1 - b1^t) and IEEE sqrt and division (no reciprocal
// approximations), so results agree with torch's to float rounding. Each element is read
// once (p, g, m, v) and written once (p, m, v, and the optional 16-bit copy).
// That arithmetic is written once, in adamw_body.inc, over a vector-traits type; the
// scalar, AVX2 and AVX-512 builds differ only in their traits below.
#include "adamw_kernels.h"

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized inside their own helpers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fsdp::detail {
namespace {

// Plain floats: the reference the vector builds must match bit for bit, and the tail of
// every vector loop.
struct ScalarTraits {
  using T = float;
  static constexpr int64_t kWidth = 1;
  static T load(const float* x) { return *x; }
  static void store(float* x, T a) { *x = a; }
  static T set1(float a) { return a; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T sqrt(T a) { return std::sqrt(a); }
  static T fmadd(T a, T b, T c) { return std::fma(a, b, c); }
  static void store_bf16(uint16_t* o, T a) { *o = c10::BFloat16(a).x; }
  static void store_f16(uint16_t* o, T a) { *o = c10::Half(a).x; }
  // Integer lanes (bf16_adamw_body.inc).
  using I = uint32_t;
  static I load16(const uint16_t* x) { return *x; }
  static void store16(uint16_t* o, I a) { *o = static_cast<uint16_t>(a); }
  static I bits(T a) {
    I u;
    std::memcpy(&u, &a, sizeof u);
    return u;
  }
  static T widen(I a) {
    const I u = a << 16;
    T f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static I rne(T a) { return c10::BFloat16(a).x; }
  static I set1_i(uint32_t a) { return a; }
  static I iota(uint32_t base) { return base; }
  static I add_i(I a, I b) { return a + b; }
  static I xor_i(I a, I b) { return a ^ b; }
  static I mul_i(I a, I b) { return a * b; }
  template <int k>
  static I shr(I a) {
    return a >> k;
  }
};

namespace scalar {
#include "adamw_body.inc"
#include "bf16_adamw_body.inc"
}  // namespace scalar

void scalar_range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
                  uint16_t* out, CopyOutDtype kind) {
  scalar::adamw_body<ScalarTraits>(c, p, g, m, v, n, out, kind);
}

/// The scalar build from element `i` on (a vector loop's tail).
void tail(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t i,
          int64_t n, uint16_t* out, CopyOutDtype kind) {
  if (i < n)
    scalar_range(c, p + i, g + i, m + i, v + i, n - i, out == nullptr ? nullptr : out + i, kind);
}

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
namespace avx512 {

struct Traits {
  using T = __m512;
  static constexpr int64_t kWidth = 16;
  static T load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* x, T a) { _mm512_storeu_ps(x, a); }
  static T set1(float a) { return _mm512_set1_ps(a); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  // bf16 with round-to-nearest-even, as c10::BFloat16 (NaN becomes 0x7FC0).
  static void store_bf16(uint16_t* o, T x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* o, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Integer lanes (bf16_adamw_body.inc).
  using I = __m512i;
  static I load16(const uint16_t* x) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
  static void store16(uint16_t* o, I a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(a));
  }
  static I bits(T a) { return _mm512_castps_si512(a); }
  static T widen(I a) { return _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)); }
  static I rne(T x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  }
  static I set1_i(uint32_t a) { return _mm512_set1_epi32(static_cast<int>(a)); }
  static I iota(uint32_t base) {
    return _mm512_add_epi32(
        set1_i(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I xor_i(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mul_i(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int k>
  static I shr(I a) {
    return _mm512_srli_epi32(a, k);
  }
};

#include "adamw_body.inc"
#include "bf16_adamw_body.inc"

void range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
           uint16_t* out, CopyOutDtype kind) {
  tail(c, p, g, m, v, adamw_body<Traits>(c, p, g, m, v, n, out, kind), n, out, kind);
}

int64_t bf16_range(const AdamWConstants& c, const Bf16Arrays& a, int64_t at, int64_t n, uint32_t k0,
                   uint32_t k1) {
  return bf16_adamw_dispatch<Traits>(c, a, at, n, k0, k1);
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct Traits {
  using T = __m256;
  static constexpr int64_t kWidth = 8;
  static T load(const float* x) { return _mm256_loadu_ps(x); }
  static void store(float* x, T a) { _mm256_storeu_ps(x, a); }
  static T set1(float a) { return _mm256_set1_ps(a); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_bf16(uint16_t* o, T x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Pack the low 16 bits of the eight lanes.
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_packus_epi32(lo, hi));
  }
  static void store_f16(uint16_t* o, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Integer lanes (bf16_adamw_body.inc).
  using I = __m256i;
  static I load16(const uint16_t* x) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
  static void store16(uint16_t* o, I a) {  // lanes hold at most 0xFFFF: packus keeps them
    __m128i lo = _mm256_castsi256_si128(a), hi = _mm256_extracti128_si256(a, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_packus_epi32(lo, hi));
  }
  static I bits(T a) { return _mm256_castps_si256(a); }
  static T widen(I a) { return _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)); }
  static I rne(T x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  }
  static I set1_i(uint32_t a) { return _mm256_set1_epi32(static_cast<int>(a)); }
  static I iota(uint32_t base) {
    return _mm256_add_epi32(set1_i(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I xor_i(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mul_i(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int k>
  static I shr(I a) {
    return _mm256_srli_epi32(a, k);
  }
};

#include "adamw_body.inc"
#include "bf16_adamw_body.inc"

void range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
           uint16_t* out, CopyOutDtype kind) {
  tail(c, p, g, m, v, adamw_body<Traits>(c, p, g, m, v, n, out, kind), n, out, kind);
}

int64_t bf16_range(const AdamWConstants& c, const Bf16Arrays& a, int64_t at, int64_t n, uint32_t k0,
                   uint32_t k1) {
  return bf16_adamw_dispatch<Traits>(c, a, at, n, k0, k1);
}

}  // namespace avx2
#pragma GCC pop_options

#endif

}  // namespace

bool isa_available(KernelIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case KernelIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case KernelIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case KernelIsa::kScalar:
      return true;
  }
  return false;
#else
  return isa == KernelIsa::kScalar;
#endif
}

const char* isa_name(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return "avx512";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kScalar:
      return "scalar";
  }
  return "?";
}

void adamw_update(KernelIsa isa, const AdamWConstants& c, float* p, const float* g, float* m,
                  float* v, int64_t n, uint16_t* out, CopyOutDtype kind) {
#if defined(__x86_64__)
  if (isa == KernelIsa::kAvx512) return avx512::range(c, p, g, m, v, n, out, kind);
  if (isa == KernelIsa::kAvx2) return avx2::range(c, p, g, m, v, n, out, kind);
#endif
  scalar_range(c, p, g, m, v, n, out, kind);
}

void adamw_update_bf16(KernelIsa isa, const AdamWConstants& c, const Bf16Arrays& a, int64_t begin,
                       int64_t end) {
  const auto k0 = static_cast<uint32_t>(a.key), k1 = static_cast<uint32_t>(a.key >> 32);
  // Pieces that stay within one 2^32-element block, so that the vector lanes' 32-bit
  // indices never wrap and the block's number can go into the hash's key.
  for (int64_t b = begin; b < end;) {
    const int64_t e = std::min(end, (b | int64_t{0xFFFFFFFF}) + 1);
    const uint32_t kb = k1 ^ (static_cast<uint32_t>(b >> 32) * 0x9E3779B9u);
    int64_t done = 0;
#if defined(__x86_64__)
    if (isa == KernelIsa::kAvx512) done = avx512::bf16_range(c, a, b, e - b, k0, kb);
    if (isa == KernelIsa::kAvx2) done = avx2::bf16_range(c, a, b, e - b, k0, kb);
#endif
    if (b + done < e)
      scalar::bf16_adamw_dispatch<ScalarTraits>(c, a, b + done, e - b - done, k0, kb);
    b = e;
  }
}

}  // namespace fsdp::detail
