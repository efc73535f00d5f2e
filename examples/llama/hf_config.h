#pragma once
// transformers' config.json for LlamaForCausalLM, read and written: what --init-from DIR
// takes the architecture from and what --export-hf writes beside model.safetensors.

#include "../common/trainer/lm_config.h"

#include <string>

namespace llama {

/// Whether `dir` is a directory holding a config.json (a Hugging Face model directory).
bool is_hf_model_dir(const std::string& dir);

/// The architecture in `dir`/config.json as a Config with arch "llama" (block_size left
/// as `block_size`, the training sequence length). Throws examples::UsageError naming the
/// field and value when the file is not a Llama this example can build (another
/// model_type, an activation other than silu, biases, rope scaling, a head_dim other than
/// hidden_size / num_attention_heads).
lm::Config read_hf_config(const std::string& dir, int64_t block_size);

/// config.json's text for `cfg` (LlamaConfig's fields; the weights' dtype is the
/// exporter's to add).
std::string hf_config_json(const lm::Config& cfg);

}  // namespace llama
