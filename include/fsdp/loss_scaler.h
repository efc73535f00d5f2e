#pragma once
// Dynamic loss scaling for fp16 training, with DeepSpeed's semantics.

#include <fsdp/fully_sharded_module.h>

#include <torch/torch.h>

#include <optional>

namespace fsdp {

/// DeepSpeed's fp16 knobs, with its defaults.
struct LossScalerOptions {
  /// > 0: a static scale that never changes (overflowing steps are still skipped).
  double loss_scale = 0;
  /// The dynamic scale starts at 2^initial_scale_power.
  int initial_scale_power = 16;
  /// Clean steps after the last overflow before the scale doubles.
  int loss_scale_window = 1000;
  /// Overflows absorbed before the scale halves (restored after a clean window).
  int hysteresis = 2;
  /// The scale never goes below this; an overflow at it is an error.
  double min_loss_scale = 1;
};

/// What the scaler knows; inspect it, and save and restore it with checkpoints.
struct LossScalerState {
  double scale = 65536;                  ///< current loss scale
  int64_t iteration = 0;                 ///< update() calls so far
  int64_t last_overflow_iteration = -1;  ///< iteration of the last overflow, -1 if none
  int hysteresis_left = 2;               ///< overflows still absorbed before halving
  int64_t skipped_steps = 0;             ///< optimizer steps skipped for overflow
};

/// Use as:  scaler.scale(loss).backward(); scaler.unscale_(); clip...; scaler.step(opt);
/// scaler.update();
class PipelinedModel;  // fsdp/pipeline.h

class LossScaler {
 public:
  explicit LossScaler(ShardedModel model, LossScalerOptions options = {});
  /// For a pipelined model: its stage's gradients, and the decision to skip a step
  /// agreed over every stage (PipelinedModel::world), so that all stages step together.
  /// Scale the loss in the PipelineLossFn (scale(loss)); the mean loss train_step returns
  /// is then scaled too.
  explicit LossScaler(PipelinedModel& model, LossScalerOptions options = {});

  /// loss * scale.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides the gradient shards by the scale and decides, agreed across all ranks,
  /// whether any gradient is inf or nan. Idempotent within a step.
  void unscale_();
  /// Steps `optimizer` unless this step overflowed (on every rank alike). Returns
  /// whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Adjusts the scale after the step (hysteresis, window, minimum). Throws when an
  /// overflow happens at the minimum scale.
  void update();

  /// True when the current step overflowed (after unscale_ or step).
  bool overflowed() const { return overflow_; }
  const LossScalerState& state() const { return state_; }
  void load_state(const LossScalerState& state) { state_ = state; }
  const LossScalerOptions& options() const { return options_; }

 private:
  ShardedModel model_;
  /// The group that agrees on skipping: the model's, or a pipeline's whole world.
  std::optional<ProcessGroup> agree_;
  LossScalerOptions options_;
  LossScalerState state_;
  bool unscaled_ = false;  ///< unscale_ ran in this step
  bool overflow_ = false;  ///< this step's gradients held inf or nan
};

}  // namespace fsdp
