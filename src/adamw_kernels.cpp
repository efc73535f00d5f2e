// Fused AdamW kernels (see adamw_kernels.h).
//
// Per element, in the order torch::optim::AdamW (LibTorch 1.13) uses:
//   p = p * (1 - lr * wd)
//   m = fma(g, 1 - b1, m * b1)                    (ATen's add with alpha is an fmadd)
//   v = v * b2 + ((1 - b2) * g) * g               (addcmul's order)
//   p = p - (step_size * m) / (sqrt(v) / sqrt(1 - b2^t) + eps)   (addcdiv's order)
// with step_size = lr / (1 - b1^t) and IEEE sqrt and division (no reciprocal
// approximations), so results agree with torch's to float rounding. Each element is read once (p, g, m, v) and written once
// (p, m, v, and the optional 16-bit copy).
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

inline void scalar_range(const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t begin,
                         int64_t end, uint16_t* out, CopyOut kind) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i];
    float pi = p[i] * c.decay;
    const float mi = std::fma(gi, c.one_minus_beta1, m[i] * c.beta1);
    const float vi = v[i] * c.beta2 + (c.one_minus_beta2 * gi) * gi;
    const float denom = std::sqrt(vi) / c.sqrt_bc2 + c.eps;
    pi = pi - (c.step_size * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (kind == CopyOut::kBF16) out[i] = c10::BFloat16(pi).x;
    if (kind == CopyOut::kF16) out[i] = c10::Half(pi).x;
  }
}

#if defined(__x86_64__)

// bf16 with round-to-nearest-even, as c10::BFloat16 (NaN becomes 0x7FC0).
__attribute__((target("avx512f,avx512bw"))) inline __m256i bf16_avx512(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

__attribute__((target("avx512f,avx512bw"))) void avx512_range(const AdamWConstants& c, float* p, const float* g,
                                                              float* m, float* v, int64_t n, uint16_t* out,
                                                              CopyOut kind) {
  const __m512 decay = _mm512_set1_ps(c.decay), b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 sbc2 = _mm512_set1_ps(c.sqrt_bc2), eps = _mm512_set1_ps(c.eps), ss = _mm512_set1_ps(c.step_size);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 pi0 = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
    const __m512 mi = _mm512_fmadd_ps(gi, omb1, _mm512_mul_ps(_mm512_loadu_ps(m + i), b1));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), sbc2), eps);
    const __m512 pi = _mm512_sub_ps(pi0, _mm512_div_ps(_mm512_mul_ps(ss, mi), denom));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if (kind == CopyOut::kBF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_avx512(pi));
    } else if (kind == CopyOut::kF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  scalar_range(c, p, g, m, v, i, n, out, kind);
}

__attribute__((target("avx2,fma,f16c"))) inline __m128i bf16_avx2(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Pack the low 16 bits of the eight lanes.
  __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

__attribute__((target("avx2,fma,f16c"))) void avx2_range(const AdamWConstants& c, float* p, const float* g, float* m,
                                                         float* v, int64_t n, uint16_t* out, CopyOut kind) {
  const __m256 decay = _mm256_set1_ps(c.decay), b1 = _mm256_set1_ps(c.beta1), omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 sbc2 = _mm256_set1_ps(c.sqrt_bc2), eps = _mm256_set1_ps(c.eps), ss = _mm256_set1_ps(c.step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi0 = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    const __m256 mi = _mm256_fmadd_ps(gi, omb1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), sbc2), eps);
    const __m256 pi = _mm256_sub_ps(pi0, _mm256_div_ps(_mm256_mul_ps(ss, mi), denom));
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if (kind == CopyOut::kBF16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16_avx2(pi));
    } else if (kind == CopyOut::kF16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  scalar_range(c, p, g, m, v, i, n, out, kind);
}

#endif

}  // namespace

bool isa_available(KernelIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case KernelIsa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case KernelIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case KernelIsa::kScalar: return true;
  }
  return false;
#else
  return isa == KernelIsa::kScalar;
#endif
}

const char* isa_name(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512: return "avx512";
    case KernelIsa::kAvx2: return "avx2";
    case KernelIsa::kScalar: return "scalar";
  }
  return "?";
}

void adamw_update(KernelIsa isa, const AdamWConstants& c, float* p, const float* g, float* m, float* v, int64_t n,
                  uint16_t* out, CopyOut kind) {
#if defined(__x86_64__)
  if (isa == KernelIsa::kAvx512) return avx512_range(c, p, g, m, v, n, out, kind);
  if (isa == KernelIsa::kAvx2) return avx2_range(c, p, g, m, v, n, out, kind);
#endif
  scalar_range(c, p, g, m, v, 0, n, out, kind);
}

}  // namespace fsdp::detail
