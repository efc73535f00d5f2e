#pragma once
// The GPT's architecture as a checkpoint records it: the integer fields of gpt::Config
// under their attribute names. train_gpt writes them into every checkpoint and reads them
// back for --init-from; generate builds its model from them.

#include <fsdp/checkpoint_format.h>

#include "gpt_model.h"

#include <array>
#include <map>
#include <string>
#include <utility>

namespace gpt {

/// Each recorded field of `cfg` by its attribute name, in the order errors name them.
inline std::array<std::pair<const char*, int64_t*>, 5> architecture_fields(Config& cfg) {
  return {{{"n_layer", &cfg.n_layer},
           {"n_head", &cfg.n_head},
           {"d_model", &cfg.d_model},
           {"block_size", &cfg.block_size},
           {"vocab_size", &cfg.vocab_size}}};
}

/// The attributes of `cfg` (a checkpoint's fsdp::TrainingState::model_attrs).
inline std::map<std::string, fsdp::AttrValue> architecture_attrs(Config cfg) {
  std::map<std::string, fsdp::AttrValue> attrs;
  for (const auto& [key, field] : architecture_fields(cfg)) attrs.emplace(key, *field);
  return attrs;
}

}  // namespace gpt
