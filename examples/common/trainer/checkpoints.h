#pragma once
// train_gpt's checkpoint policy: where training starts (--resume from the newest
// checkpoint in --save-dir), when it saves (every --save-every steps and at the end,
// keeping the newest --keep, in the background with --async-save), where it stops
// (--stop-at, as if preempted) and what it leaves (--consolidate-to).

#include <fsdp/fsdp.h>

#include "flags.h"
#include "io_log.h"

#include <cstdint>
#include <optional>

namespace lm {

class CheckpointPolicy {
 public:
  /// Opens --io-log. `scaler` (fp16) may be null; what it points to must outlive this.
  CheckpointPolicy(const Flags& flags, fsdp::ShardedModel model, torch::optim::Optimizer& opt,
                   fsdp::LossScaler* scaler, fsdp::ProcessGroup pg);
  /// A pipelined run (--pipeline-stages): `pipeline`'s checkpoints, of every stage at
  /// once; `opt` steps this rank's stage. `pipeline` must outlive this.
  CheckpointPolicy(const Flags& flags, fsdp::PipelinedModel& pipeline, torch::optim::Optimizer& opt,
                   fsdp::LossScaler* scaler, fsdp::ProcessGroup pg);

  /// --resume: loads the newest checkpoint, if any, into the model, optimizer and loss
  /// scaler. Returns the step to start from (0 for a fresh start).
  int64_t resume();
  /// The step after which this run stops: --stop-at if given, else --steps.
  int64_t last_step(int64_t first_step) const;

  /// Whether to save after `steps_done` steps (every --save-every).
  bool due(int64_t steps_done) const;
  /// Saves the state after `steps_done` steps (in the background with --async-save).
  void save(int64_t steps_done);
  /// After the last step, `final_step`: saves unless that step is saved, waits for a
  /// background save, and writes --consolidate-to.
  void finish(int64_t final_step);

 private:
  /// What a checkpoint carries besides weights and optimizer state.
  fsdp::ckpt::TrainingState training_state(int64_t step) const;
  /// --io-log: how long training waited for the save in flight's background staging.
  void log_staging_wait();

  const Flags& flags_;
  const CheckpointFlags& ckpt_;
  fsdp::ShardedModel model_;
  torch::optim::Optimizer& opt_;
  fsdp::LossScaler* scaler_;
  fsdp::PipelinedModel* pipeline_ = nullptr;  ///< a pipelined run's model; null otherwise
  bool main_rank_;
  IoLog io_log_;
  fsdp::ckpt::SaveOptions save_opts_;
  /// The step of the newest checkpoint (or the resumed one); -1 before any, so that a
  /// fresh run of --steps 0 with --save-dir saves step 0 (a conversion).
  int64_t last_saved_ = -1;
  fsdp::ckpt::AsyncSave pending_;  ///< --async-save: the save in flight
};

}  // namespace lm
