#pragma once
// The engine's top rank (docs/design.md, "Layering"): its way into the public handles'
// private members, and the entry points the handles call. Nothing below this rank
// knows a wrap point or a ShardedModel.

#include <fsdp/fully_sharded_module.h>

#include "runtime.h"

#include <memory>
#include <optional>
#include <string>

namespace fsdp {

/// The engine's way into the public handles' private members (a friend of WrapPointImpl).
struct EngineAccess {
  static detail::Unit* unit(const WrapPointImpl& wp);
  static void set_unit(WrapPointImpl& wp, std::shared_ptr<detail::Unit> unit);
  /// Points a unit's wrap point at the engine; the root's also owns it.
  static void set_runtime(WrapPointImpl& wp, const std::shared_ptr<detail::Runtime>& runtime,
                          bool owner);
  /// The engine a unit's wrap point belongs to; an error once the model is gone.
  static detail::Runtime& runtime(const WrapPointImpl& wp);
  static void set_casts(WrapPointImpl& wp, std::optional<torch::Dtype> inputs,
                        std::optional<torch::Dtype> outputs);
  static void set_checkpointed(WrapPointImpl& wp, const std::string& fqn);
  /// The model's runtime; throws when the handle is empty.
  static detail::Runtime& runtime(const ShardedModel& model);
  static WrapPointImpl& root(const ShardedModel& model) { return model.root(); }
};

namespace detail {
/// Turns the tree under `root` into units; `root` becomes the root unit (fully_shard.cpp).
void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& options);
/// Rebuilds `seq` with every entry behind a wrap point, keeping entry names.
torch::nn::Sequential wrap_sequential_entries(const torch::nn::Sequential& seq);
}  // namespace detail

}  // namespace fsdp
