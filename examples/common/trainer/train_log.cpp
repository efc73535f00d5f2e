#include "train_log.h"

#include "../cli.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

namespace lm {
namespace {

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

}  // namespace

void read_engine_stats(const fsdp::ShardedModel& model, StepRecord& r) {
  auto mem = model.memory_stats();
  r.peak_bytes = mem.sharded_params.peak + mem.grad_shards.peak + mem.gathered_params.peak +
                 mem.comm_buffers.peak;
  r.comm = model.comm_stats().step;
  r.recomputes = fsdp::activation_recomputes();
  r.offloaded_activation_bytes = mem.offloaded_activations.peak;
}

int64_t peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) / 1024;
  }
  return -1;
}

void print_summary(const fsdp::ShardedModel& model, const Flags& flags, const Data& data,
                   int world) {
  // Parameters, each counted once: tied ones (aliases) share their unit's offset.
  int64_t n_params = 0;
  std::set<std::string> units;
  std::set<std::tuple<std::string, bool, int64_t>> seen;
  for (const auto& p : model.param_table()) {
    units.insert(p.unit_fqn);
    if (seen.emplace(p.unit_fqn, p.requires_grad, p.offset).second) n_params += p.numel;
  }
  const Config& cfg = flags.model;
  std::cout << program() << ": " << n_params << " parameters, " << cfg.n_layer
            << " layers, d_model " << cfg.d_model << ", attention "
            << examples::attention_name(cfg.attention) << ", world size " << world << ", "
            << units.size() << " units\n";
  const torch::Device device = flags.sharding.options.device;
  std::cout << program() << ": device " << device.str() << " (--device " << flags.sharding.device
            << "), collectives over " << (world > 1 ? flags.sharding.backend : std::string("none"))
            << (flags.sharding.options.offload_param.device == fsdp::OffloadDevice::kCpu
                    ? ", shards offloaded to host memory"
                    : "")
            << (flags.sharding.options.offload_activations
                    ? ", checkpointed inputs offloaded to host memory"
                    : "")
            << "\n";
  const fsdp::QuantizedCommunication& q = flags.sharding.options.quantized_communication;
  const int hpz = flags.sharding.options.reshard_after_forward_group_size;
  if (q.weights || q.gradients || hpz > 0) {
    std::cout << program() << ": ZeRO++: weights gathered "
              << (q.weights ? "as int" + std::to_string(q.weight_bits) : "unquantized")
              << ", gradients reduced "
              << (q.gradients ? "as int" + std::to_string(q.gradient_bits) : "unquantized")
              << " (one scale per " << q.block_size << " elements), hpZ "
              << (hpz > 0 ? "groups of " + std::to_string(hpz) + " ranks" : "off")
              << (q.gradients && hpz > 0 ? ": gradients reduced inside each group, then across"
                                         : "")
              << "\n";
  }
  if (flags.sharding.options.mixed_precision.master_dtype == torch::kBFloat16) {
    using R = fsdp::FusedAdamW::Bf16Rounding;
    const R r = flags.sharding.bf16_rounding;
    std::cout << program() << ": pure bf16: shards, gradients and optimizer state in bf16 ("
              << (r == R::kNearest      ? "nearest"
                  : r == R::kStochastic ? "stochastic"
                                        : "compensated")
              << " rounding)\n";
  }
  std::cout << program() << ": " << (flags.sharding.sharded_construction ? "sharded" : "eager")
            << " construction: the model is " << n_params * 4 / (1024 * 1024)
            << " MiB in fp32; peak RSS of rank 0 so far " << peak_rss_mib() << " MiB\n";
  if (data.synthetic()) {
    std::cout << program() << ": synthetic Markov task; reference: unigram entropy "
              << data.unigram_entropy(cfg.block_size) << " nats (no context), conditional entropy "
              << data.conditional_entropy() << " nats (the floor)\n";
  }
  std::cout << std::flush;
  if (data.validates()) {
    std::cout << program() << ": " << flags.training.data << ": " << data.train_bytes()
              << " bytes to train on, " << data.val_bytes()
              << " held out for validation (--val-fraction " << flags.training.val_fraction << ")"
              << std::endl;
  }
}

TrainLog::TrainLog(const OutputFlags& output, int64_t steps, bool main_rank)
    : steps_(steps), log_every_(output.log_every), main_rank_(main_rank) {
  if (main_rank && !output.log_jsonl.empty()) {
    jsonl_.open(output.log_jsonl);
    if (!jsonl_)
      throw examples::UsageError("--log-jsonl " + output.log_jsonl + ": cannot write the file");
  }
}

void TrainLog::start(int64_t first_step, int64_t last_step) {
  first_step_ = first_step;
  last_step_ = last_step;
  t0_ = std::chrono::steady_clock::now();
}

bool TrainLog::progress_after(int64_t steps_done) const {
  return steps_done % log_every_ == 0 || steps_done == last_step_;
}

void TrainLog::write(const StepRecord& r) {
  if (!main_rank_) return;
  if (jsonl_.is_open()) {
    nlohmann::json j = {{"step", r.step},
                        {"loss", r.loss},
                        {"lr", r.lr},
                        {"tokens_per_s", r.tokens_per_s},
                        {"step_s", r.step_s},
                        {"peak_bytes", r.peak_bytes},
                        {"comm_bytes", r.comm.total_bytes()},
                        // What this rank sent (Note [Wire bytes]), and of it the
                        // hierarchical reductions' cross-node part.
                        {"wire_bytes", r.comm.wire_bytes()},
                        {"wire_bytes_outer", r.comm.hierarchical_outer_wire_bytes},
                        // What shows the features ran: regions recomputed so far (this
                        // rank), and this step's offload copies.
                        {"recomputes", r.recomputes},
                        {"offload_to_device_bytes", r.comm.offload_to_device_bytes},
                        {"offload_to_host_bytes", r.comm.offload_to_host_bytes},
                        {"offloaded_activation_bytes", r.offloaded_activation_bytes}};
    if (!std::isnan(r.val_loss)) j["val_loss"] = r.val_loss;
    if (r.loss_scaler) {
      j["loss_scale"] = r.loss_scaler->scale;
      j["skipped_steps"] = r.loss_scaler->skipped_steps;
    }
    jsonl_ << j.dump() << "\n" << std::flush;
  }
  if (progress_after(r.step)) print_progress(r);
}

// Written to std::cout with its manipulators, which stay set (the library's
// "[fsdp] saved checkpoint ... s" lines print in them).
void TrainLog::print_progress(const StepRecord& r) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double eta = elapsed / static_cast<double>(r.step - first_step_) *
                     static_cast<double>(last_step_ - r.step);
  const auto& scaler = r.loss_scaler;
  std::cout << "step " << r.step << "/" << steps_ << " | loss " << std::fixed
            << std::setprecision(4) << r.loss
            << (std::isnan(r.val_loss) ? std::string()
                                       : " | val loss " + std::to_string(r.val_loss).substr(0, 6))
            << " | lr " << std::scientific << std::setprecision(2) << r.lr << std::fixed << " | "
            << std::setprecision(0) << r.tokens_per_s << " tok/s | engine peak "
            << human_bytes(static_cast<double>(r.peak_bytes)) << " | comm "
            << human_bytes(static_cast<double>(r.comm.total_bytes())) << "/step, sent "
            << human_bytes(static_cast<double>(r.comm.wire_bytes()))
            << (scaler ? " | loss scale " + std::to_string(static_cast<int64_t>(scaler->scale)) +
                             ", skipped " + std::to_string(scaler->skipped_steps)
                       : std::string())
            << " | elapsed " << human_seconds(elapsed) << " | eta " << human_seconds(eta)
            << std::endl;
}

}  // namespace lm
