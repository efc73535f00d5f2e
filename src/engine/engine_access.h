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

namespace detail {
/// What a wrap point holds of the engine (the public header declares it opaque).
struct WrapPointState {
  std::shared_ptr<Unit> unit;                ///< set when this wrap point is a unit
  std::weak_ptr<Runtime> model;              ///< the engine, set with unit
  std::shared_ptr<Runtime> owner;            ///< set on the root only; owns the engine
  std::optional<torch::Dtype> cast_inputs;   ///< mixed precision: floating inputs to this dtype
  std::optional<torch::Dtype> cast_outputs;  ///< the root's MixedPrecision::output_dtype
  bool checkpointed = false;                 ///< picked by the checkpoint policy
  std::string fqn;                           ///< this wrap point's clean FQN, for errors
  /// Sharded at construction (make_sharded): the runtime its flat parameters count into,
  /// and the flat parameters, which fully_shard hands to this wrap point's unit.
  std::shared_ptr<Runtime> built_in;
  std::vector<std::unique_ptr<FlatParam>> built_flats;
  bool built_keep_fp32 = false;  ///< MixedPrecision::keep_fp32_policy picked it
};

/// What a ConstructionScope holds: the runtime that units built during construction
/// join, and how they are built (fully_shard.cpp).
struct ConstructionState {
  std::shared_ptr<Runtime> runtime;
  Backend* broadcast = nullptr;  ///< sync_module_states: the world, else null
  int units_built = 0;
};

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
  /// The engine state of `wp` (sharded construction reads and fills it).
  static detail::WrapPointState& state(WrapPointImpl& wp) { return *wp.state_; }
  /// The model's runtime; throws when the handle is empty.
  static detail::Runtime& runtime(const ShardedModel& model);
  static WrapPointImpl& root(const ShardedModel& model) { return model.root(); }
};

/// Turns the tree under `root` into units; `root` becomes the root unit (fully_shard.cpp).
void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& options);
/// Sharded construction: makes `wp`, whose module was just built, a unit of the scope's
/// runtime now if the policy picks it (fully_shard.cpp).
void shard_at_construction(WrapPointImpl& wp, ConstructionState& scope);
/// The scope active on this thread, or null.
ConstructionState* active_construction();
/// Rebuilds `seq` with every entry behind a wrap point, keeping entry names.
torch::nn::Sequential wrap_sequential_entries(const torch::nn::Sequential& seq);

/// Wrap point for an entry of a torch::nn::Sequential (Tensor -> Tensor): what
/// shard_sequential puts around each entry.
class SequentialEntryImpl : public WrapPointImpl {
 public:
  /// `at_construction`: inside a ConstructionScope, shard the entry now (sharded
  /// construction of layers made one at a time, detail::shard_layers_as_built).
  explicit SequentialEntryImpl(torch::nn::AnyModule module, bool at_construction = false);
  torch::Tensor forward(torch::Tensor x);
  std::shared_ptr<torch::nn::Module> wrapped() const override { return module_.ptr(); }

 private:
  torch::nn::AnyModule module_;
};
}  // namespace detail

}  // namespace fsdp
