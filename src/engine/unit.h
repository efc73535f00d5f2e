#pragma once
// A unit: the flat parameters of one wrap point, their gradient buffers, and whether
// their full parameters are in place (its ShardedState). It works through the model's
// communication context and knows nothing above it (docs/design.md, "Layering").

#include "comm_context.h"
#include "flat_param.h"
#include "grad_buffer.h"
#include "trace/trace.h"

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {

/// Where a unit's full parameters are. Transitions: kSharded -> kGathering
/// (start_gather) -> kUnsharded (unshard) -> kSharded (reshard); unshard() may also go
/// from kSharded straight to kUnsharded, and reshard() from kGathering (after waiting).
enum class ShardedState {
  kSharded,    ///< only the fp32 shard is held
  kGathering,  ///< an all-gather is in flight (prefetch); wait before use
  kUnsharded,  ///< full parameters are in place
};

const char* to_string(ShardedState s);

class Unit {
 public:
  /// `comm` is the model's communication context; it must outlive the unit's use
  /// (detach() forgets it).
  Unit(std::string fqn, int index, CommContext& comm)
      : fqn_(std::move(fqn)), index_(index), comm_(&comm) {}

  const std::string& fqn() const { return fqn_; }
  /// "<root>" for the root, else the FQN; for messages.
  std::string display_name() const { return fqn_.empty() ? "<root>" : "'" + fqn_ + "'"; }
  /// The FQN, "<root>" for the root; for trace spans (Note [Per-unit trace]).
  std::string trace_name() const { return fqn_.empty() ? "<root>" : fqn_; }
  int index() const { return index_; }
  /// The model's communication context (not after detach()).
  CommContext& comm() const;
  /// Called by the runtime's destructor: frees the flat parameters while the counters
  /// they report to still exist (wrap points, which hold units, may outlive the
  /// runtime) and forgets the communication context.
  void detach();
  bool is_root() const { return index_ == 0; }
  ShardedState state() const { return state_; }
  const std::vector<std::unique_ptr<FlatParam>>& flats() const { return flats_; }
  /// Adds a flat parameter (trainable ones first, then frozen) and, for a trainable one,
  /// its gradient buffer. The runtime sets the hooks that call on_param_grad().
  void add_flat(std::unique_ptr<FlatParam> flat);
  bool has_frozen() const;
  int64_t full_bytes() const;

  /// Issues the all-gather (idempotent: no-op unless sharded).
  void start_gather();
  /// While sharded, queues the reads of the next gather's inputs from parameter files
  /// (Note [NVMe parameters]; no-op without them).
  void read_ahead();
  /// Ensures the full parameters are in place (waits for a prefetch if one is in flight).
  void unshard();
  /// Frees the full parameters (waits for an in-flight gather first). Idempotent. With
  /// `keep_slice` (after a training forward, with a reshard group) each flat parameter
  /// keeps its post-forward slice (Note [Post-forward slices]); without, slices go too.
  void reshard(bool keep_slice = false);

  /// Before backward: points the original parameters' .grad() into the gradient shards
  /// where gradients accumulate in place (GradBuffer::link()).
  void link_grads();
  /// After backward: the gradient shards become the only owners of the gradient bytes
  /// (GradBuffer::unlink()).
  void unlink_grads();
  /// One original parameter's gradient has been accumulated. When the last trainable
  /// one of a flat parameter arrives, its gradient is reduced (and, if allowed, the unit
  /// reshards).
  void on_param_grad(size_t flat, size_t slot);
  /// Reduces whatever gradients arrived (unused parameters count as zero).
  void flush_grads();

  // Per-iteration flags, reset at the end of backward.
  bool grads_reduced = false;  ///< all trainable grads reduced in this backward
  bool keep_fp32 = false;      ///< excluded from mixed precision (MixedPrecision::keep_fp32_policy)
  /// ShardedModel::set_reshard_after_backward: false keeps the full parameters gathered
  /// after backward (its gradients reduced, or the end of backward). Persistent
  /// strategies (kZero2, kZero1) start with false.
  bool reshard_after_backward = true;
  /// kZero1: gradients stay unsharded until the end of backward, which reduces them all
  /// (DeepSpeed's stage 1 reduces after backward, not during it).
  bool defer_reduction = false;
  /// Full parameters kept between uses (Note [Persistent parameters]): under kZero2 and
  /// kZero1, and for units below ShardingOptions::persistence_threshold_numel.
  bool persistent = false;
  /// Padded parameter elements of its flat parameters (the full parameters' length).
  int64_t numel() const;
  /// Some flat parameter's full buffer is stale (FlatParam::stale()).
  bool stale() const;
  /// Some flat parameter changed since its gather (FlatParam::changed_since_gather()).
  bool changed_since_gather() const;
  /// Note [Per-unit trace]: this unit's forward (or recompute) and backward spans.
  trace::OpenSpan forward_span;
  trace::OpenSpan backward_span;

 private:
  /// Hands flat `i`'s gradient to the communication context (or keeps it, under no_sync,
  /// or until the end of backward with defer_reduction unless `at_end`).
  void reduce(size_t i, bool at_end);

  std::string fqn_;
  int index_;
  CommContext* comm_;
  ShardedState state_ = ShardedState::kSharded;
  std::vector<std::unique_ptr<FlatParam>> flats_;   ///< trainable first, then frozen
  std::vector<std::unique_ptr<GradBuffer>> grads_;  ///< one per flat; null for frozen ones
};

}  // namespace detail
}  // namespace fsdp
