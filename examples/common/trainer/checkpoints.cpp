#include "checkpoints.h"

#include "architecture.h"

#include <algorithm>
#include <iostream>

namespace lm {

CheckpointPolicy::CheckpointPolicy(const Flags& flags, fsdp::ShardedModel model,
                                   torch::optim::Optimizer& opt, fsdp::LossScaler* scaler,
                                   fsdp::ProcessGroup pg)
    : flags_(flags),
      ckpt_(flags.checkpoint),
      model_(std::move(model)),
      opt_(opt),
      scaler_(scaler),
      main_rank_(pg.rank() == 0),
      io_log_(flags.output.io_log, pg, flags.sharding.options.device) {
  save_opts_.keep_last = static_cast<int>(ckpt_.keep);
  save_opts_.verbose = true;
  // The loop steps only after a backward, which waits for the copies (Note [Background staging]).
  save_opts_.background_staging = true;
}

CheckpointPolicy::CheckpointPolicy(const Flags& flags, fsdp::PipelinedModel& pipeline,
                                   torch::optim::Optimizer& opt, fsdp::LossScaler* scaler,
                                   fsdp::ProcessGroup pg)
    : CheckpointPolicy(flags, pipeline.stage_model(), opt, scaler, std::move(pg)) {
  pipeline_ = &pipeline;
}

// Enough for generate (the architecture) and for an exact resume (the step; batches are
// a function of the step and the seed).
fsdp::ckpt::TrainingState CheckpointPolicy::training_state(int64_t step) const {
  fsdp::ckpt::TrainingState st;
  st.step = step;
  st.model_attrs = architecture_attrs(flags_.model);
  // A Hugging Face family under its own names: config.json rides along, so that
  // fsdp-consolidate --format safetensors makes a model directory of the checkpoint.
  const Program& p = program_info();
  if (p.hf_config_json && !p.hf_layout)
    st.model_attrs["hf_config"] = p.hf_config_json(flags_.model);
  st.extra = {{"seed", std::to_string(flags_.training.seed)}, {"data", flags_.training.data}};
  if (scaler_) st.loss_scaler = scaler_->state();
  return st;
}

int64_t CheckpointPolicy::resume() {
  if (!ckpt_.resume) return 0;
  const std::string& dir = ckpt_.save_dir;
  auto latest = fsdp::ckpt::latest_checkpoint(dir);
  if (!latest) {
    if (main_rank_) {
      std::cout << program() << ": --resume: no checkpoint in " << dir
                << " yet; starting from step 0" << std::endl;
    }
    return 0;
  }
  fsdp::ckpt::TrainingState st;
  io_log_.timed("load", [&] {
    return pipeline_ ? fsdp::ckpt::load_sharded_checkpoint(dir, *pipeline_, &opt_, &st).path
                     : fsdp::ckpt::load_sharded_checkpoint(dir, model_, &opt_, &st).path;
  });
  const std::string seed = std::to_string(flags_.training.seed);
  if (st.extra.count("seed") && st.extra.at("seed") != seed && main_rank_) {
    std::cout << program() << ": warning: the checkpoint was trained with --seed "
              << st.extra.at("seed") << ", this run uses " << seed
              << " (the data stream changes)\n";
  }
  if (scaler_ && st.loss_scaler) scaler_->load_state(*st.loss_scaler);
  if (main_rank_)
    std::cout << program() << ": resumed from " << *latest << " at step " << st.step << std::endl;
  return last_saved_ = st.step;
}

int64_t CheckpointPolicy::last_step(int64_t first_step) const {
  return ckpt_.stop_at > 0 ? std::max(first_step, ckpt_.stop_at) : flags_.training.steps;
}

bool CheckpointPolicy::due(int64_t steps_done) const {
  return ckpt_.save_every > 0 && steps_done % ckpt_.save_every == 0;
}

void CheckpointPolicy::save(int64_t steps_done) {
  if (ckpt_.async_save) log_staging_wait();  // the save before, its staging long done
  io_log_.timed("save", [&] {
    const fsdp::ckpt::TrainingState st = training_state(steps_done);
    if (!ckpt_.async_save) {
      return pipeline_ ? fsdp::ckpt::save_sharded_checkpoint(ckpt_.save_dir, *pipeline_, &opt_, st,
                                                             save_opts_)
                       : fsdp::ckpt::save_sharded_checkpoint(ckpt_.save_dir, model_, &opt_, st,
                                                             save_opts_);
    }
    pending_ = pipeline_ ? fsdp::ckpt::save_sharded_checkpoint_async(ckpt_.save_dir, *pipeline_,
                                                                     &opt_, st, save_opts_)
                         : fsdp::ckpt::save_sharded_checkpoint_async(ckpt_.save_dir, model_, &opt_,
                                                                     st, save_opts_);
    return pending_.path();
  });
  last_saved_ = steps_done;
}

void CheckpointPolicy::log_staging_wait() {
  if (!pending_.path().empty())
    io_log_.record("save_staging_wait", pending_.path(), pending_.staging_wait_s());
}

void CheckpointPolicy::finish(int64_t final_step) {
  if (!ckpt_.save_dir.empty() && last_saved_ != final_step) save(final_step);
  if (ckpt_.async_save && !pending_.path().empty()) {
    io_log_.timed("save_wait", [&] { return pending_.wait(); });
    log_staging_wait();
  }
  if (ckpt_.stop_at > 0 && main_rank_) {
    std::cout << program() << ": stopped at step " << final_step << " of " << flags_.training.steps
              << " (--stop-at)" << (ckpt_.save_dir.empty() ? "" : "; continue with --resume")
              << std::endl;
  }
  if (!ckpt_.consolidate_to.empty()) {
    fsdp::ckpt::ExportOptions eo;
    io_log_.timed("export", [&] {
      if (pipeline_) {  // Note [Pipelined exports]: through a sharded checkpoint
        fsdp::ckpt::export_consolidated(ckpt_.consolidate_to, *pipeline_, nullptr,
                                        training_state(final_step), eo);
      } else {
        fsdp::ckpt::export_consolidated(ckpt_.consolidate_to, model_, nullptr,
                                        training_state(final_step), eo);
      }
      return ckpt_.consolidate_to;
    });
    if (main_rank_)
      std::cout << program() << ": wrote consolidated weights to " << ckpt_.consolidate_to
                << std::endl;
  }
}

}  // namespace lm
