#pragma once
// Fused AdamW update kernels: one pass over parameter, gradient and both moments
// (AVX-512, AVX2+FMA and scalar builds of the same arithmetic), for fp32 parameters and
// for pure-bf16 ones (Note [Pure bf16 rounding]). No LibTorch here.

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

/// How the bf16 kernel writes the updated parameter (FusedAdamW::Bf16Rounding).
enum class Bf16Write { kNearest, kStochastic, kCompensated };

/// The arrays of one pure-bf16 parameter, all of the same length (bf16 as their bits).
struct Bf16Arrays {
  uint16_t* p = nullptr;
  const float* grad_f32 = nullptr;      ///< the gradient in fp32, or
  const uint16_t* grad_bf16 = nullptr;  ///< in bf16 (exactly one of the two is set)
  uint16_t* exp_avg = nullptr;
  uint16_t* exp_avg_sq = nullptr;
  uint16_t* comp = nullptr;  ///< kCompensated's buffer (null otherwise)
  Bf16Write write = Bf16Write::kNearest;
  uint64_t key = 0;  ///< kStochastic: the random bits of element i are a hash of (key, i)
};

/// Elements [begin, end) of a pure-bf16 parameter: the update in fp32, moments stored
/// rounded to nearest even, the parameter as a.write says. Each element's result depends
/// on its index only, not on how [0, numel) is split among calls.
void adamw_update_bf16(KernelIsa isa, const AdamWConstants& c, const Bf16Arrays& a, int64_t begin,
                       int64_t end);

}  // namespace fsdp::detail
