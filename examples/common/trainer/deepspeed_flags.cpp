#include "deepspeed_flags.h"

#include "../cli.h"

#include <fsdp/core/options.h>

#include <algorithm>
#include <sstream>

namespace lm {
namespace {

using examples::UsageError;

std::string to_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
std::string to_text(int64_t v) { return std::to_string(v); }
std::string to_text(int v) { return std::to_string(v); }
std::string to_text(bool v) { return v ? "true" : "false"; }
std::string to_text(const std::string& v) { return v; }
std::string to_text(fsdp::ShardingStrategy s) {
  return fsdp::core::strategy_name(s, fsdp::core::Surface::kFlags);
}
std::string to_text(fsdp::OffloadDevice d) { return fsdp::to_string(d); }

/// Sets flags from the config; a flag given with another value is refused.
class FlagSetter {
 public:
  FlagSetter(const Flags& f, const std::string& path) : given_(f.given), path_(path) {}

  template <class T, class V>
  void operator()(const char* flag, const std::string& key, T& field, const V& value) {
    const T v = static_cast<T>(value);
    if (given_.count(flag) && !(field == v)) {
      throw UsageError("--" + std::string(flag) + " " + to_text(field) + " was given, but " +
                       path_ + " sets it to " + to_text(v) + " (" + key +
                       "); leave the flag out, or write \"auto\" in the config to take the flag's "
                       "value");
    }
    field = v;
  }

 private:
  const std::set<std::string>& given_;
  std::string path_;
};

}  // namespace

std::string apply_deepspeed_config(Flags& f, int world) {
  if (f.deepspeed_config.empty()) return "";
  const std::string& path = f.deepspeed_config;
  TrainingFlags& t = f.training;
  ShardingFlags& s = f.sharding;
  fsdp::ShardingOptions& so = s.options;

  // "auto" means the flags' values.
  fsdp::deepspeed::ProgramValues p;
  p.world_size = world;
  // Under pipeline stages the micro-batches are the accumulation, over data-parallel ranks.
  PipelineFlags& pl = f.pipeline;
  const int64_t accum = pl.stages > 1 ? pl.micro_batches : t.grad_accum;
  const int64_t dp = world % pl.stages == 0 ? world / pl.stages : world;
  p.pipeline_stages = pl.stages;
  p.gradient_accumulation_steps = accum;
  if (t.batch_size % (dp * accum) == 0) p.micro_batch_per_rank = t.batch_size / (dp * accum);
  p.lr = t.lr;
  p.beta1 = t.beta1;
  p.beta2 = t.beta2;
  p.eps = t.eps;
  p.weight_decay = t.weight_decay;
  p.gradient_clipping = t.clip_grad;
  p.precision = fsdp::parse_precision(s.precision);
  p.warmup_steps = t.warmup_steps;
  p.total_steps = t.steps;
  p.hidden_size = f.model.d_model;
  fsdp::deepspeed::Config ds;
  try {
    ds = fsdp::deepspeed::load_config(path, p);
  } catch (const c10::Error& e) {
    throw UsageError("--deepspeed-config " + path + ": " + e.what_without_backtrace());
  }

  FlagSetter set(f, "--deepspeed-config " + path);
  if (ds.has("pipeline.stages"))
    set("pipeline-stages", "pipeline.stages", pl.stages, ds.pipeline_stages);
  if (ds.has("pipeline.partition"))
    set("partition", "pipeline.partition", pl.partition, ds.pipeline_partition);
  set("batch-size", "train_batch_size", t.batch_size, ds.train_batch_size);
  if (pl.stages > 1) {
    // DeepSpeed's pipe engine runs gradient_accumulation_steps micro-batches a step.
    set("micro-batches", "gradient_accumulation_steps", pl.micro_batches,
        static_cast<int>(ds.gradient_accumulation_steps));
  } else {
    set("grad-accum", "gradient_accumulation_steps", t.grad_accum, ds.gradient_accumulation_steps);
  }
  if (ds.has("gradient_clipping"))
    set("clip-grad", "gradient_clipping", t.clip_grad, ds.gradient_clipping);
  if (ds.has("fp16.enabled") || ds.has("bf16.enabled") || ds.has("bfloat16.enabled")) {
    set("precision", "fp16.enabled, bf16.enabled", s.precision,
        std::string(fsdp::to_string(ds.precision)));
    so.mixed_precision = ds.sharding.mixed_precision;
  }
  const fsdp::LossScalerOptions& ls = ds.loss_scaler;
  if (ds.has("fp16.loss_scale"))
    set("loss-scale", "fp16.loss_scale", s.loss_scaler.loss_scale, ls.loss_scale);
  if (ds.has("fp16.initial_scale_power"))
    set("loss-scale-power", "fp16.initial_scale_power", s.loss_scaler.initial_scale_power,
        ls.initial_scale_power);
  if (ds.has("fp16.loss_scale_window"))
    set("loss-scale-window", "fp16.loss_scale_window", s.loss_scaler.loss_scale_window,
        ls.loss_scale_window);
  if (ds.has("fp16.hysteresis"))
    set("loss-scale-hysteresis", "fp16.hysteresis", s.loss_scaler.hysteresis, ls.hysteresis);
  if (ds.has("fp16.min_loss_scale"))
    set("min-loss-scale", "fp16.min_loss_scale", s.loss_scaler.min_loss_scale, ls.min_loss_scale);

  const fsdp::deepspeed::Optimizer& o = ds.optimizer;
  if (o.present) {
    if (!o.decoupled_weight_decay && o.weight_decay != 0) {
      throw UsageError("--deepspeed-config " + path +
                       ": optimizer.params.adam_w_mode false with weight_decay " +
                       to_text(o.weight_decay) +
                       " asks for classic Adam's L2 decay, which fsdp::FusedAdamW does not do; "
                       "use AdamW (adam_w_mode true) or weight_decay 0");
    }
    set("lr", "optimizer.params.lr", t.lr, o.lr);
    set("adam-betas", "optimizer.params.betas", t.beta1, o.beta1);
    set("adam-betas", "optimizer.params.betas", t.beta2, o.beta2);
    set("adam-eps", "optimizer.params.eps", t.eps, o.eps);
    set("weight-decay", "optimizer.params.weight_decay", t.weight_decay, o.weight_decay);
  }
  if (ds.has_scheduler) {
    const fsdp::WarmupSchedule& w = ds.scheduler;
    const bool decay = w.total_num_steps > 0;
    set("lr-schedule", "scheduler.type", t.lr_schedule,
        std::string(decay ? "warmup_decay" : "warmup"));
    set("lr", "scheduler.params.warmup_max_lr", t.lr, w.warmup_max_lr);
    set("warmup-min-lr", "scheduler.params.warmup_min_lr", t.warmup_min_lr, w.warmup_min_lr);
    set("warmup-steps", "scheduler.params.warmup_num_steps", t.warmup_steps, w.warmup_num_steps);
    set("warmup-type", "scheduler.params.warmup_type", t.warmup_type,
        std::string(w.warmup_type == fsdp::WarmupSchedule::Type::kLog ? "log" : "linear"));
    if (decay) set("steps", "scheduler.params.total_num_steps", t.steps, w.total_num_steps);
  }
  if (ds.has("zero_optimization") || ds.has("zero_optimization.stage"))
    set("sharding", "zero_optimization.stage", so.strategy, ds.sharding.strategy);
  const std::string nvme = so.offload_optimizer.nvme_path;
  auto offload = [&](const char* flag, const std::string& section, fsdp::OffloadConfig& mine,
                     const fsdp::OffloadConfig& theirs, const char* legacy) {
    if (!ds.has(section) && !ds.has(section + ".device") && !ds.has(legacy)) return;
    set(flag, section + ".device", mine.device, theirs.device);
    if (theirs.device == fsdp::OffloadDevice::kNvme && !theirs.nvme_path.empty())
      set("nvme-path", section + ".nvme_path", mine.nvme_path, theirs.nvme_path);
    mine = theirs;
    if (mine.nvme_path.empty()) mine.nvme_path = nvme;
  };
  offload("offload-optimizer", "zero_optimization.offload_optimizer", so.offload_optimizer,
          ds.sharding.offload_optimizer, "zero_optimization.cpu_offload");
  offload("offload-param", "zero_optimization.offload_param", so.offload_param,
          ds.sharding.offload_param, "zero_optimization.cpu_offload_param");
  if (ds.has("zero_optimization.stage3_max_live_parameters") ||
      ds.has("zero_optimization.stage3_prefetch_bucket_size")) {
    set("max-gathered-units", "zero_optimization.stage3_prefetch_bucket_size",
        so.max_gathered_units, ds.sharding.max_gathered_units);
    set("max-live-numel", "zero_optimization.stage3_max_live_parameters", so.max_live_numel,
        ds.sharding.max_live_numel);
    set("prefetch-bucket-numel", "zero_optimization.stage3_prefetch_bucket_size",
        so.prefetch_bucket_numel, ds.sharding.prefetch_bucket_numel);
  }
  if (ds.has("zero_optimization.stage3_param_persistence_threshold"))
    set("persistence-threshold-numel", "zero_optimization.stage3_param_persistence_threshold",
        so.persistence_threshold_numel, ds.sharding.persistence_threshold_numel);
  const fsdp::QuantizedCommunication& q = ds.sharding.quantized_communication;
  if (ds.has("zero_optimization.zero_quantized_weights"))
    set("quantize-weights", "zero_optimization.zero_quantized_weights",
        so.quantized_communication.weights, q.weights);
  if (ds.has("zero_optimization.zero_quantized_gradients"))
    set("quantize-gradients", "zero_optimization.zero_quantized_gradients",
        so.quantized_communication.gradients, q.gradients);
  if (ds.has("zero_optimization.zero_hpz_partition_size"))
    set("hpz-group-size", "zero_optimization.zero_hpz_partition_size",
        so.reshard_after_forward_group_size, ds.sharding.reshard_after_forward_group_size);
  if (ds.has("steps_per_print"))
    set("log-every", "steps_per_print", f.output.log_every, ds.steps_per_print);
  else if (!f.given.count("log-every"))
    f.output.log_every = std::max<int64_t>(1, t.steps / 20);  // --steps may have changed

  if (s.precision == "fp16") check_loss_scaler(s.loss_scaler);
  return program() + ": --deepspeed-config " + path + "\n" + ds.describe();
}

}  // namespace lm
