#pragma once
// The shape of the example language models the shared trainer trains: the GPT of
// examples/gpt (the first six fields) and the Llama of examples/llama (all of them).

#include "../attention.h"

#include <cstdint>
#include <string>

namespace lm {

/// The example language models' shape. The GPT reads the first six fields (and attention); arch
/// "llama" (examples/llama/llama_model.h, train_llama) the rest too.
struct Config {
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t d_model = 128;
  int64_t block_size = 64;
  int64_t vocab_size = 256;
  double dropout = 0.0;
  std::string arch = "gpt";       ///< "gpt" or "llama"
  int64_t n_kv_head = 0;          ///< llama: key/value heads (grouped-query attention)
  int64_t intermediate_size = 0;  ///< llama: the SwiGLU MLP's width
  double rope_theta = 10000.0;    ///< llama: the rotary base
  double rms_norm_eps = 1e-5;     ///< llama
  bool tie_embeddings = false;    ///< llama: lm_head is the embedding (tie_word_embeddings)
  /// llama: max_position_embeddings (0: block_size); block_size is then the length of the
  /// training sequences, which may be shorter.
  int64_t max_positions = 0;
  /// How attention is computed (--attention): the fused kernel or the explicit softmax.
  /// Not part of the architecture: checkpoints do not record it, and either kernel loads
  /// and continues the other's weights.
  examples::AttentionKernel attention = examples::AttentionKernel::kSdpa;
};

}  // namespace lm
