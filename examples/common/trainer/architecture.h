#pragma once
// The GPT's architecture as a checkpoint records it: the integer fields of lm::Config
// under their attribute names. train_gpt writes them into every checkpoint and reads them
// back for --init-from; generate builds its model from them.

#include <fsdp/checkpoint_format.h>

#include "lm_config.h"

#include <array>
#include <map>
#include <string>
#include <utility>

namespace lm {

/// Each recorded field of `cfg` by its attribute name, in the order errors name them.
inline std::array<std::pair<const char*, int64_t*>, 5> architecture_fields(Config& cfg) {
  return {{{"n_layer", &cfg.n_layer},
           {"n_head", &cfg.n_head},
           {"d_model", &cfg.d_model},
           {"block_size", &cfg.block_size},
           {"vocab_size", &cfg.vocab_size}}};
}

/// The Llama's further integer fields (arch "llama"), by attribute name; tie_embeddings
/// as 0 or 1.
inline std::array<std::pair<const char*, int64_t*>, 3> llama_int_fields(Config& cfg) {
  return {{{"n_kv_head", &cfg.n_kv_head},
           {"intermediate_size", &cfg.intermediate_size},
           {"max_positions", &cfg.max_positions}}};
}
inline std::array<std::pair<const char*, double*>, 2> llama_real_fields(Config& cfg) {
  return {{{"rope_theta", &cfg.rope_theta}, {"rms_norm_eps", &cfg.rms_norm_eps}}};
}

/// The attributes of `cfg` (a checkpoint's fsdp::ckpt::TrainingState::model_attrs). A Llama's
/// also name its arch and its further fields.
inline std::map<std::string, fsdp::ckpt::AttrValue> architecture_attrs(Config cfg) {
  std::map<std::string, fsdp::ckpt::AttrValue> attrs;
  for (const auto& [key, field] : architecture_fields(cfg)) attrs.emplace(key, *field);
  if (cfg.arch == "llama") {
    if (cfg.max_positions == 0) cfg.max_positions = cfg.block_size;
    attrs.emplace("arch", std::string("llama"));
    for (const auto& [key, field] : llama_int_fields(cfg)) attrs.emplace(key, *field);
    for (const auto& [key, field] : llama_real_fields(cfg)) attrs.emplace(key, *field);
    attrs.emplace("tie_embeddings", static_cast<int64_t>(cfg.tie_embeddings ? 1 : 0));
  }
  return attrs;
}

}  // namespace lm
