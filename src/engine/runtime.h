#pragma once
// The runtime shared by all units of one sharded model: options, groups, counters,
// the communication context, the recorded forward order, and the training state.

#include <fsdp/options.h>

#include "accounting.h"
#include "comm_context.h"
#include "unit.h"

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {

/// Where an iteration is. kIdle -> kForward (a training forward of the root) ->
/// kBackward (the first gradient or pre-backward hook queued end_of_backward()) ->
/// kIdle (end_of_backward()). Forwards inside backward (activation checkpointing's
/// recomputation) leave it in kBackward.
enum class Phase { kIdle, kForward, kBackward };

const char* to_string(Phase s);

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  explicit Runtime(ShardingOptions options);
  /// Waits for what is still in flight before the units and their buffers go.
  ~Runtime();

  const ShardingOptions& options() const { return options_; }
  Accounting& acct() { return acct_; }
  const FlatConfig& flat_config() const { return flat_cfg_; }
  std::vector<std::shared_ptr<Unit>>& units() { return units_; }
  const std::vector<std::shared_ptr<Unit>>& units() const { return units_; }
  /// Every flat parameter in unit order (the model view's index), for O(1) lookups.
  const std::vector<FlatParam*>& flats() const { return flats_; }

  /// Sets the groups and dtypes the units are built with, and makes the communication
  /// context (with cfg.transfers under offload). Called once, before add_unit().
  void set_flat_config(const FlatConfig& cfg);
  /// Every collective and transfer in flight (Note [Communication context]).
  CommContext& comm() { return *comm_; }
  Phase phase() const { return phase_; }
  /// Adds a unit (the first call makes the root).
  Unit& add_unit(const std::string& fqn);
  /// Adds `flat` to `u` and, for a trainable one, sets the hooks that report each of its
  /// parameters' gradients (to on_param_grad()).
  void add_flat(Unit& u, std::unique_ptr<FlatParam> flat);

  // Hooks, in the order an iteration calls them.
  void pre_forward(Unit& u);
  void post_forward(Unit& u, std::vector<at::Tensor>& outputs);
  void pre_backward(Unit& u);
  /// A parameter's gradient has been accumulated (its post-accumulate hook).
  void on_param_grad(Unit& u, size_t flat, size_t slot);
  /// Queues end_of_backward() on the autograd engine once per backward pass.
  void queue_end_of_backward();
  void end_of_backward();

  /// With offload: blocks until no copy from or to the host shards is in flight, so the
  /// caller may write them (Note [Offload transfers]).
  void wait_transfers();
  /// The gradient shards the trainable flat parameters hold (those defined), in unit order.
  std::vector<at::Tensor> grad_shards() const;
  /// Brings MemoryStats::grad_shards up to date after what the engine does not see: an
  /// optimizer freeing gradient shards (zero_grad with set_to_none). Called when a
  /// backward starts and ends and when the stats are read; inside backward each flat
  /// parameter counts its gradient where the engine gives it one (FlatParam::count_grad).
  void recount_grads();
  /// Called with true when a backward starts, before any shard gets a gradient, and with
  /// false once it has ended (fsdp::ShardParamGroups keeps its views' .grad() in step).
  void add_backward_observer(std::function<void(bool starting)> f) {
    backward_observers_.push_back(std::move(f));
  }
  /// What must run before this model's shards, or an optimizer's state over them,
  /// change: an asynchronous save's background staging waits there (Note [Background
  /// staging]). The end of every backward runs it last; FusedAdamW::step,
  /// import_consolidated and a FullParamsScope's writeback run it through
  /// shard_change_barrier_of(). Empty: nothing.
  void set_shard_change_barrier(std::function<void()> barrier) {
    shard_change_barrier_ = std::move(barrier);
  }
  void shard_change_barrier() const {
    if (shard_change_barrier_) shard_change_barrier_();
  }
  /// Tests only (detail::set_save_hook): what a save of this model calls before each of
  /// its steps. Empty: nothing.
  using SaveHook = std::function<void(const std::string&, const std::string&)>;
  void set_save_hook(SaveHook hook) { save_hook_ = std::move(hook); }
  const SaveHook& save_hook() const { return save_hook_; }
  /// Inside a NoSyncScope: backward keeps unsharded gradients instead of reducing.
  bool no_sync() const { return !comm_->gradient_sync(); }
  void set_no_sync(bool on) { comm_->set_gradient_sync(!on); }
  /// Non-root units not in the sharded state.
  int gathered_non_root() const;
  /// Parameter elements of the non-root, non-persistent units not in the sharded state;
  /// with `gathering_only`, of those whose gather is still in flight.
  int64_t gathered_non_root_numel(bool gathering_only) const;
  /// The unit named `fqn` (clean FQN, "" for the root); an error listing the units'
  /// FQNs otherwise. `what` names the caller in it.
  Unit& unit_named(const std::string& fqn, const char* what) const;
  /// Explicit prefetch (FSDP2's set_modules_to_forward_prefetch and
  /// set_modules_to_backward_prefetch): when `u` starts its forward (or backward), gather
  /// `targets` instead of the units the recorded order would prefetch. Replaces an
  /// earlier list for `u`.
  void set_prefetch(const Unit& u, bool forward, std::vector<Unit*> targets);
  /// false: units stay gathered after backward, until a backward with true or reshard().
  void set_reshard_after_backward(bool on);
  /// Host buffers the last asynchronous save staged into, kept for the next one
  /// (detail::checkpoint_staging_pool); they go with the model.
  std::map<std::string, at::Tensor>& staging_pool() { return staging_pool_; }

 private:
  /// At the root's forward: reshards units left sharded-in-progress and units kept
  /// gathered whose shards changed on some rank (Note [Writes the version counter misses]).
  void reshard_changed();
  void prefetch_from(const Unit& u, int direction);
  /// prefetch_from()'s gathers.
  void prefetch_gathers(const Unit& u, int direction);
  /// The k-th unit (k >= 1) after `u` in prefetch order for `direction` (+1 forward, -1
  /// backward), or null past the end.
  Unit* prefetch_candidate(const Unit& u, int direction, int k) const;
  Unit* neighbour(const Unit& u, int step) const;
  bool reshard_after_forward(const Unit& u) const;
  /// kZero2 and kZero1: full parameters persist between steps (Note [Persistent parameters]).
  bool persistent() const;

  ShardingOptions options_;
  FlatConfig flat_cfg_;
  Accounting acct_;
  std::vector<std::shared_ptr<Unit>> units_;  ///< root first, then in module order
  std::vector<FlatParam*> flats_;             ///< owned by units_; cleared with them
  std::unique_ptr<CommContext> comm_;         ///< set by set_flat_config()
  Phase phase_ = Phase::kIdle;
  std::vector<Unit*> forward_order_;  ///< first call of each unit, first iteration
  bool order_frozen_ = false;         ///< forward order recorded
  std::map<std::string, at::Tensor> staging_pool_;
  /// set_prefetch(): [0] forward, [1] backward.
  std::map<const Unit*, std::vector<Unit*>> explicit_prefetch_[2];
  std::vector<std::function<void(bool)>> backward_observers_;  ///< add_backward_observer()
  std::function<void()> shard_change_barrier_;                 ///< set_shard_change_barrier()
  SaveHook save_hook_;                                         ///< set_save_hook()
};

}  // namespace detail
}  // namespace fsdp
