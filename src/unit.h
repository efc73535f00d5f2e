#pragma once
// A unit: the flat parameters of one wrap point, with its sharded/unsharded state.

#include "flat_param.h"
#include "internal.h"

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

class Runtime;

enum class UnitState {
  kSharded,    ///< only the fp32 shard is held
  kGathering,  ///< an all-gather is in flight (prefetch); wait before use
  kUnsharded,  ///< full parameters are in place
};

const char* to_string(UnitState s);

class Unit : public UnitCore {
 public:
  Unit(std::string fqn, int index, Runtime* runtime) : fqn_(std::move(fqn)), index_(index), rt_(runtime) {}
  /// Waits for gathers still in flight: their buffers go with the flat parameters.
  ~Unit();

  const std::string& fqn() const { return fqn_; }
  /// "<root>" for the root, else the FQN; for messages.
  std::string display_name() const { return fqn_.empty() ? "<root>" : "'" + fqn_ + "'"; }
  int index() const { return index_; }
  Runtime& runtime() const { return *rt_; }
  bool is_root() const { return index_ == 0; }
  UnitState state() const { return state_; }
  std::vector<std::unique_ptr<FlatParam>>& flats() { return flats_; }
  const std::vector<std::unique_ptr<FlatParam>>& flats() const { return flats_; }
  bool has_frozen() const;
  int64_t full_bytes() const;

  /// Issues the all-gather (idempotent: no-op unless sharded).
  void start_gather();
  /// Ensures the full parameters are in place (waits for a prefetch if one is in flight).
  void unshard();
  /// Frees the full parameters (waits for an in-flight gather first). Idempotent.
  void reshard();

  /// One original parameter's gradient has been accumulated. When the last trainable
  /// one arrives, the unit's gradients are reduced (and, if allowed, it reshards).
  void on_param_grad(FlatParam& flat, size_t slot);
  /// Attaches post-accumulate hooks to every trainable original parameter.
  void register_grad_hooks();
  /// Reduces whatever gradients arrived (unused parameters count as zero).
  void flush_grads();

  // Per-iteration flags, reset at the end of backward.
  bool grads_reduced = false;  ///< all trainable grads reduced in this backward
  bool keep_fp32 = false;      ///< excluded from mixed precision (MixedPrecision::keep_fp32_policy)

 private:
  std::string fqn_;
  int index_;
  Runtime* rt_;
  UnitState state_ = UnitState::kSharded;
  std::vector<std::unique_ptr<FlatParam>> flats_;  ///< trainable first, then frozen
  std::vector<std::shared_ptr<Work>> pending_;     ///< in-flight gathers
};

}  // namespace fsdp::detail
