#pragma once
// Causal self-attention for the example models (GPT and Llama), two ways:
//  - kSdpa (the default): at::scaled_dot_product_attention, the fused kernel of the
//    device: flash, cuDNN or memory-efficient attention on CUDA, the flash kernel on the
//    CPU; no T x S matrix of scores is kept. Grouped-query attention passes enable_gqa,
//    so a kernel that supports it reads each key/value head for its group of query heads
//    without copies (the others fall back to ATen's math path, which repeats them).
//    Dropout is the kernel's dropout_p: it draws from the device's default generator, so
//    a recompute under activation checkpointing (which restores that generator's state)
//    draws the same mask.
//  - kMath: the explicit softmax over the (T, S) matrix of scores, kept in memory; for
//    tests and comparisons (--attention math).
// Queries are the last T of S positions (S > T with a KV cache): query i, at position
// S - T + i, sees keys 0 .. S - T + i.

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace examples {

enum class AttentionKernel { kSdpa, kMath };

/// The --attention flag's help text, and its values.
inline constexpr const char* kAttentionHelp =
    "sdpa|math: sdpa, the fused kernel (at::scaled_dot_product_attention: flash, cuDNN or "
    "memory-efficient attention on a GPU, the fused kernel on the CPU); math: the explicit "
    "softmax over a T x T matrix in memory, for tests and comparisons";

/// The kernel a --attention value names; std::invalid_argument naming the value and the
/// choices otherwise.
inline AttentionKernel parse_attention_kernel(const std::string& value,
                                              const std::string& flag = "--attention") {
  if (value == "sdpa") return AttentionKernel::kSdpa;
  if (value == "math") return AttentionKernel::kMath;
  throw std::invalid_argument(flag + " " + value +
                              " is not an attention kernel; use sdpa (the fused kernel, the "
                              "default) or math (the explicit softmax)");
}

inline const char* attention_name(AttentionKernel k) {
  return k == AttentionKernel::kSdpa ? "sdpa" : "math";
}

struct AttentionOptions {
  AttentionKernel kernel = AttentionKernel::kSdpa;
  double dropout_p = 0.0;  ///< on the attention probabilities, while training only
  bool training = false;
  /// kMath: the softmax in fp32 whatever the dtype, then back (transformers' Llama);
  /// otherwise in the scores' dtype (the GPT).
  bool softmax_in_fp32 = false;
};

/// q (B, H, T, hd); k, v (B, Hkv, S, hd) with Hkv dividing H and S >= T. Returns the
/// attention output (B, H, T, hd).
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const AttentionOptions& o) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(H % Hkv == 0, "causal_attention: ", Hkv, " key/value heads do not divide ", H,
              " query heads");
  TORCH_CHECK(S >= T, "causal_attention: ", S, " key positions for ", T, " queries");
  const double p = o.training ? o.dropout_p : 0.0;
  if (o.kernel == AttentionKernel::kSdpa) {
    // is_causal is the top-left causal mask, right when the queries are all the positions
    // (training, a prefill). One query (a decoding step) sees every key: no mask. Other
    // shapes (a prompt after a cache) take the mask explicitly.
    std::optional<torch::Tensor> mask;
    bool causal = false;
    if (S == T) {
      causal = true;
    } else if (T > 1) {
      mask = torch::ones({T, S}, torch::TensorOptions().dtype(torch::kBool).device(q.device()))
                 .tril(S - T);
    }
    return at::scaled_dot_product_attention(q, k, v, mask, p, causal, std::nullopt,
                                            /*enable_gqa=*/Hkv != H);
  }
  torch::Tensor kk = k, vv = v;
  if (Hkv != H) {  // query head h reads key/value head h / (H / Hkv)
    const int64_t rep = H / Hkv;
    kk = k.unsqueeze(2).expand({B, Hkv, rep, S, hd}).reshape({B, H, S, hd});
    vv = v.unsqueeze(2).expand({B, Hkv, rep, S, hd}).reshape({B, H, S, hd});
  }
  auto att = torch::matmul(q, kk.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto mask = torch::ones({T, S}, torch::TensorOptions().dtype(torch::kBool).device(q.device()))
                  .tril(S - T);
  att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  att = o.softmax_in_fp32 ? torch::softmax(att, -1, torch::kFloat).to(q.scalar_type())
                          : torch::softmax(att, -1);
  att = torch::dropout(att, p, o.training && p > 0);
  return torch::matmul(att, vv);
}

}  // namespace examples
