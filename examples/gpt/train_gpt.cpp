// train_gpt: trains the GPT of docs/design.md, "Contracts", sharded over every rank of the job.
//
//   build/bin/train_gpt --steps 200                      # one process
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_gpt  # two ranks on this machine
//
// Without --data it learns a synthetic byte-level task generated from --seed: text from
// a random Markov chain over 32 characters in which each character has two likely
// successors. A model that ignores context cannot beat the unigram entropy printed at
// the start; a GPT that learns the chain approaches the conditional entropy.
#include <fsdp/fsdp.h>

#include "../common/cli.h"
#include "architecture.h"
#include "data.h"
#include "flags.h"
#include "gpt_model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

namespace {

using examples::UsageError;
using gpt::Data;

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int i = 0;
  while (b >= 1024 && i < 4) {
    b /= 1024;
    ++i;
  }
  std::ostringstream os;
  os.precision(i == 0 ? 0 : 1);
  os << std::fixed << b << " " << units[i];
  return os.str();
}

std::string human_seconds(double s) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed;
  if (s < 60) {
    os << s << "s";
  } else {
    os << static_cast<int>(s / 60) << "m" << static_cast<int>(std::fmod(s, 60)) << "s";
  }
  return os.str();
}

int run(int argc, char** argv) {
  const std::optional<gpt::Flags> flags = gpt::parse_flags(argc, argv);
  if (!flags) return 0;  // --help
  const gpt::Flags& f = *flags;
  const gpt::Config& cfg = f.model;
  const int64_t batch = f.training.batch_size;
  const int64_t accum = f.training.grad_accum;
  const int64_t steps = f.training.steps;
  const double lr = f.training.lr;
  const int64_t warmup = f.training.warmup_steps;
  const std::string& schedule = f.training.lr_schedule;
  const double clip = f.training.clip_grad;
  const uint64_t seed = f.training.seed;
  const double val_fraction = f.training.val_fraction;
  const std::string& precision = f.sharding.precision;
  Data data(seed, f.training.data, val_fraction);
  data.check(cfg.block_size);

  fsdp::ProcessGroup pg = fsdp::init_process_group();
  const int world = pg.size();
  const bool main_rank = pg.rank() == 0;
  gpt::check_batch_for_world(f.training, world);
  gpt::check_checkpoint_flags(f.checkpoint, steps);
  const std::string& save_dir = f.checkpoint.save_dir;
  const int64_t save_every = f.checkpoint.save_every;
  const int64_t keep = f.checkpoint.keep;
  const bool resume = f.checkpoint.resume;
  const std::string& consolidate_to = f.checkpoint.consolidate_to;
  const std::string& init_from = f.checkpoint.init_from;
  const int64_t stop_at = f.checkpoint.stop_at;
  fsdp::ShardingOptions so = f.sharding.options;
  so.process_group = pg;

  torch::manual_seed(seed);
  auto model = fsdp::fully_shard(gpt::GPT(cfg), so);
  // --init-from: the starting weights come from a consolidated file (written by this
  // program, fsdp-consolidate or another framework with h5py). Loaded before the
  // optimizer exists, so it starts fresh; a --resume that finds a checkpoint replaces them.
  if (!init_from.empty()) {
    fsdp::import_consolidated(init_from, model);
    if (main_rank) std::cout << "train_gpt: initial weights from " << init_from << std::endl;
  }
  std::optional<fsdp::LossScaler> scaler;
  if (precision == "fp16") {
    fsdp::LossScalerOptions lso;
    lso.initial_scale_power = f.sharding.loss_scale_power;
    scaler.emplace(model, lso);
  }
  // Shards in host memory (CPU training, or offload) step with the fused SIMD AdamW;
  // shards on a GPU with LibTorch's. Under bf16 the fused step also writes each shard's
  // bf16 copy, which the next gathers send instead of casting the shard again.
  const auto adamw = torch::optim::AdamWOptions(lr).weight_decay(f.training.weight_decay);
  std::unique_ptr<torch::optim::AdamW> opt_ptr;
  if (so.cpu_offload || so.device.is_cpu()) {
    opt_ptr = std::make_unique<fsdp::FusedAdamW>(model, adamw);
  } else {
    opt_ptr = std::make_unique<torch::optim::AdamW>(model.sharded_parameters(), adamw);
  }
  torch::optim::AdamW& opt = *opt_ptr;

  // What a checkpoint carries besides weights and optimizer state: enough for
  // generate (the architecture) and for an exact resume (the step; batches are a
  // function of the step and the seed).
  auto training_state = [&](int64_t step) {
    fsdp::TrainingState st;
    st.step = step;
    st.model_attrs = gpt::architecture_attrs(cfg);
    st.extra = {{"seed", std::to_string(seed)}, {"data", f.training.data}};
    if (scaler) st.loss_scaler = scaler->state();
    return st;
  };
  // --io-log: each save, load and export timed on rank 0 from a barrier to a barrier, so
  // the figure is the slowest rank's (scripts/compare-pytorch.sh compares it with DCP's).
  const std::string& io_log_path = f.output.io_log;
  std::ofstream io_log;
  if (main_rank && !io_log_path.empty()) {
    io_log.open(io_log_path, std::ios::app);
    if (!io_log) throw UsageError("--io-log " + io_log_path + ": cannot write the file");
  }
  auto timed = [&](const char* event, const std::function<std::string()>& op) {
    if (!io_log_path.empty()) pg.barrier();
    const auto start = std::chrono::steady_clock::now();
    const std::string path = op();
    if (!io_log_path.empty()) pg.barrier();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (io_log.is_open())
      io_log << nlohmann::json{{"event", event}, {"path", path}, {"seconds", s}}.dump()
             << std::endl;
  };
  int64_t first_step = 0;
  if (resume) {
    if (auto latest = fsdp::latest_checkpoint(save_dir)) {
      fsdp::TrainingState st;
      timed("load", [&] { return fsdp::load_sharded_checkpoint(save_dir, model, &opt, &st).path; });
      if (st.extra.count("seed") && st.extra.at("seed") != std::to_string(seed) && main_rank) {
        std::cout << "train_gpt: warning: the checkpoint was trained with --seed "
                  << st.extra.at("seed") << ", this run uses " << seed
                  << " (the data stream changes)\n";
      }
      first_step = st.step;
      if (scaler && st.loss_scaler) scaler->load_state(*st.loss_scaler);
      if (main_rank)
        std::cout << "train_gpt: resumed from " << *latest << " at step " << first_step
                  << std::endl;
    } else if (main_rank) {
      std::cout << "train_gpt: --resume: no checkpoint in " << save_dir
                << " yet; starting from step 0" << std::endl;
    }
  }
  fsdp::SaveOptions save_opts;
  save_opts.keep_last = static_cast<int>(keep);
  save_opts.verbose = true;
  int64_t last_saved = first_step;
  const bool async_save = f.checkpoint.async_save;
  fsdp::AsyncSave pending;  // --async-save: the save in flight
  auto save = [&](int64_t at_step) {
    timed("save", [&] {
      if (!async_save)
        return fsdp::save_sharded_checkpoint(save_dir, model, &opt, training_state(at_step),
                                             save_opts);
      pending = fsdp::save_sharded_checkpoint_async(save_dir, model, &opt, training_state(at_step),
                                                    save_opts);
      return pending.path();
    });
    last_saved = at_step;
  };

  std::ofstream jsonl;
  if (main_rank && !f.output.log_jsonl.empty()) {
    jsonl.open(f.output.log_jsonl);
    if (!jsonl) throw UsageError("--log-jsonl " + f.output.log_jsonl + ": cannot write the file");
  }
  // Parameters, each counted once: tied ones (aliases) share their unit's offset.
  int64_t n_params = 0;
  std::set<std::string> units;
  std::set<std::tuple<std::string, bool, int64_t>> seen;
  for (const auto& p : model.param_table()) {
    units.insert(p.unit_fqn);
    if (seen.emplace(p.unit_fqn, p.requires_grad, p.offset).second) n_params += p.numel;
  }
  if (main_rank) {
    std::cout << "train_gpt: " << n_params << " parameters, " << cfg.n_layer << " layers, d_model "
              << cfg.d_model << ", world size " << world << ", " << units.size() << " units\n";
    if (data.synthetic()) {
      std::cout << "train_gpt: synthetic Markov task; reference: unigram entropy "
                << data.unigram_entropy(cfg.block_size)
                << " nats (no context), conditional entropy " << data.conditional_entropy()
                << " nats (the floor)\n";
    }
    std::cout << std::flush;
  }

  // Validation loss over the held-out part: the same 4 batches every time, each rank its
  // rows, no gradients, dropout off; the mean over ranks and batches.
  auto val_loss = [&]() {
    constexpr int64_t kValBatches = 4;
    torch::NoGradGuard no_grad;
    model->eval();
    auto sum = torch::zeros({1}, torch::kDouble);
    for (int64_t i = 0; i < kValBatches; ++i) {
      auto rows = data.val_batch(i, batch, cfg.block_size);
      auto mine = rows.narrow(0, pg.rank() * (batch / world), batch / world);
      sum += gpt::loss_on(model, mine).to(torch::kDouble).reshape({1});
    }
    model->train();
    pg.all_reduce_sum(sum);
    return sum.item<double>() / static_cast<double>(world * kValBatches);
  };
  if (main_rank && data.validates()) {
    std::cout << "train_gpt: " << f.training.data << ": " << data.train_bytes()
              << " bytes to train on, " << data.val_bytes()
              << " held out for validation (--val-fraction " << val_fraction << ")" << std::endl;
  }
  const int64_t log_every = f.output.log_every;
  const int64_t micro = batch / accum;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t last_step = stop_at > 0 ? std::max(first_step, stop_at) : steps;
  for (int64_t step = first_step; step < last_step; ++step) {
    double step_lr = lr;
    if (step < warmup) {
      step_lr = lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
    } else if (schedule == "cosine") {
      double progress = static_cast<double>(step - warmup) / std::max<int64_t>(1, steps - warmup);
      step_lr = lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)));
    }
    for (auto& g : opt.param_groups())
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(step_lr);

    const auto ts = std::chrono::steady_clock::now();
    auto global = data.batch(step, batch, cfg.block_size);
    double loss_sum = 0;
    for (int64_t m = 0; m < accum; ++m) {
      auto rows = global.narrow(0, m * micro, micro);
      auto mine = rows.narrow(0, pg.rank() * (micro / world), micro / world);
      auto loss = gpt::loss_on(model, mine) / static_cast<double>(accum);
      (scaler ? scaler->scale(loss) : loss).backward();
      loss_sum += loss.item<double>();
    }
    if (scaler) scaler->unscale_();  // before clipping: the norm is of the true gradients
    // (A step whose gradients overflowed is skipped: nothing to clip.)
    if (clip > 0 && !(scaler && scaler->overflowed())) fsdp::clip_grad_norm_(model, clip);
    if (scaler) {
      scaler->step(opt);  // skipped, on every rank alike, when a gradient is inf or nan
      scaler->update();
    } else {
      opt.step();
    }
    opt.zero_grad();
    auto l = torch::tensor({loss_sum}, torch::kDouble);
    pg.all_reduce_sum(l);
    const double loss = l.item<double>() / world;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count();
    const double tok_s = static_cast<double>(batch * cfg.block_size) / dt;
    auto mem = model.memory_stats();
    const int64_t peak = mem.sharded_params.peak + mem.grad_shards.peak + mem.gathered_params.peak +
                         mem.comm_buffers.peak;
    const fsdp::CommStats step_comm = model.comm_stats().step;
    const int64_t comm = step_comm.total_bytes();
    const bool progress = (step + 1) % log_every == 0 || step + 1 == last_step;
    const double vloss = data.validates() && progress ? val_loss() : std::nan("");  // collective
    if (main_rank) {
      if (jsonl.is_open()) {
        nlohmann::json j = {{"step", step + 1},
                            {"loss", loss},
                            {"lr", step_lr},
                            {"tokens_per_s", tok_s},
                            {"step_s", dt},
                            {"peak_bytes", peak},
                            {"comm_bytes", comm},
                            // What shows the features ran: regions recomputed so far (this
                            // rank), and this step's offload copies.
                            {"recomputes", fsdp::activation_recomputes()},
                            {"offload_to_device_bytes", step_comm.offload_to_device_bytes},
                            {"offload_to_host_bytes", step_comm.offload_to_host_bytes}};
        if (!std::isnan(vloss)) j["val_loss"] = vloss;
        if (scaler) {
          j["loss_scale"] = scaler->state().scale;
          j["skipped_steps"] = scaler->state().skipped_steps;
        }
        jsonl << j.dump() << "\n" << std::flush;
      }
      if (progress) {
        double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        double eta = elapsed / static_cast<double>(step + 1 - first_step) *
                     static_cast<double>(last_step - step - 1);
        std::cout << "step " << step + 1 << "/" << steps << " | loss " << std::fixed
                  << std::setprecision(4) << loss
                  << (std::isnan(vloss) ? std::string()
                                        : " | val loss " + std::to_string(vloss).substr(0, 6))
                  << " | lr " << std::scientific << std::setprecision(2) << step_lr << std::fixed
                  << " | " << std::setprecision(0) << tok_s << " tok/s | engine peak "
                  << human_bytes(static_cast<double>(peak)) << " | comm "
                  << human_bytes(static_cast<double>(comm)) << "/step"
                  << (scaler ? " | loss scale " +
                                   std::to_string(static_cast<int64_t>(scaler->state().scale)) +
                                   ", skipped " + std::to_string(scaler->state().skipped_steps)
                             : std::string())
                  << " | elapsed " << human_seconds(elapsed) << " | eta " << human_seconds(eta)
                  << std::endl;
      }
    }
    if (save_every > 0 && (step + 1) % save_every == 0) {
      save(step + 1);
    }
  }
  const int64_t final_step = std::max(first_step, last_step);
  if (!save_dir.empty() && last_saved != final_step) {
    save(final_step);
  }
  if (async_save && !pending.path().empty()) {
    timed("save_wait", [&] { return pending.wait(); });
  }
  if (stop_at > 0 && main_rank) {
    std::cout << "train_gpt: stopped at step " << final_step << " of " << steps << " (--stop-at)"
              << (save_dir.empty() ? "" : "; continue with --resume") << std::endl;
  }
  if (!consolidate_to.empty()) {
    fsdp::ExportOptions eo;
    timed("export", [&] {
      fsdp::export_consolidated(consolidate_to, model, nullptr, training_state(final_step), eo);
      return consolidate_to;
    });
    if (main_rank)
      std::cout << "train_gpt: wrote consolidated weights to " << consolidate_to << std::endl;
  }
  if (scaler) {
    // Every rank reports: skipping is agreed across ranks, so these lines must match.
    std::cout << "train_gpt: rank " << pg.rank() << ": fp16 skipped "
              << scaler->state().skipped_steps << " of " << final_step << " steps, loss scale "
              << static_cast<int64_t>(scaler->state().scale) << std::endl;
  }
  if (main_rank) std::cout << "train_gpt: done" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::program_main("train_gpt", [&] { return run(argc, argv); });
}
