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
#include "gpt_model.h"

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <variant>

namespace {

using examples::UsageError;
using gpt::Data;

// ---- options ----------------------------------------------------------------

cxxopts::Options make_options() {
  cxxopts::Options o("train_gpt", "Train the GPT example, fully sharded over the job's ranks.");
  o.add_options("model")("n-layer", "transformer blocks",
                         cxxopts::value<int64_t>()->default_value("2"))(
      "n-head", "attention heads", cxxopts::value<int64_t>()->default_value("4"))(
      "d-model", "model width", cxxopts::value<int64_t>()->default_value("64"))(
      "block-size", "context length in bytes", cxxopts::value<int64_t>()->default_value("32"))(
      "dropout", "dropout probability", cxxopts::value<double>()->default_value("0"));
  o.add_options("training")("batch-size", "global batch in sequences, split across ranks",
                            cxxopts::value<int64_t>()->default_value("16"))(
      "grad-accum", "micro-batches per step", cxxopts::value<int64_t>()->default_value("1"))(
      "steps", "optimizer steps", cxxopts::value<int64_t>()->default_value("200"))(
      "lr", "peak learning rate", cxxopts::value<double>()->default_value("3e-3"))(
      "weight-decay", "AdamW weight decay", cxxopts::value<double>()->default_value("0.01"))(
      "warmup-steps", "linear warm-up steps", cxxopts::value<int64_t>()->default_value("10"))(
      "lr-schedule", "constant|cosine", cxxopts::value<std::string>()->default_value("cosine"))(
      "clip-grad", "clip the global gradient norm to this (0: off)",
      cxxopts::value<double>()->default_value("1.0"))(
      "seed", "seed for weights and data", cxxopts::value<uint64_t>()->default_value("1337"))(
      "data", "train on this text file, byte-level (default: the synthetic task)",
      cxxopts::value<std::string>()->default_value(""))(
      "val-fraction",
      "with --data: hold out this last fraction of the file; its loss is printed as training goes "
      "(0: none)",
      cxxopts::value<double>()->default_value("0.1"));
  o.add_options("sharding")("precision",
                            "fp32|bf16|fp16 (bf16, fp16: compute and communication in 16 bits over "
                            "fp32 masters; fp16 with a dynamic loss scale)",
                            cxxopts::value<std::string>()->default_value("fp32"))(
      "loss-scale-power",
      "fp16: the dynamic loss scale starts at 2^N (DeepSpeed's initial_scale_power)",
      cxxopts::value<int>()->default_value("16"))(
      "sharding", "full|grad_op|none|hybrid", cxxopts::value<std::string>()->default_value("full"))(
      "hybrid-group-size", "ranks per shard group for --sharding hybrid",
      cxxopts::value<int>()->default_value("0"))(
      "wrap", "block|size:N|none", cxxopts::value<std::string>()->default_value("block"))(
      "activation-checkpointing", "none|all|every:K (blocks recomputed in backward)",
      cxxopts::value<std::string>()->default_value("none"))(
      "cpu-offload",
      "keep fp32 shards, gradients and optimizer state in host memory (ZeRO-Offload)");
  o.add_options("checkpoint")("save-dir",
                              "save sharded checkpoints here (every rank writes its own file)",
                              cxxopts::value<std::string>()->default_value(""))(
      "save-every", "save every K steps (0: only at the end)",
      cxxopts::value<int64_t>()->default_value("0"))("keep",
                                                     "keep the newest K checkpoints (0: all)",
                                                     cxxopts::value<int64_t>()->default_value("3"))(
      "async-save",
      "save in the background: training waits only while this rank's state is copied to host "
      "memory")("stop-at",
                "stop after this step, as if preempted (a checkpoint is saved); the schedule still "
                "spans --steps",
                cxxopts::value<int64_t>()->default_value("0"))(
      "resume",
      "continue from the newest checkpoint in --save-dir (a fresh start if there is none)")(
      "init-from",
      "start from these consolidated weights: an HDF5 file, or safetensors (file, index or "
      "directory); step 0, fresh optimizer; the architecture is the file's (model flags given must "
      "agree)",
      cxxopts::value<std::string>()->default_value(""))(
      "consolidate-to",
      "at the end, write one consolidated HDF5 file here (for generate and other tools)",
      cxxopts::value<std::string>()->default_value(""));
  o.add_options("output")("log-jsonl", "rank 0 writes one JSON object per step here",
                          cxxopts::value<std::string>()->default_value(""))(
      "log-every", "progress line every K steps (0: about 20 lines per run)",
      cxxopts::value<int64_t>()->default_value("0"))(
      "io-log",
      "rank 0 appends one JSON object per checkpoint save, load and consolidated export here "
      "({\"event\", \"path\", \"seconds\"}; timed from a barrier to a barrier)",
      cxxopts::value<std::string>()->default_value(""))(
      "config", "JSON file with any of these options; flags given here override it",
      cxxopts::value<std::string>()->default_value(""))("h,help", "show this help");
  return o;
}

// Turns {"n_layer": 4, "lr-schedule": "cosine", "resume": true} into
// "--n-layer=4 --lr-schedule=cosine --resume" (a switch set to false is left out).
std::vector<std::string> config_args(const std::string& path, const cxxopts::Options& options) {
  std::ifstream f(path);
  if (!f) throw UsageError("--config " + path + ": cannot open the file");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    throw UsageError("--config " + path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object())
    throw UsageError("--config " + path + ": the top level must be a JSON object");
  std::vector<std::string> out;
  for (auto& [key, value] : j.items()) {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (flag == "config" || flag == "help")
      throw UsageError("--config " + path + ": key '" + key + "' is not allowed in a config file");
    if (value.is_object() || value.is_array() || value.is_null()) {
      throw UsageError("--config " + path + ": key '" + key +
                       "' must be a number, a string or true/false");
    }
    if (value.is_boolean()) {
      if (value.get<bool>()) out.push_back("--" + flag);
      continue;
    }
    const std::string v = value.is_string() ? value.get<std::string>() : value.dump();
    out.push_back("--" + flag + "=" + v);
  }
  (void)options;
  return out;
}

fsdp::ShardingStrategy parse_sharding(const std::string& s) {
  if (s == "full") return fsdp::ShardingStrategy::kFullShard;
  if (s == "grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (s == "none") return fsdp::ShardingStrategy::kNoShard;
  if (s == "hybrid") return fsdp::ShardingStrategy::kHybridShard;
  throw UsageError("--sharding " + s + " is unknown; use full, grad_op, none or hybrid");
}

// --init-from FILE: the architecture comes from the file's attributes (HDF5 root
// attributes, or a safetensors __metadata__). A flag given on the command line must agree
// with the file, each disagreement named with both values (checked before any rank
// starts training).
void apply_init_file(const std::string& file, gpt::Config& cfg, const cxxopts::ParseResult& r) {
  if (!std::filesystem::exists(file))
    throw UsageError("--init-from " + file + ": cannot open the file");
  std::map<std::string, fsdp::AttrValue> attrs;
  try {
    attrs = fsdp::consolidated_attributes(file);
  } catch (const c10::Error& e) {
    throw UsageError("--init-from " + file + ": not a consolidated checkpoint (" +
                     e.what_without_backtrace() + ")");
  }
  for (const auto& [key, field] : gpt::architecture_fields(cfg)) {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    // vocab_size has no flag: the byte-level vocabulary is always 256.
    const bool given = flag == "vocab-size" || r.count(flag) > 0;
    const std::string ours =
        (flag == "vocab-size" ? "vocab_size " : "--" + flag + " ") + std::to_string(*field);
    auto it = attrs.find(key);
    if (it == attrs.end()) {
      throw UsageError("--init-from " + file + " has no attribute " + key +
                       " (a GPT file records n_layer, n_head, d_model, block_size and vocab_size)");
    }
    if (!std::holds_alternative<int64_t>(it->second) ||
        (given && std::get<int64_t>(it->second) != *field)) {
      const std::string theirs = std::holds_alternative<int64_t>(it->second)
                                     ? std::to_string(std::get<int64_t>(it->second))
                                 : std::holds_alternative<double>(it->second)
                                     ? std::to_string(std::get<double>(it->second))
                                     : std::get<std::string>(it->second);
      throw UsageError(ours + " but " + file + " has " + key + " " + theirs +
                       "; leave the flag out to take the file's, or give another file");
    }
    *field = std::get<int64_t>(it->second);
  }
}

fsdp::WrapPolicy parse_wrap(const std::string& s) {
  if (s == "block") return fsdp::module_type_policy<gpt::Block>();
  if (s == "none") return fsdp::never_wrap_policy();
  if (s.rfind("size:", 0) == 0) {
    try {
      size_t used = 0;
      long long n = std::stoll(s.substr(5), &used);
      if (used == s.size() - 5 && n >= 0) return fsdp::size_based_policy(n);
    } catch (const std::exception&) {
    }
  }
  throw UsageError("--wrap " + s +
                   " is unknown; use block, none or size:N (N = least parameters per unit)");
}

fsdp::WrapPolicy parse_checkpointing(const std::string& s) {
  if (s == "none") return nullptr;
  if (s == "all") return fsdp::module_type_policy<gpt::Block>();
  if (s.rfind("every:", 0) == 0) {
    try {
      size_t used = 0;
      int k = std::stoi(s.substr(6), &used);
      if (used == s.size() - 6 && k >= 1) {
        return fsdp::all_policy(
            {fsdp::module_type_policy<gpt::Block>(), fsdp::every_kth_policy(k)});
      }
    } catch (const std::exception&) {
    }
  }
  throw UsageError("--activation-checkpointing " + s +
                   " is unknown; use none, all or every:K (K >= 1)");
}

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
  auto options = make_options();
  std::vector<std::string> args{argv[0]};
  // A first pass finds --config; its values go first so that flags override them.
  {
    auto first = make_options();
    first.allow_unrecognised_options();
    auto r = first.parse(argc, argv);
    if (r.count("help")) {
      std::cout << options.help() << std::endl;
      return 0;
    }
    if (!r["config"].as<std::string>().empty()) {
      auto extra = config_args(r["config"].as<std::string>(), options);
      args.insert(args.end(), extra.begin(), extra.end());
    }
  }
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  auto r = options.parse(static_cast<int>(cargs.size()), cargs.data());
  if (!r.unmatched().empty())
    throw UsageError("unexpected argument '" + r.unmatched()[0] + "'; see --help");

  gpt::Config cfg;
  cfg.n_layer = r["n-layer"].as<int64_t>();
  cfg.n_head = r["n-head"].as<int64_t>();
  cfg.d_model = r["d-model"].as<int64_t>();
  cfg.block_size = r["block-size"].as<int64_t>();
  cfg.dropout = r["dropout"].as<double>();
  const std::string init_from = r["init-from"].as<std::string>();
  if (!init_from.empty()) apply_init_file(init_from, cfg, r);
  const int64_t batch = r["batch-size"].as<int64_t>();
  const int64_t accum = r["grad-accum"].as<int64_t>();
  const int64_t steps = r["steps"].as<int64_t>();
  const double lr = r["lr"].as<double>();
  const int64_t warmup = r["warmup-steps"].as<int64_t>();
  const std::string schedule = r["lr-schedule"].as<std::string>();
  const double clip = r["clip-grad"].as<double>();
  const uint64_t seed = r["seed"].as<uint64_t>();

  auto positive = [](const char* flag, double v) {
    if (!(v > 0))
      throw UsageError(std::string("--") + flag + " " + std::to_string(v) + " must be positive");
  };
  positive("n-layer", cfg.n_layer);
  positive("n-head", cfg.n_head);
  positive("d-model", cfg.d_model);
  positive("block-size", cfg.block_size);
  positive("batch-size", batch);
  positive("grad-accum", accum);
  positive("steps", steps);
  positive("lr", lr);
  if (cfg.d_model % cfg.n_head != 0) {
    throw UsageError("--d-model " + std::to_string(cfg.d_model) +
                     " must be divisible by --n-head " + std::to_string(cfg.n_head));
  }
  if (cfg.dropout < 0 || cfg.dropout >= 1) throw UsageError("--dropout must be in [0, 1)");
  if (warmup < 0) throw UsageError("--warmup-steps must not be negative");
  if (clip < 0) throw UsageError("--clip-grad must not be negative (0 turns clipping off)");
  if (schedule != "constant" && schedule != "cosine") {
    throw UsageError("--lr-schedule " + schedule + " is unknown; use constant or cosine");
  }
  const std::string precision = r["precision"].as<std::string>();
  const int scale_power = r["loss-scale-power"].as<int>();
  if (r.count("loss-scale-power") && precision != "fp16") {
    throw UsageError("--loss-scale-power applies only to --precision fp16 (this run is " +
                     precision + ")");
  }
  if (scale_power < 0 || scale_power > 60) {
    throw UsageError("--loss-scale-power " + std::to_string(scale_power) +
                     " must be between 0 and 60 (the default is 16)");
  }
  fsdp::ShardingOptions so;
  if (precision == "bf16") {
    so.mixed_precision.param_dtype = torch::kBFloat16;
    so.mixed_precision.reduce_dtype = torch::kBFloat16;
    so.mixed_precision.output_dtype = torch::kFloat32;
  } else if (precision == "fp16") {
    // fp16 gradients under- and overflow without a loss scale: a dynamic one (DeepSpeed's
    // rules) scales the loss, and a step whose gradients hold inf or nan is skipped.
    so.mixed_precision.param_dtype = torch::kHalf;
    so.mixed_precision.reduce_dtype = torch::kHalf;
    so.mixed_precision.output_dtype = torch::kFloat32;
  } else if (precision != "fp32") {
    throw UsageError("--precision " + precision + " is unknown; use fp32, bf16 or fp16");
  }

  so.strategy = parse_sharding(r["sharding"].as<std::string>());
  so.hybrid_group_size = r["hybrid-group-size"].as<int>();
  so.auto_wrap_policy = parse_wrap(r["wrap"].as<std::string>());
  so.checkpoint_policy = parse_checkpointing(r["activation-checkpointing"].as<std::string>());

  const double val_fraction = r["val-fraction"].as<double>();
  if (!(val_fraction >= 0 && val_fraction < 1)) {
    std::ostringstream v;
    v << val_fraction;
    throw UsageError("--val-fraction " + v.str() +
                     " must be at least 0 and below 1 (0: no validation)");
  }
  Data data(seed, r["data"].as<std::string>(), val_fraction);
  data.check(cfg.block_size);

  fsdp::ProcessGroup pg = fsdp::init_process_group();
  so.process_group = pg;
  const int world = pg.size();
  const bool main_rank = pg.rank() == 0;
  if (batch % (world * accum) != 0) {
    throw UsageError("--batch-size " + std::to_string(batch) + " must be divisible by world size " +
                     std::to_string(world) + " x --grad-accum " + std::to_string(accum) +
                     "; try --batch-size " +
                     std::to_string((batch / (world * accum) + 1) * world * accum));
  }

  const std::string save_dir = r["save-dir"].as<std::string>();
  const int64_t save_every = r["save-every"].as<int64_t>();
  const int64_t keep = r["keep"].as<int64_t>();
  const bool resume = r.count("resume") > 0;
  const std::string consolidate_to = r["consolidate-to"].as<std::string>();
  if (save_every < 0)
    throw UsageError("--save-every " + std::to_string(save_every) + " must not be negative");
  const int64_t stop_at = r["stop-at"].as<int64_t>();
  if (stop_at < 0 || stop_at > steps) {
    throw UsageError("--stop-at " + std::to_string(stop_at) + " must be between 1 and --steps " +
                     std::to_string(steps) + " (0: run all steps)");
  }
  if (keep < 0)
    throw UsageError("--keep " + std::to_string(keep) + " must not be negative (0 keeps all)");
  if ((resume || save_every > 0 || r.count("async-save")) && save_dir.empty()) {
    throw UsageError(std::string(resume           ? "--resume"
                                 : save_every > 0 ? "--save-every"
                                                  : "--async-save") +
                     " needs --save-dir DIR");
  }
  // Output locations are checked now, not after hours of training.
  if (!save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(save_dir, ec);
    if (ec || !std::filesystem::is_directory(save_dir)) {
      throw UsageError("--save-dir " + save_dir + ": cannot create the directory (" + ec.message() +
                       ")");
    }
  }
  if (!consolidate_to.empty()) {
    const auto parent = std::filesystem::absolute(consolidate_to).parent_path();
    if (!std::filesystem::is_directory(parent)) {
      throw UsageError("--consolidate-to " + consolidate_to + ": the directory " + parent.string() +
                       " does not exist");
    }
  }

  so.cpu_offload = r.count("cpu-offload") > 0;

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
    lso.initial_scale_power = r["loss-scale-power"].as<int>();
    scaler.emplace(model, lso);
  }
  // Shards in host memory (CPU training, or offload) step with the fused SIMD AdamW;
  // shards on a GPU with LibTorch's. Under bf16 the fused step also writes each shard's
  // bf16 copy, which the next gathers send instead of casting the shard again.
  const auto adamw = torch::optim::AdamWOptions(lr).weight_decay(r["weight-decay"].as<double>());
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
    st.extra = {{"seed", std::to_string(seed)}, {"data", r["data"].as<std::string>()}};
    if (scaler) st.loss_scaler = scaler->state();
    return st;
  };
  // --io-log: each save, load and export timed on rank 0 from a barrier to a barrier, so
  // the figure is the slowest rank's (scripts/compare-pytorch.sh compares it with DCP's).
  const std::string io_log_path = r["io-log"].as<std::string>();
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
  const bool async_save = r.count("async-save") > 0;
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
  if (main_rank && !r["log-jsonl"].as<std::string>().empty()) {
    jsonl.open(r["log-jsonl"].as<std::string>());
    if (!jsonl)
      throw UsageError("--log-jsonl " + r["log-jsonl"].as<std::string>() +
                       ": cannot write the file");
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
    std::cout << "train_gpt: " << r["data"].as<std::string>() << ": " << data.train_bytes()
              << " bytes to train on, " << data.val_bytes()
              << " held out for validation (--val-fraction " << val_fraction << ")" << std::endl;
  }
  const int64_t log_every = r["log-every"].as<int64_t>() > 0 ? r["log-every"].as<int64_t>()
                                                             : std::max<int64_t>(1, steps / 20);
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
