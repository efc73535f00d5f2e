#pragma once
// Fused AdamW update kernels: one pass over parameter, gradient and both moments
// (AVX-512, AVX2+FMA and scalar builds of the same arithmetic). No LibTorch here.

#include <cstdint>

namespace fsdp::detail {

/// Per-step constants, computed once per parameter group (as torch::optim::AdamW does).
struct AdamWConstants {
  float decay = 1.0f;  ///< 1 - lr * weight_decay (decoupled decay, applied first)
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float sqrt_bc2 = 1.0f;  ///< sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float step_size = 1e-3f;  ///< lr / (1 - beta1^step)
};

/// Low-precision copy of the updated parameters written in the same pass.
enum class CopyOutDtype { kNone, kBF16, kF16 };

/// Instruction sets, best first.
enum class KernelIsa { kAvx512, kAvx2, kScalar };

bool isa_available(KernelIsa isa);
const char* isa_name(KernelIsa isa);

/// p, g, m, v: n floats. out: n 16-bit values (bf16 or fp16 bits) or null.
void adamw_update(KernelIsa isa, const AdamWConstants& c, float* p, const float* g, float* m,
                  float* v, int64_t n, uint16_t* out, CopyOutDtype kind);

}  // namespace fsdp::detail
