#pragma once
// What a training program built on the shared trainer (trainer.h) says about itself: its
// name, its model family and how to build it, and, for a family Hugging Face knows, how
// to read and write transformers' config.json.

#include <fsdp/fsdp.h>

#include "lm_config.h"

#include <functional>
#include <string>

namespace lm {

/// A sharded model of any family, as the trainer drives it.
struct BuiltModel {
  fsdp::ShardedModel model;
  std::function<torch::Tensor(const torch::Tensor&)> forward;  ///< (B, T) tokens -> logits
};

/// Builds model family M sharded: constructed already sharded (fsdp::make_sharded; no rank
/// ever holds the whole model) or in full then sharded (fsdp::fully_shard); the same
/// weights either way.
template <class M, class Cfg>
BuiltModel build_sharded(const Cfg& cfg, const fsdp::ShardingOptions& so, bool sharded) {
  auto model = std::make_shared<fsdp::Sharded<M>>(sharded ? fsdp::make_sharded<M>(so, cfg)
                                                          : fsdp::fully_shard(M(cfg), so));
  return {*model, [model](const torch::Tensor& x) { return (*model)->forward(x); }};
}

struct Program {
  std::string name;         ///< prefixes its output lines and errors
  std::string arch;         ///< the model family (Config::arch): "gpt" or "llama"
  std::string description;  ///< --help's first line
  /// The family's repeated block: what --wrap block and --activation-checkpointing pick.
  fsdp::wrap::WrapPolicy block_policy;
  std::function<BuiltModel(const Config&, const fsdp::ShardingOptions&, bool sharded)> build;
  /// The model's layers for pipeline stages (--pipeline-stages), made one at a time so
  /// that a rank builds only its stage, with the weights `build` would give from the same
  /// seed; empty for a family that cannot split yet.
  std::function<fsdp::PipelineLayers(const Config&)> layers;
  /// A layer parameter's name in the whole model (fsdp::PipelineOptions::parameter_names),
  /// so that pipelined checkpoints use the model's own names.
  std::function<std::string(const std::string&)> layer_names;
  /// A Hugging Face architecture: the Config of a model directory's config.json (block_size
  /// given: the training sequence length; empty: train from this program's own files
  /// only), and the text of config.json for a Config, which --export-hf writes (adding
  /// the weights' dtype). Both empty for a family Hugging Face does not know.
  std::function<Config(const std::string& dir, int64_t block_size)> read_hf_config;
  std::function<std::string(const Config&)> hf_config_json;
  /// With hf_config_json: the weights' names and layout in that architecture, when they
  /// are not the model's own (SafetensorsOptions::name_for and ::transpose). Empty: they
  /// are, and then checkpoints carry config.json too (model attribute "hf_config"), so
  /// that fsdp-consolidate --format safetensors writes a Hugging Face directory offline.
  std::function<void(fsdp::ckpt::SafetensorsOptions&)> hf_layout;
};

}  // namespace lm
