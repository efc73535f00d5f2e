#pragma once
// What train_gpt reports as it trains, on rank 0: a summary before the first step, a
// progress line every --log-every steps (and after the last), and with --log-jsonl one
// JSON object per step.

#include <fsdp/fsdp.h>

#include "data.h"
#include "flags.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>

namespace lm {

/// One step, as the log reports it.
struct StepRecord {
  int64_t step = 0;                ///< steps done, this one included
  double loss = 0;                 ///< the training loss, the mean over ranks
  double val_loss = std::nan("");  ///< on progress steps with a validation split; else NaN
  double lr = 0;                   ///< the learning rate the step used
  double step_s = 0;               ///< the step's wall time, in seconds
  double tokens_per_s = 0;         ///< the global batch's tokens over step_s
  int64_t peak_bytes = 0;          ///< the engine's peak: shards, gradients, gathers, buffers
  fsdp::stats::CommStats comm;     ///< this step's communication and offload copies
  int64_t recomputes = 0;          ///< regions recomputed so far (this rank)
  /// --offload-activations: the most bytes of checkpointed inputs held on the host at once
  int64_t offloaded_activation_bytes = 0;
  std::optional<fsdp::LossScalerState> loss_scaler;  ///< fp16: the scale, steps skipped
};

/// Fills a record's engine figures (peak_bytes, comm, recomputes) after a step.
void read_engine_stats(const fsdp::ShardedModel& model, StepRecord& r);

/// Prints, before training, the parameters, the synthetic task's reference losses and
/// the --data split (rank 0 calls it).
/// This process's peak resident memory (VmHWM) in MiB, or -1 where /proc does not say.
int64_t peak_rss_mib();

void print_summary(const fsdp::ShardedModel& model, const Flags& flags, const Data& data,
                   int world);

class TrainLog {
 public:
  /// Opens --log-jsonl on rank 0; a UsageError if it cannot be written.
  TrainLog(const OutputFlags& output, int64_t steps, bool main_rank);

  /// Starts the clock (for elapsed time and eta) before the run's first step.
  void start(int64_t first_step, int64_t last_step);
  /// Whether the step that makes `steps_done` prints a progress line (on every rank:
  /// the validation loss, which it shows, is collective).
  bool progress_after(int64_t steps_done) const;
  /// Rank 0: the JSONL object, and on progress steps the progress line.
  void write(const StepRecord& r);

 private:
  void print_progress(const StepRecord& r) const;

  int64_t steps_;      ///< --steps, which the schedule spans
  int64_t log_every_;  ///< steps between progress lines
  bool main_rank_;
  std::ofstream jsonl_;
  std::chrono::steady_clock::time_point t0_;
  int64_t first_step_ = 0, last_step_ = 0;  ///< this run's steps: [first_step_, last_step_)
};

}  // namespace lm
