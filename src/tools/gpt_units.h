#pragma once
// The GPT example's parameters per unit (docs/design.md, "Contracts"; examples/gpt/
// gpt_model.h), wrapped one unit per block as train_gpt --wrap block does: what
// fsdp-estimate's GPT-shape flags describe. The estimator itself knows no model.

#include <cstdint>
#include <vector>

namespace fsdp::tools {

/// Trainable parameters per unit: the root unit (wte, wpe, ln_f, lm_head) first, then
/// one per block.
inline std::vector<int64_t> gpt_unit_params(int64_t n_layer, int64_t d_model, int64_t block_size,
                                            int64_t vocab_size = 256) {
  const int64_t d = d_model;
  // Root: wte (V x d), wpe (block x d), ln_f (2d), lm_head (d x V, no bias).
  std::vector<int64_t> units = {vocab_size * d + block_size * d + 2 * d + d * vocab_size};
  // Block: ln1, ln2 (2d each), qkv (d x 3d + 3d), attn.proj (d x d + d), fc (d x 4d + 4d),
  // mlp.proj (4d x d + d).
  const int64_t block =
      4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  for (int64_t i = 0; i < n_layer; ++i) units.push_back(block);
  return units;
}

/// Trainable parameters per pipeline layer (train_gpt --pipeline-stages; gpt::as_layers):
/// the embeddings (wte, wpe), one per block, then the head (ln_f, lm_head).
inline std::vector<int64_t> gpt_layer_params(int64_t n_layer, int64_t d_model, int64_t block_size,
                                             int64_t vocab_size = 256) {
  const int64_t d = d_model;
  std::vector<int64_t> units = gpt_unit_params(n_layer, d_model, block_size, vocab_size);
  units.front() = vocab_size * d + block_size * d;  // the embeddings
  units.push_back(2 * d + d * vocab_size);          // ln_f and lm_head
  return units;
}

}  // namespace fsdp::tools
