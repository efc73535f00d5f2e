// A DeepSpeed ds_config.json read into options: every key applied, or accepted with the
// reason it has no effect here, or refused naming it (docs/guide/deepspeed.md). The
// defaults, the batch rule and its messages are deepspeed/runtime/config.py's (0.19.8).
#include <fsdp/deepspeed_config.h>

#include "relaxed_json.h"

#include <fsdp/core/options.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

namespace fsdp {
namespace {

// The names of DeepSpeed's precision sections: its config's keys, not this library's
// precisions (which the options core names).
constexpr const char* kFp16Key = "fp16";  // DeepSpeed's key
constexpr const char* kBf16Key = "bf16";  // DeepSpeed's key

using nlohmann::json;

std::string number_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

const char* json_kind(const json& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  return "null";
}

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// The config being read: the program's values, the result, and the notes.
class ConfigReader {
 public:
  ConfigReader(const deepspeed::ProgramValues& program, deepspeed::Config& out)
      : p_(program), out_(out) {}

  [[noreturn]] static void fail(const std::string& path, const json& v, const std::string& want) {
    TORCH_CHECK(false, "ds_config: ", path, ": ", v.dump(), " is ", json_kind(v), "; expected ",
                want);
  }

  /// Records every key of `obj` that is not in `keys` as a problem, naming the closest
  /// one and all of them (Note [Every problem at once]).
  void check_keys(const json& obj, const std::string& path, const std::vector<std::string>& keys) {
    if (!obj.is_object()) fail(path.empty() ? "(top level)" : path, obj, "an object");
    for (const auto& [key, value] : obj.items()) {
      attempt([&] { check_key(key, path, keys); });
    }
  }

  // Note [Every problem at once]
  // A config pasted from elsewhere can have several problems; reporting the first alone
  // makes the user fix one per run. Each section is read on its own (attempt()), every
  // unknown key of an object is recorded, and finish() throws one error listing them all,
  // each with its path and fix (a single problem keeps its own message). A section that
  // failed leaves its defaults, so later ones may add a consequence or two.
  template <class F>
  void attempt(F&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      problems_.push_back(e.what_without_backtrace());
    }
  }
  void finish() const {
    if (problems_.empty()) return;
    if (problems_.size() == 1) TORCH_CHECK(false, problems_[0]);
    std::string all = "ds_config: " + std::to_string(problems_.size()) + " problems:";
    for (const auto& p : problems_) all += "\n  - " + p;
    TORCH_CHECK(false, all);
  }

  static void check_key(const std::string& key, const std::string& path,
                        const std::vector<std::string>& keys) {
    {
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) return;
      std::vector<std::string> sorted = keys;
      std::stable_sort(sorted.begin(), sorted.end(), [&](const auto& a, const auto& b) {
        return edit_distance(key, a) < edit_distance(key, b);
      });
      std::string list;
      for (const auto& k : sorted) list += (list.empty() ? "" : ", ") + k;
      const std::string where = path.empty() ? key : path + "." + key;
      TORCH_CHECK(false, "ds_config: ", where, " is not a key this library knows",
                  edit_distance(key, sorted[0]) <= std::max<size_t>(3, key.size() / 3)
                      ? "; did you mean " + sorted[0] + "? "
                      : ". ",
                  "Supported keys ", path.empty() ? "at the top level" : "in " + path, ": ", list);
    }
  }

  void note(const std::string& key, const json& v, bool applied, const std::string& effect,
            const std::string& filled = "") {
    out_.notes.push_back(
        {key, filled.empty() ? v.dump() : "\"auto\" -> " + filled, applied, effect});
  }

  int64_t integer(const std::string& path, const json& v, std::optional<int64_t> auto_value = {},
                  int64_t min = 0) {
    int64_t r = 0;
    if (is_auto(v)) {
      TORCH_CHECK(auto_value.has_value(), "ds_config: ", path,
                  ": \"auto\" needs the program's value, which it did not give; write a number");
      r = *auto_value;
    } else if (v.is_number_integer()) {
      r = v.get<int64_t>();
    } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
               v.get<double>() == std::floor(v.get<double>()) &&
               std::fabs(v.get<double>()) < 9.2e18) {
      r = static_cast<int64_t>(v.get<double>());  // 1e9, as DeepSpeed's configs write it
    } else {
      fail(path, v, std::string("an integer") + (auto_value ? " or \"auto\"" : ""));
    }
    TORCH_CHECK(r >= min, "ds_config: ", path, ": ", r, " must be at least ", min);
    return r;
  }

  double number(const std::string& path, const json& v, std::optional<double> auto_value = {}) {
    if (is_auto(v)) {
      TORCH_CHECK(auto_value.has_value(), "ds_config: ", path,
                  ": \"auto\" needs the program's value, which it did not give; write a number");
      return *auto_value;
    }
    if (!v.is_number()) fail(path, v, std::string("a number") + (auto_value ? " or \"auto\"" : ""));
    const double r = v.get<double>();
    TORCH_CHECK(std::isfinite(r) && r >= 0, "ds_config: ", path, ": ", v.dump(),
                " must be a finite number, at least 0");
    return r;
  }

  bool boolean(const std::string& path, const json& v, std::optional<bool> auto_value = {}) {
    if (is_auto(v) && auto_value) return *auto_value;
    // "true" and "false" as strings (configs written by hand, or by templating): read for
    // what they say, with a note. DeepSpeed and Accelerate read any non-empty string as
    // true, "false" too.
    if (v.is_string() && (v.get<std::string>() == "true" || v.get<std::string>() == "false")) {
      const bool b = v.get<std::string>() == "true";
      out_.notes.push_back({path, v.dump(), true,
                            std::string("the string read as ") + (b ? "true" : "false") +
                                " (DeepSpeed reads any non-empty string as true, \"false\" "
                                "too; write a JSON boolean)"});
      return b;
    }
    if (!v.is_boolean())
      fail(path, v, std::string("true or false") + (auto_value ? " or \"auto\"" : ""));
    return v.get<bool>();
  }

  std::string string(const std::string& path, const json& v, const std::string& want) {
    if (!v.is_string()) fail(path, v, want);
    return v.get<std::string>();
  }

  /// A key whose only value here is DeepSpeed's default: accepted at it, refused otherwise.
  void default_only(const std::string& path, const json& v, bool expected, const std::string& why) {
    TORCH_CHECK(boolean(path, v) == expected, "ds_config: ", path, ": ", v.dump(),
                " is not available here (", why, "); remove it or write ",
                expected ? "true" : "false");
    note(path, v, false, "DeepSpeed's default; " + why);
  }

  void pipeline(const json& pl);
  void batch(const json& j);
  void precision(const json& j);
  bool fp16_section(const json& f);
  bool bf16_section(const json& f, const std::string& b);
  void optimizer(const json& o);
  void scheduler(const json& s);
  void zero(const json& z);
  void zero_offload(const json& z);
  void zero_tuning(const json& z, int stage);
  void offload(const json& o, const std::string& path, OffloadConfig& c, bool param);
  void prefetch(const json& z, int stage);
  void zero_plus_plus(const json& z, int stage);

  const deepspeed::ProgramValues& p_;
  deepspeed::Config& out_;
  std::vector<std::string> problems_;  ///< Note [Every problem at once]
};

// ---- batch sizes: deepspeed/runtime/config.py, _set_batch_related_parameters ------------

void ConfigReader::batch(const json& j) {
  // Under a pipeline DeepSpeed's rule counts the data-parallel ranks, not the world.
  const int64_t world = p_.world_size / out_.pipeline_stages;
  std::optional<int64_t> train, micro, accum;
  const int64_t auto_micro = p_.micro_batch_per_rank, auto_accum = p_.gradient_accumulation_steps;
  auto read = [&](const char* key, std::optional<int64_t> auto_value) -> std::optional<int64_t> {
    if (!j.contains(key)) return std::nullopt;
    const int64_t v = integer(key, j[key], auto_value, LLONG_MIN);
    return v;
  };
  std::optional<int64_t> auto_train;
  if (auto_micro > 0) auto_train = auto_micro * auto_accum * world;
  train = read("train_batch_size", auto_train);
  micro = read("train_micro_batch_size_per_gpu",
               auto_micro > 0 ? std::optional<int64_t>(auto_micro) : std::nullopt);
  accum = read("gradient_accumulation_steps", auto_accum);
  if (train && micro && accum) {
  } else if (train && micro) {
    accum = *train / *micro / world;
  } else if (train && accum) {
    micro = *train / world / *accum;
  } else if (micro && accum) {
    train = *micro * *accum * world;
  } else if (train) {
    accum = 1;
    micro = *train / world;
  } else if (micro) {
    train = *micro * world;
    accum = 1;
  } else {
    // Neither batch key (configs written for Lightning or the Hugging Face Trainer): the
    // program's batch, as Lightning's DeepSpeed strategy fills it, with a note.
    TORCH_CHECK(auto_micro > 0,
                "ds_config: Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                "provided (or the program's batch size: deepspeed::ProgramValues::"
                "micro_batch_per_rank, train_gpt's --batch-size divisible by the data-parallel "
                "ranks x --grad-accum)");
    micro = auto_micro;
    if (!accum) accum = auto_accum;
    train = *micro * *accum * world;
    out_.notes.push_back({"train_batch_size, train_micro_batch_size_per_gpu", "(absent)", true,
                          "from the program's batch: micro " + std::to_string(*micro) +
                              " x accumulation " + std::to_string(*accum) + " x world " +
                              std::to_string(world) + " = " + std::to_string(*train) +
                              ", as Lightning's DeepSpeed strategy fills them"});
  }
  TORCH_CHECK(*train > 0, "ds_config: Train batch size: ", *train, " has to be greater than 0");
  TORCH_CHECK(*micro > 0, "ds_config: Micro batch size per gpu: ", *micro,
              " has to be greater than 0");
  TORCH_CHECK(*accum > 0, "ds_config: Gradient accumulation steps: ", *accum,
              " has to be greater than 0");
  TORCH_CHECK(*train == *micro * *accum * world,
              "ds_config: Check batch related parameters. train_batch_size is not equal to "
              "micro_batch_per_gpu * gradient_acc_step * world_size ",
              *train, " != ", *micro, " * ", *accum, " * ", world);
  out_.train_batch_size = *train;
  out_.micro_batch_per_rank = *micro;
  out_.gradient_accumulation_steps = *accum;
  const std::string rule = " (train_batch_size = micro * accumulation * world " +
                           std::to_string(*train) + " = " + std::to_string(*micro) + " * " +
                           std::to_string(*accum) + " * " + std::to_string(world) + ")";
  auto filled = [&](const char* key, int64_t v) {
    return is_auto(j[key]) ? std::to_string(v) : std::string();
  };
  if (j.contains("train_batch_size"))
    note("train_batch_size", j["train_batch_size"], true,
         "deepspeed::Config::train_batch_size, the global batch" + rule,
         filled("train_batch_size", *train));
  if (j.contains("train_micro_batch_size_per_gpu"))
    note("train_micro_batch_size_per_gpu", j["train_micro_batch_size_per_gpu"], true,
         "deepspeed::Config::micro_batch_per_rank" + rule,
         filled("train_micro_batch_size_per_gpu", *micro));
  if (j.contains("gradient_accumulation_steps"))
    note("gradient_accumulation_steps", j["gradient_accumulation_steps"], true,
         "deepspeed::Config::gradient_accumulation_steps" + rule,
         filled("gradient_accumulation_steps", *accum));
}

// ---- pipeline: deepspeed/runtime/config.py, get_pipeline_config ------------------------

void ConfigReader::pipeline(const json& pl) {
  check_keys(pl, "pipeline",
             {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
              "pipe_partitioned", "grad_partitioned"});
  if (pl.contains("stages")) {
    out_.pipeline_stages =
        static_cast<int>(integer("pipeline.stages", pl["stages"], p_.pipeline_stages, 1));
    try {  // the options core's rule (Note [Options core])
      core::check_pipeline_stages(out_.pipeline_stages, p_.world_size, "ds_config: pipeline.stages",
                                  core::Surface::kFlags);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, e.what());
    }
    note("pipeline.stages", pl["stages"], true,
         "PipelineOptions::stages: the model's layers in stages over the ranks, each stage "
         "sharded over world / stages ranks",
         is_auto(pl["stages"]) ? std::to_string(out_.pipeline_stages) : "");
  }
  if (pl.contains("partition")) {
    const std::string v = string("pipeline.partition", pl["partition"], "a partition method");
    TORCH_CHECK(v == "parameters" || v == "uniform" || v == "best",
                "ds_config: pipeline.partition ", pl["partition"].dump(),
                " is not available here; write \"parameters\" (balance the parameter counts) or "
                "\"uniform\" (balance the layer counts)");
    out_.pipeline_partition = v == "uniform" ? "uniform" : "parameters";
    note("pipeline.partition", pl["partition"], true,
         "PipelineOptions::partition = " + out_.pipeline_partition +
             (v == "best" ? " (\"best\" is DeepSpeed's config default; its PipelineModule "
                            "balances parameters)"
                          : ""));
  }
  if (pl.contains("seed_layers"))
    default_only("pipeline.seed_layers", pl["seed_layers"], false,
                 "the layers are built once, from the program's seed, before they split");
  if (pl.contains("activation_checkpoint_interval")) {
    const int64_t k = integer("pipeline.activation_checkpoint_interval",
                              pl["activation_checkpoint_interval"], {}, 0);
    TORCH_CHECK(k == 0, "ds_config: pipeline.activation_checkpoint_interval ", k,
                " is not available here; write 0 and checkpoint blocks with "
                "ShardingOptions::checkpoint_policy (train_gpt --activation-checkpointing every:",
                k, ")");
    note("pipeline.activation_checkpoint_interval", pl["activation_checkpoint_interval"], true,
         "no activation checkpointing by the pipeline (DeepSpeed's default)");
  }
  for (const char* k : {"pipe_partitioned", "grad_partitioned"}) {
    if (!pl.contains(k)) continue;
    boolean(std::string("pipeline.") + k, pl[k]);
    note(std::string("pipeline.") + k, pl[k], false,
         "no effect: DeepSpeed splits the activations (or their gradients) between stages "
         "over a tensor-parallel group, and there is none; they travel whole");
  }
}

// ---- fp16 and bf16 ----------------------------------------------------------------------

// The fp16 section (and its loss scaler); whether fp16 is enabled.
bool ConfigReader::fp16_section(const json& f) {
  bool fp16 = false;
  check_keys(
      f, kFp16Key,
      {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
       "min_loss_scale", "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"});
  if (f.contains("enabled")) {
    fp16 = boolean("fp16.enabled", f["enabled"], p_.precision == Precision::kFp16);
    note("fp16.enabled", f["enabled"], true,
         fp16 ? "precision fp16: MixedPrecision param_dtype and reduce_dtype kHalf over fp32 "
                "masters, with the loss scaler (fsdp::LossScaler)"
              : "fp16 off",
         is_auto(f["enabled"]) ? (fp16 ? "true" : "false") : "");
  }
  const std::string off = fp16 ? "" : "; fp16 is not enabled, so it has no effect";
  LossScalerOptions& ls = out_.loss_scaler;
  if (f.contains("loss_scale")) {
    ls.loss_scale = number("fp16.loss_scale", f["loss_scale"]);
    note("fp16.loss_scale", f["loss_scale"], fp16,
         (ls.loss_scale == 0 ? std::string("LossScalerOptions::loss_scale = 0 (dynamic)")
                             : "LossScalerOptions::loss_scale (static)") +
             off);
  }
  if (f.contains("initial_scale_power")) {
    ls.initial_scale_power =
        static_cast<int>(integer("fp16.initial_scale_power", f["initial_scale_power"]));
    TORCH_CHECK(ls.initial_scale_power <= 60, "ds_config: fp16.initial_scale_power ",
                ls.initial_scale_power, " must be at most 60 (the default is 16)");
    note("fp16.initial_scale_power", f["initial_scale_power"], fp16,
         "LossScalerOptions::initial_scale_power" + off);
  }
  if (f.contains("loss_scale_window")) {
    ls.loss_scale_window =
        static_cast<int>(integer("fp16.loss_scale_window", f["loss_scale_window"], {}, 1));
    note("fp16.loss_scale_window", f["loss_scale_window"], fp16,
         "LossScalerOptions::loss_scale_window" + off);
  }
  if (f.contains("hysteresis")) {
    ls.hysteresis = static_cast<int>(integer("fp16.hysteresis", f["hysteresis"], {}, 1));
    note("fp16.hysteresis", f["hysteresis"], fp16, "LossScalerOptions::hysteresis" + off);
  }
  if (f.contains("min_loss_scale")) {
    ls.min_loss_scale = number("fp16.min_loss_scale", f["min_loss_scale"]);
    TORCH_CHECK(ls.min_loss_scale > 0, "ds_config: fp16.min_loss_scale must be > 0");
    note("fp16.min_loss_scale", f["min_loss_scale"], fp16,
         "LossScalerOptions::min_loss_scale" + off);
  }
  if (f.contains("consecutive_hysteresis"))
    default_only("fp16.consecutive_hysteresis", f["consecutive_hysteresis"], false,
                 "the hysteresis refills only after a clean loss_scale_window");
  if (f.contains("fp16_master_weights_and_grads"))
    default_only("fp16.fp16_master_weights_and_grads", f["fp16_master_weights_and_grads"], false,
                 "master weights and their gradients are fp32 here");
  if (f.contains("auto_cast")) {
    boolean("fp16.auto_cast", f["auto_cast"]);
    note("fp16.auto_cast", f["auto_cast"], false,
         "each unit casts its floating inputs to param_dtype either way "
         "(MixedPrecision::cast_forward_inputs)");
  }
  return fp16;
}

// The bf16 (or bfloat16, its old name: `b`) section; whether bf16 is enabled.
bool ConfigReader::bf16_section(const json& f, const std::string& b) {
  bool bf16 = false;
  check_keys(f, b,
             {"enabled", "immediate_grad_update", "check_grad_overflow",
              "bf16_master_weights_and_grads", "bf16_optimizer_states"});
  if (f.contains("enabled")) {
    bf16 = boolean(b + ".enabled", f["enabled"], p_.precision == Precision::kBf16);
    note(b + ".enabled", f["enabled"], true,
         bf16 ? "precision bf16: MixedPrecision param_dtype and reduce_dtype kBFloat16 over fp32 "
                "masters"
              : "bf16 off",
         is_auto(f["enabled"]) ? (bf16 ? "true" : "false") : "");
  }
  if (f.contains("immediate_grad_update")) {
    boolean(b + ".immediate_grad_update", f["immediate_grad_update"]);
    note(b + ".immediate_grad_update", f["immediate_grad_update"], false,
         "gradients are reduce-scattered into fp32 shards as each unit's backward ends");
  }
  if (f.contains("check_grad_overflow")) {
    boolean(b + ".check_grad_overflow", f["check_grad_overflow"]);
    note(b + ".check_grad_overflow", f["check_grad_overflow"], false,
         "bf16 runs without a loss scaler here, so no step is skipped for inf or nan");
  }
  if (f.contains("bf16_master_weights_and_grads"))
    default_only(b + ".bf16_master_weights_and_grads", f["bf16_master_weights_and_grads"], false,
                 "master weights and their gradients are fp32 here");
  if (f.contains("bf16_optimizer_states"))
    default_only(b + ".bf16_optimizer_states", f["bf16_optimizer_states"], false,
                 "optimizer state is fp32 here");
  return bf16;
}

void ConfigReader::precision(const json& j) {
  TORCH_CHECK(!(j.contains(kBf16Key) && j.contains("bfloat16")),
              "ds_config: both bf16 and bfloat16 are given; bfloat16 is the old name of bf16, "
              "keep one");
  bool fp16 = false, bf16 = false;
  if (j.contains(kFp16Key)) fp16 = fp16_section(j[kFp16Key]);
  const char* bkey = j.contains(kBf16Key) ? kBf16Key : "bfloat16";
  if (j.contains(bkey)) bf16 = bf16_section(j[bkey], bkey);
  TORCH_CHECK(!(fp16 && bf16),
              "ds_config: bfloat16 and fp16 modes cannot be simultaneously enabled");
  MixedPrecision& mp = out_.sharding.mixed_precision;
  if (fp16 || bf16) {
    mp.param_dtype = mp.reduce_dtype = fp16 ? torch::kHalf : torch::kBFloat16;
    mp.output_dtype = torch::kFloat32;
  }
  out_.precision = fp16 ? Precision::kFp16 : bf16 ? Precision::kBf16 : Precision::kFp32;
}

// ---- optimizer and scheduler ------------------------------------------------------------

void ConfigReader::optimizer(const json& o) {
  check_keys(o, "optimizer", {"type", "params"});
  TORCH_CHECK(o.contains("type"), "ds_config: optimizer has no type; write \"type\": \"AdamW\"");
  deepspeed::Optimizer& r = out_.optimizer;
  r.present = true;
  r.type = string("optimizer.type", o["type"], "Adam or AdamW");
  std::string lower = r.type;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  TORCH_CHECK(lower == "adam" || lower == "adamw", "ds_config: optimizer.type ", o["type"].dump(),
              " is not available here; use Adam or AdamW (fsdp::FusedAdamW)");
  r.lr = 1e-3;  // DeepSpeed's FusedAdam default, when params has no lr
  note("optimizer.type", o["type"], true,
       "fsdp::FusedAdamW (torch::optim::AdamW's update; DeepSpeed's Adam is AdamW unless "
       "adam_w_mode is false)");
  if (!o.contains("params")) return;
  const json& p = o["params"];
  check_keys(p, "optimizer.params",
             {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad",
              "torch_adam", "max_grad_norm"});
  TORCH_CHECK(
      !p.contains("max_grad_norm"),
      "ds_config: 'max_grad_norm' is not supported as an optimizer parameter, please switch "
      "to using the deepspeed parameter 'gradient_clipping'");
  auto filled = [&](const char* key, const std::string& v) {
    return is_auto(p[key]) ? v : std::string();
  };
  if (p.contains("lr")) {
    r.lr = number("optimizer.params.lr", p["lr"], p_.lr);
    note("optimizer.params.lr", p["lr"], true, "AdamWOptions::lr", filled("lr", number_text(r.lr)));
  }
  if (p.contains("betas")) {
    const json& b = p["betas"];
    if (is_auto(b)) {
      r.beta1 = p_.beta1;
      r.beta2 = p_.beta2;
    } else {
      if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number())
        fail("optimizer.params.betas", b, "[beta1, beta2] (two numbers) or \"auto\"");
      r.beta1 = b[0].get<double>();
      r.beta2 = b[1].get<double>();
    }
    TORCH_CHECK(r.beta1 >= 0 && r.beta1 < 1 && r.beta2 >= 0 && r.beta2 < 1,
                "ds_config: optimizer.params.betas ", b.dump(), " must each be in [0, 1)");
    note("optimizer.params.betas", b, true, "AdamWOptions::betas",
         filled("betas", "[" + number_text(r.beta1) + ", " + number_text(r.beta2) + "]"));
  }
  if (p.contains("eps")) {
    r.eps = number("optimizer.params.eps", p["eps"], p_.eps);
    note("optimizer.params.eps", p["eps"], true, "AdamWOptions::eps",
         filled("eps", number_text(r.eps)));
  }
  if (p.contains("weight_decay")) {
    r.weight_decay = number("optimizer.params.weight_decay", p["weight_decay"], p_.weight_decay);
    note("optimizer.params.weight_decay", p["weight_decay"], true, "AdamWOptions::weight_decay",
         filled("weight_decay", number_text(r.weight_decay)));
  }
  if (p.contains("adam_w_mode")) {
    // deepspeed/runtime/engine.py: effective_adam_w_mode = name == adamw or adam_w_mode.
    const bool mode = boolean("optimizer.params.adam_w_mode", p["adam_w_mode"]);
    r.decoupled_weight_decay = lower == "adamw" || mode;
    note("optimizer.params.adam_w_mode", p["adam_w_mode"], true,
         r.decoupled_weight_decay ? "decoupled weight decay (AdamW)"
                                  : "L2 weight decay (classic Adam): "
                                    "deepspeed::Optimizer::decoupled_weight_decay = false");
  }
  if (p.contains("bias_correction"))
    default_only("optimizer.params.bias_correction", p["bias_correction"], true,
                 "AdamW always corrects the bias");
  if (p.contains("amsgrad"))
    default_only("optimizer.params.amsgrad", p["amsgrad"], false,
                 "fsdp::FusedAdamW has no AMSGrad");
  if (p.contains("torch_adam")) {
    boolean("optimizer.params.torch_adam", p["torch_adam"]);
    note("optimizer.params.torch_adam", p["torch_adam"], false,
         "fsdp::FusedAdamW does torch's AdamW arithmetic either way");
  }
}

void ConfigReader::scheduler(const json& s) {
  check_keys(s, "scheduler", {"type", "params"});
  TORCH_CHECK(
      s.contains("type"),
      "ds_config: scheduler has no type; write \"type\": \"WarmupLR\" or \"WarmupDecayLR\"");
  const std::string type = string("scheduler.type", s["type"], "WarmupLR or WarmupDecayLR");
  const bool decay = type == "WarmupDecayLR";
  TORCH_CHECK(type == "WarmupLR" || decay, "ds_config: scheduler.type ", s["type"].dump(),
              " is not available here; use WarmupLR or WarmupDecayLR (the names as DeepSpeed "
              "spells them)");
  out_.has_scheduler = true;
  WarmupSchedule& w = out_.scheduler;
  // DeepSpeed's defaults: WarmupLR's maximum is the optimizer's lr, WarmupDecayLR's 0.001.
  w.warmup_max_lr = decay ? 1e-3 : (out_.optimizer.present ? out_.optimizer.lr : p_.lr);
  note("scheduler.type", s["type"], true,
       decay ? "WarmupSchedule with total_num_steps (WarmupDecayLR), stepped after each applied "
               "optimizer step"
             : "WarmupSchedule (WarmupLR), stepped after each applied optimizer step");
  json p = s.contains("params") ? s["params"] : json::object();
  std::vector<std::string> keys = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                   "warmup_type", "last_batch_iteration"};
  if (decay) keys.push_back("total_num_steps");
  check_keys(p, "scheduler.params", keys);
  auto filled = [&](const char* key, const std::string& v) {
    return is_auto(p[key]) ? v : std::string();
  };
  if (p.contains("warmup_min_lr")) {
    w.warmup_min_lr = number("scheduler.params.warmup_min_lr", p["warmup_min_lr"], 0.0);
    note("scheduler.params.warmup_min_lr", p["warmup_min_lr"], true,
         "WarmupSchedule::warmup_min_lr", filled("warmup_min_lr", number_text(w.warmup_min_lr)));
  }
  if (p.contains("warmup_max_lr")) {
    w.warmup_max_lr = number("scheduler.params.warmup_max_lr", p["warmup_max_lr"], p_.lr);
    note("scheduler.params.warmup_max_lr", p["warmup_max_lr"], true,
         "WarmupSchedule::warmup_max_lr", filled("warmup_max_lr", number_text(w.warmup_max_lr)));
  }
  if (p.contains("warmup_num_steps")) {
    const json& v = p["warmup_num_steps"];
    if (!is_auto(v) && !v.is_number_integer())
      fail("scheduler.params.warmup_num_steps", v, "an integer or \"auto\"");
    w.warmup_num_steps = integer("scheduler.params.warmup_num_steps", v, p_.warmup_steps);
    TORCH_CHECK(w.warmup_num_steps > 0,
                "ds_config: scheduler.params.warmup_num_steps must be a positive integer, got ",
                w.warmup_num_steps);
    note("scheduler.params.warmup_num_steps", v, true,
         "WarmupSchedule::warmup_num_steps (DeepSpeed uses at least 2)",
         filled("warmup_num_steps", std::to_string(w.warmup_num_steps)));
  }
  if (p.contains("warmup_type")) {
    const std::string t = string("scheduler.params.warmup_type", p["warmup_type"], "log or linear");
    TORCH_CHECK(t == "log" || t == "linear", "ds_config: scheduler.params.warmup_type \"", t,
                "\" is unknown; use log or linear");
    w.warmup_type = t == "log" ? WarmupSchedule::Type::kLog : WarmupSchedule::Type::kLinear;
    note("scheduler.params.warmup_type", p["warmup_type"], true, "WarmupSchedule::warmup_type");
  }
  if (p.contains("last_batch_iteration")) {
    TORCH_CHECK(integer("scheduler.params.last_batch_iteration", p["last_batch_iteration"], {},
                        LLONG_MIN) == -1,
                "ds_config: scheduler.params.last_batch_iteration must be -1 here; a resumed run "
                "takes its position from the checkpoint");
    note("scheduler.params.last_batch_iteration", p["last_batch_iteration"], false,
         "DeepSpeed's default (a fresh schedule)");
  }
  if (decay) {
    TORCH_CHECK(p.contains("total_num_steps"),
                "ds_config: scheduler.params.total_num_steps is required by WarmupDecayLR");
    w.total_num_steps =
        integer("scheduler.params.total_num_steps", p["total_num_steps"],
                p_.total_steps > 0 ? std::optional<int64_t>(p_.total_steps) : std::nullopt, 1);
    note("scheduler.params.total_num_steps", p["total_num_steps"], true,
         "WarmupSchedule::total_num_steps: the rate reaches 0 there",
         filled("total_num_steps", std::to_string(w.total_num_steps)));
  }
}

// ---- zero_optimization ------------------------------------------------------------------

const char* ds_strategy_name(ShardingStrategy s) {
  return core::strategy_name(s, core::Surface::kApi);
}

const char* ds_offload_name(OffloadDevice d) { return to_string(d); }

void ConfigReader::offload(const json& o, const std::string& path, OffloadConfig& c, bool param) {
  if (o.is_null()) {
    note(path, o, true, "none");
    return;
  }
  std::vector<std::string> keys = {"device", "nvme_path", "pin_memory", "buffer_count"};
  if (param) {
    keys.insert(keys.end(), {"buffer_size", "max_in_cpu"});
  } else {
    keys.insert(keys.end(), {"pipeline_read", "pipeline_write", "fast_init", "ratio"});
  }
  check_keys(o, path, keys);
  const std::string field =
      std::string("ShardingOptions::") + (param ? "offload_param" : "offload_optimizer");
  if (o.contains("device")) {
    const std::string d = string(path + ".device", o["device"], "\"cpu\", \"nvme\" or \"none\"");
    try {  // the options core's names (Note [Options core])
      c.device = core::parse_offload(d, core::Option::kOffloadParam, core::Surface::kFlags);
    } catch (const std::invalid_argument&) {
      TORCH_CHECK(false, "ds_config: ", path, ".device \"", d,
                  "\" is unknown; use cpu, nvme or none");
    }
    note(path + ".device", o["device"], true, field + ".device = " + ds_offload_name(c.device));
  }
  const std::string unused = c.device == OffloadDevice::kNone ? "; device none, so no effect" : "";
  if (o.contains("pin_memory")) {
    c.pin_memory = boolean(path + ".pin_memory", o["pin_memory"]);
    note(path + ".pin_memory", o["pin_memory"], c.device != OffloadDevice::kNone,
         field + ".pin_memory (page-locked host buffers on CUDA)" + unused);
  }
  if (o.contains("nvme_path")) {
    c.nvme_path = string(path + ".nvme_path", o["nvme_path"], "a directory");
    note(path + ".nvme_path", o["nvme_path"], c.device == OffloadDevice::kNvme,
         field + ".nvme_path" +
             (c.device == OffloadDevice::kNvme ? "" : "; device is not nvme, so no effect"));
  }
  const bool nvme = c.device == OffloadDevice::kNvme;
  int64_t count = param ? 5 : 4, size = 100000000;  // DeepSpeed's defaults
  if (o.contains("buffer_count")) count = integer(path + ".buffer_count", o["buffer_count"]);
  if (o.contains("buffer_size")) size = integer(path + ".buffer_size", o["buffer_size"]);
  if (param && nvme && (o.contains("buffer_count") || o.contains("buffer_size"))) {
    // DeepSpeed's pool: buffer_count buffers of buffer_size parameter elements (16-bit).
    c.buffer_bytes = count * size * 2;
    for (const char* k : {"buffer_count", "buffer_size"})
      if (o.contains(k))
        note(path + "." + k, o[k], true,
             field + ".buffer_bytes = buffer_count * buffer_size * 2 = " +
                 std::to_string(c.buffer_bytes));
  } else {
    for (const char* k : {"buffer_count", "buffer_size"})
      if (o.contains(k))
        note(path + "." + k, o[k], false,
             nvme ? "the optimizer's NVMe buffers are OffloadConfig::buffer_bytes, which "
                    "DeepSpeed's offload_optimizer has no key for"
                  : "NVMe buffers only; device is not nvme");
  }
  if (o.contains("max_in_cpu")) {
    integer(path + ".max_in_cpu", o["max_in_cpu"]);
    note(path + ".max_in_cpu", o["max_in_cpu"], false,
         "no parameters are cached in host memory on the way from NVMe");
  }
  for (const char* k : {"pipeline_read", "pipeline_write", "fast_init"}) {
    if (!o.contains(k)) continue;
    boolean(path + "." + k, o[k]);
    note(path + "." + k, o[k], false,
         "NVMe reads and writes always overlap the step of the neighbouring chunk");
  }
  if (o.contains("ratio")) {
    TORCH_CHECK(number(path + ".ratio", o["ratio"]) == 1.0, "ds_config: ", path, ".ratio ",
                o["ratio"].dump(), " is not available here (partial offload); write 1.0");
    note(path + ".ratio", o["ratio"], false, "DeepSpeed's default: all of the optimizer offloaded");
  }
}

void ConfigReader::zero(const json& z_in) {
  json z = z_in;
  if (z.is_boolean()) {  // DeepSpeed's old format: true means stage 1
    note("zero_optimization", z, true, "stage " + std::string(z.get<bool>() ? "1" : "0"));
    z = json{{"stage", z.get<bool>() ? 1 : 0}};
  }
  check_keys(z, "zero_optimization",
             {"stage",
              "offload_optimizer",
              "offload_param",
              "cpu_offload",
              "cpu_offload_param",
              "cpu_offload_use_pin_memory",
              "overlap_comm",
              "contiguous_gradients",
              "reduce_bucket_size",
              "allgather_bucket_size",
              "allgather_partitions",
              "reduce_scatter",
              "round_robin_gradients",
              "stage3_prefetch_bucket_size",
              "stage3_max_live_parameters",
              "stage3_max_reuse_distance",
              "stage3_param_persistence_threshold",
              "stage3_gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save",
              "sub_group_size",
              "zero_quantized_weights",
              "zero_quantized_gradients",
              "zero_hpz_partition_size"});
  ShardingOptions& so = out_.sharding;
  int stage = 0;
  if (z.contains("stage")) {
    stage = static_cast<int>(integer("zero_optimization.stage", z["stage"]));
    TORCH_CHECK(stage <= 3, "ds_config: zero_optimization.stage ", stage,
                " is unknown; use 0, 1, 2 or 3");
  }
  static const ShardingStrategy by_stage[] = {ShardingStrategy::kNoShard, ShardingStrategy::kZero1,
                                              ShardingStrategy::kZero2,
                                              ShardingStrategy::kFullShard};
  so.strategy = by_stage[stage];
  if (z.contains("stage"))
    note("zero_optimization.stage", z["stage"], true,
         std::string("ShardingOptions::strategy = ") + ds_strategy_name(so.strategy));
  zero_offload(z);
  zero_tuning(z, stage);
  prefetch(z, stage);
  zero_plus_plus(z, stage);
}

// ZeRO++'s three keys (Note [Quantized training]): qwZ, qgZ and hpZ, at stage 3 as in
// DeepSpeed.
void ConfigReader::zero_plus_plus(const json& z, int stage) {
  ShardingOptions& so = out_.sharding;
  const std::string only3 = "stage 3 only (DeepSpeed's ZeRO++ is a ZeRO-3 feature)";
  if (z.contains("zero_quantized_weights")) {
    const std::string path = "zero_optimization.zero_quantized_weights";
    const bool on = boolean(path, z["zero_quantized_weights"]) && stage == 3;
    so.quantized_communication.weights = on;
    note(path, z["zero_quantized_weights"], stage == 3,
         stage != 3 ? only3
                    : std::string("ShardingOptions::quantized_communication.weights = ") +
                          (on ? "true: parameter all-gathers carry int8 with one scale per " +
                                    std::to_string(so.quantized_communication.block_size) +
                                    " elements (qwZ)"
                              : "false"));
  }
  if (z.contains("zero_quantized_gradients")) {
    const std::string path = "zero_optimization.zero_quantized_gradients";
    const bool on = boolean(path, z["zero_quantized_gradients"]) && stage == 3;
    so.quantized_communication.gradients = on;
    note(path, z["zero_quantized_gradients"], stage == 3,
         stage != 3 ? only3
                    : std::string("ShardingOptions::quantized_communication.gradients = ") +
                          (on ? "true: gradients reduce through an all-to-all of int8 chunks, "
                                "summed in fp32 in rank order (qgZ; hierarchical with "
                                "zero_hpz_partition_size)"
                              : "false"));
  }
  if (z.contains("zero_hpz_partition_size")) {
    const std::string path = "zero_optimization.zero_hpz_partition_size";
    const int64_t k = integer(path, z["zero_hpz_partition_size"], {}, 1);
    const int64_t world = p_.world_size / std::max(1, out_.pipeline_stages);
    TORCH_CHECK(k == 1 || (k < world && world % k == 0), "ds_config: ", path, " ", k,
                " must divide the data-parallel world size ", world,
                " and be smaller than it (the ranks of one node, e.g. 8); 1 turns hpZ off");
    if (stage == 3) so.reshard_after_forward_group_size = k == 1 ? 0 : static_cast<int>(k);
    note(path, z["zero_hpz_partition_size"], stage == 3,
         stage != 3 ? only3
         : k == 1   ? "1: no secondary shard (DeepSpeed's default)"
                    : "ShardingOptions::reshard_after_forward_group_size = " + std::to_string(k) +
                        ": after forward each unit keeps a 1/" + std::to_string(k) +
                        " slice in its group of " + std::to_string(k) +
                        " ranks, and backward gathers from there (hpZ)");
  }
}

// zero_optimization's offload sections and the deprecated switches for them.
void ConfigReader::zero_offload(const json& z) {
  ShardingOptions& so = out_.sharding;
  TORCH_CHECK(!(z.contains("cpu_offload") && z.contains("offload_optimizer")),
              "ds_config: zero_optimization has both cpu_offload (deprecated) and "
              "offload_optimizer; keep offload_optimizer");
  TORCH_CHECK(!(z.contains("cpu_offload_param") && z.contains("offload_param")),
              "ds_config: zero_optimization has both cpu_offload_param (deprecated) and "
              "offload_param; keep offload_param");
  if (z.contains("offload_optimizer"))
    offload(z["offload_optimizer"], "zero_optimization.offload_optimizer", so.offload_optimizer,
            false);
  if (z.contains("offload_param"))
    offload(z["offload_param"], "zero_optimization.offload_param", so.offload_param, true);
  // The deprecated switches, as DeepSpeed reads them: cpu_offload is offload_optimizer to
  // the CPU (not ShardingOptions::cpu_offload, which moves the parameters too).
  if (z.contains("cpu_offload")) {
    if (boolean("zero_optimization.cpu_offload", z["cpu_offload"]))
      so.offload_optimizer.device = OffloadDevice::kCpu;
    note("zero_optimization.cpu_offload", z["cpu_offload"], true,
         std::string("deprecated; as DeepSpeed: ShardingOptions::offload_optimizer.device = ") +
             ds_offload_name(so.offload_optimizer.device));
  }
  if (z.contains("cpu_offload_param")) {
    if (boolean("zero_optimization.cpu_offload_param", z["cpu_offload_param"]))
      so.offload_param.device = OffloadDevice::kCpu;
    note("zero_optimization.cpu_offload_param", z["cpu_offload_param"], true,
         std::string("deprecated; as DeepSpeed: ShardingOptions::offload_param.device = ") +
             ds_offload_name(so.offload_param.device));
  }
  if (z.contains("cpu_offload_use_pin_memory")) {
    boolean("zero_optimization.cpu_offload_use_pin_memory", z["cpu_offload_use_pin_memory"]);
    note("zero_optimization.cpu_offload_use_pin_memory", z["cpu_offload_use_pin_memory"], false,
         "deprecated, and DeepSpeed does not carry it over either; use the offload sections' "
         "pin_memory");
  }
}

// zero_optimization's tuning keys: what the engine does always (noted), persistence.
void ConfigReader::zero_tuning(const json& z, int stage) {
  auto flag = [&](const char* key, const std::string& why) {
    if (!z.contains(key)) return;
    boolean(std::string("zero_optimization.") + key, z[key]);
    note(std::string("zero_optimization.") + key, z[key], false, why);
  };
  flag("overlap_comm",
       "collectives always run on their own stream or thread, overlapped with compute (and "
       "ShardingOptions::prefetch gathers ahead)");
  flag("contiguous_gradients", "each unit's gradients always land in one flat buffer");
  flag("allgather_partitions", "parameters are always all-gathered per unit");
  flag("reduce_scatter", "gradients are always reduce-scattered per unit (all-reduced at stage 0)");
  flag("round_robin_gradients", "each rank reduces its own shard of every unit");
  const int64_t h = p_.hidden_size;
  auto bucket = [&](const char* key, int64_t def, int64_t auto_value, const std::string& why) {
    if (!z.contains(key)) return;
    const std::string path = std::string("zero_optimization.") + key;
    const int64_t v = integer(path, z[key], h > 0 ? auto_value : def);
    note(path, z[key], false, why, is_auto(z[key]) ? std::to_string(v) : "");
  };
  bucket("reduce_bucket_size", 500000000, h * h,
         "one reduce-scatter per unit: a unit (the wrap policy) is the bucket");
  bucket("allgather_bucket_size", 500000000, h * h,
         "one all-gather per unit: a unit (the wrap policy) is the bucket");
  bucket("sub_group_size", 1000000000, 1000000000,
         "the optimizer steps each unit's flat shard in one pass (fsdp::FusedAdamW)");
  if (z.contains("stage3_param_persistence_threshold")) {
    const std::string path = "zero_optimization.stage3_param_persistence_threshold";
    const int64_t v =
        integer(path, z["stage3_param_persistence_threshold"], h > 0 ? 10 * h : 100000);
    if (stage == 3) out_.sharding.persistence_threshold_numel = v;
    note(path, z["stage3_param_persistence_threshold"], stage == 3,
         stage == 3 ? "ShardingOptions::persistence_threshold_numel = " + std::to_string(v) +
                          ": units with fewer parameter elements stay gathered between uses "
                          "(Note [Persistent parameters])"
                    : "stage 3 only",
         is_auto(z["stage3_param_persistence_threshold"]) ? std::to_string(v) : "");
  }
  if (z.contains("stage3_max_reuse_distance")) {
    integer("zero_optimization.stage3_max_reuse_distance", z["stage3_max_reuse_distance"]);
    note("zero_optimization.stage3_max_reuse_distance", z["stage3_max_reuse_distance"], false,
         "each unit is freed after its forward and after its backward (ZeRO-3); "
         "ShardingStrategy::kShardGradOp keeps it from forward through backward");
  }
  for (const char* k :
       {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"}) {
    if (!z.contains(k)) continue;
    boolean(std::string("zero_optimization.") + k, z[k]);
    note(std::string("zero_optimization.") + k, z[k], false,
         "checkpoints are sharded; a consolidated file of the full weights is written by "
         "fsdp::ckpt::export_consolidated / fsdp-consolidate (train_gpt --consolidate-to)");
  }
}

void ConfigReader::prefetch(const json& z, int stage) {
  const bool live = z.contains("stage3_max_live_parameters");
  const bool bucket = z.contains("stage3_prefetch_bucket_size");
  if (!live && !bucket) return;
  const int64_t h = p_.hidden_size;
  const int64_t live_v = live ? integer("zero_optimization.stage3_max_live_parameters",
                                        z["stage3_max_live_parameters"])
                              : 1000000000;
  const int64_t bucket_v = bucket ? integer("zero_optimization.stage3_prefetch_bucket_size",
                                            z["stage3_prefetch_bucket_size"],
                                            h > 0 ? static_cast<int64_t>(0.9 * h * h) : 50000000)
                                  : 50000000;
  std::string effect;
  bool applied = false;
  if (stage != 3) {
    effect = "stage 3 only";
  } else {
    // DeepSpeed bounds prefetching by elements alone: both element bounds, the other at
    // DeepSpeed's default, and no bound on the count of units (Note [Prefetch bound]).
    out_.sharding.max_live_numel = live_v;
    out_.sharding.prefetch_bucket_numel = bucket_v;
    out_.sharding.max_gathered_units = INT_MAX;
    applied = true;
    effect = "ShardingOptions::max_live_numel = " + std::to_string(live_v) +
             ", prefetch_bucket_numel = " + std::to_string(bucket_v) +
             ", max_gathered_units unbounded (DeepSpeed counts elements, not units)";
  }
  if (live)
    note("zero_optimization.stage3_max_live_parameters", z["stage3_max_live_parameters"], applied,
         effect);
  if (bucket)
    note("zero_optimization.stage3_prefetch_bucket_size", z["stage3_prefetch_bucket_size"], applied,
         effect, is_auto(z["stage3_prefetch_bucket_size"]) ? std::to_string(bucket_v) : "");
}

}  // namespace

deepspeed::Config deepspeed::parse_config(const std::string& json_text,
                                          const deepspeed::ProgramValues& program) {
  TORCH_CHECK(program.world_size >= 1, "deepspeed::ProgramValues::world_size ", program.world_size,
              " must be at least 1");
  const json j = detail::parse_relaxed_json(json_text, "ds_config");
  deepspeed::Config out;
  out.world_size = program.world_size;
  out.sharding.strategy = ShardingStrategy::kNoShard;  // stage 0 when zero_optimization is absent
  ConfigReader r(program, out);
  // Note [Every problem at once]: each part on its own, then one error for all.
  const std::vector<std::string> keys = {"train_batch_size",
                                         "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps",
                                         "gradient_clipping",
                                         kFp16Key,
                                         kBf16Key,
                                         "bfloat16",
                                         "optimizer",
                                         "scheduler",
                                         "zero_optimization",
                                         "steps_per_print",
                                         "wall_clock_breakdown",
                                         "pipeline"};
  r.check_keys(j, "", keys);
  if (j.contains("pipeline")) r.attempt([&] { r.pipeline(j["pipeline"]); });
  r.attempt([&] { r.batch(j); });
  if (j.contains("gradient_clipping")) {
    r.attempt([&] {
      out.gradient_clipping =
          r.number("gradient_clipping", j["gradient_clipping"], program.gradient_clipping);
      r.note("gradient_clipping", j["gradient_clipping"], true,
             "deepspeed::Config::gradient_clipping: the global gradient norm's bound (0: off)",
             is_auto(j["gradient_clipping"]) ? number_text(out.gradient_clipping) : "");
    });
  }
  r.attempt([&] { r.precision(j); });
  if (j.contains("optimizer")) r.attempt([&] { r.optimizer(j["optimizer"]); });
  if (j.contains("scheduler")) r.attempt([&] { r.scheduler(j["scheduler"]); });
  if (j.contains("zero_optimization")) r.attempt([&] { r.zero(j["zero_optimization"]); });
  if (j.contains("steps_per_print")) {
    r.attempt([&] {
      out.steps_per_print = r.integer("steps_per_print", j["steps_per_print"], {}, 1);
      r.note("steps_per_print", j["steps_per_print"], true,
             "deepspeed::Config::steps_per_print: a progress line every this many steps");
    });
  }
  if (j.contains("wall_clock_breakdown")) {
    r.attempt([&] {
      out.wall_clock_breakdown = r.boolean("wall_clock_breakdown", j["wall_clock_breakdown"]);
      r.note("wall_clock_breakdown", j["wall_clock_breakdown"], false,
             "each step's time is logged; the per-unit trace (ShardingOptions::trace) breaks it "
             "down by phase");
    });
  }
  r.finish();
  return out;
}

deepspeed::Config deepspeed::load_config(const std::string& path,
                                         const deepspeed::ProgramValues& program) {
  std::ifstream f(path);
  TORCH_CHECK(f.good(), "ds_config: cannot open ", path);
  std::stringstream text;
  text << f.rdbuf();
  return deepspeed::parse_config(text.str(), program);
}

bool deepspeed::Config::has(const std::string& key) const {
  return std::any_of(notes.begin(), notes.end(), [&](const auto& n) { return n.key == key; });
}

std::string deepspeed::Config::describe() const {
  std::ostringstream s;
  const ShardingOptions& so = sharding;
  s << "DeepSpeed config: strategy " << ds_strategy_name(so.strategy) << ", offload_optimizer "
    << ds_offload_name(so.offload_optimizer.device) << ", offload_param "
    << ds_offload_name(so.offload_param.device) << ", precision " << fsdp::to_string(precision);
  if (precision == Precision::kFp16) {
    s << " (loss scale ";
    if (loss_scaler.loss_scale > 0)
      s << "static " << loss_scaler.loss_scale;
    else
      s << "dynamic from 2^" << loss_scaler.initial_scale_power << ", window "
        << loss_scaler.loss_scale_window << ", hysteresis " << loss_scaler.hysteresis << ", min "
        << loss_scaler.min_loss_scale;
    s << ")";
  }
  s << ", prefetch ";
  if (so.max_gathered_units == INT_MAX)
    s << "max_live_numel " << so.max_live_numel << ", prefetch_bucket_numel "
      << so.prefetch_bucket_numel;
  else
    s << "max_gathered_units " << so.max_gathered_units;
  if (so.persistence_threshold_numel > 0)
    s << ", persistence_threshold_numel " << so.persistence_threshold_numel;
  const QuantizedCommunication& q = so.quantized_communication;
  if (q.weights || q.gradients || so.reshard_after_forward_group_size > 0) {
    s << "\n  ZeRO++: weights "
      << (q.weights ? "int" + std::to_string(q.weight_bits) : "unquantized") << ", gradients "
      << (q.gradients ? "int" + std::to_string(q.gradient_bits) : "unquantized") << " (blocks of "
      << q.block_size << "), hpZ group "
      << (so.reshard_after_forward_group_size > 0
              ? std::to_string(so.reshard_after_forward_group_size)
              : "off");
  }
  s << "\n  batch " << train_batch_size << " = micro " << micro_batch_per_rank << " x accumulation "
    << gradient_accumulation_steps;
  if (pipeline_stages > 1) {
    s << " x data-parallel " << world_size / pipeline_stages << " (" << pipeline_stages
      << " pipeline stages, partition " << pipeline_partition << ")";
  } else {
    s << " x world " << world_size;
  }
  s << ", gradient_clipping " << gradient_clipping;
  if (optimizer.present)
    s << "\n  optimizer " << optimizer.type << ": lr " << optimizer.lr << ", betas ("
      << optimizer.beta1 << ", " << optimizer.beta2 << "), eps " << optimizer.eps
      << ", weight_decay " << optimizer.weight_decay
      << (optimizer.decoupled_weight_decay ? "" : " (L2, adam_w_mode false)");
  if (has_scheduler)
    s << "\n  scheduler " << (scheduler.total_num_steps > 0 ? "WarmupDecayLR" : "WarmupLR") << ": "
      << scheduler.warmup_min_lr << " -> " << scheduler.warmup_max_lr << " over "
      << scheduler.warmup_num_steps << " steps ("
      << (scheduler.warmup_type == WarmupSchedule::Type::kLog ? "log" : "linear") << ")"
      << (scheduler.total_num_steps > 0
              ? ", then linearly to 0 at step " + std::to_string(scheduler.total_num_steps)
              : "");
  for (const auto& n : notes)
    s << "\n  " << n.key << " = " << n.value << ": "
      << (n.applied ? "applied: " : "no effect here: ") << n.effect;
  return s.str();
}

}  // namespace fsdp
