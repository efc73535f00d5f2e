#pragma once
// The GPT as transformers' GPT2LMHeadModel, for train_gpt --export-hf. The architecture is
// GPT-2's with two settings GPT2Config has (activation_function "gelu": the exact GELU
// this GPT uses, and tie_word_embeddings false: its head is its own); only the storage
// differs. GPT-2 keeps its linear layers as Conv1D, whose weight is the transpose of a
// Linear's, under other names:
//   wte, wpe, ln_f          -> transformer.wte, transformer.wpe, transformer.ln_f
//   blocks.N.ln1, ln2       -> transformer.h.N.ln_1, ln_2
//   blocks.N.attn.qkv, proj -> transformer.h.N.attn.c_attn, c_proj   (weights transposed)
//   blocks.N.mlp.fc, proj   -> transformer.h.N.mlp.c_fc, c_proj      (weights transposed)
//   lm_head                 -> lm_head

#include <fsdp/checkpoint.h>

#include "../common/trainer/lm_config.h"

#include <nlohmann/json.hpp>

#include <regex>
#include <string>

namespace gpt {

/// GPT-2's name for one of the GPT's clean FQNs.
inline std::string gpt2_name(const std::string& fqn) {
  static const std::regex block(R"(^blocks\.(\d+)\.(.*)$)");
  std::smatch m;
  if (std::regex_match(fqn, m, block)) {
    std::string rest = m[2];
    for (const auto& [ours, theirs] : {std::pair<std::string, std::string>{"ln1.", "ln_1."},
                                       {"ln2.", "ln_2."},
                                       {"attn.qkv.", "attn.c_attn."},
                                       {"attn.proj.", "attn.c_proj."},
                                       {"mlp.fc.", "mlp.c_fc."},
                                       {"mlp.proj.", "mlp.c_proj."}}) {
      if (rest.rfind(ours, 0) == 0)
        return "transformer.h." + m[1].str() + "." + theirs + rest.substr(ours.size());
    }
    return "transformer.h." + m[1].str() + "." + rest;
  }
  if (fqn.rfind("lm_head.", 0) == 0) return fqn;
  return "transformer." + fqn;
}

/// The linear weights GPT-2 stores transposed (Conv1D).
inline bool gpt2_transposed(const std::string& fqn) {
  static const std::regex conv(
      R"(^blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)\.weight$)");
  return std::regex_match(fqn, conv);
}

inline void gpt2_layout(fsdp::ckpt::SafetensorsOptions& o) {
  o.name_for = gpt2_name;
  o.transpose = gpt2_transposed;
}

/// config.json of a GPT2LMHeadModel with the GPT's shape.
inline std::string gpt2_config_json(const lm::Config& c) {
  nlohmann::json j = {{"architectures", {"GPT2LMHeadModel"}},
                      {"model_type", "gpt2"},
                      {"vocab_size", c.vocab_size},
                      {"n_positions", c.block_size},
                      {"n_embd", c.d_model},
                      {"n_layer", c.n_layer},
                      {"n_head", c.n_head},
                      {"n_inner", 4 * c.d_model},
                      {"activation_function", "gelu"},
                      {"resid_pdrop", c.dropout},
                      {"embd_pdrop", 0.0},
                      {"attn_pdrop", c.dropout},
                      {"layer_norm_epsilon", 1e-5},
                      {"initializer_range", 0.02},
                      {"scale_attn_weights", true},
                      {"tie_word_embeddings", false},
                      {"use_cache", true},
                      // GPT-2's defaults (50256) are past this byte-level vocabulary.
                      {"bos_token_id", nullptr},
                      {"eos_token_id", nullptr}};
  return j.dump(2) + "\n";
}

}  // namespace gpt
