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

#include <cmath>

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
};

namespace scalar {
#include "adamw_body.inc"
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
};

#include "adamw_body.inc"

void range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
           uint16_t* out, CopyOutDtype kind) {
  tail(c, p, g, m, v, adamw_body<Traits>(c, p, g, m, v, n, out, kind), n, out, kind);
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
};

#include "adamw_body.inc"

void range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
           uint16_t* out, CopyOutDtype kind) {
  tail(c, p, g, m, v, adamw_body<Traits>(c, p, g, m, v, n, out, kind), n, out, kind);
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

}  // namespace fsdp::detail
