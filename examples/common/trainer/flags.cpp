#include "flags.h"

#include "../cli.h"
#include "../device.h"
#include "architecture.h"
#include "config_file.h"
#include "sharding_options.h"

#include <fsdp/core/options.h>
#include <cxxopts.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <variant>
#include <vector>

namespace lm {
namespace {

using examples::usage_checked;
using examples::UsageError;

Program& current_program() {  // parse_flags sets it
  static Program p;
  return p;
}

bool llama_arch() { return current_program().arch == "llama"; }

template <class T>
std::shared_ptr<cxxopts::Value> value(const char* default_value) {
  return cxxopts::value<T>()->default_value(default_value);
}

// ---- the flags, in the groups --help lists ------------------------------------------

void add_model_flags(cxxopts::Options& o) {
  auto flag = o.add_options("model");
  flag("n-layer", "transformer blocks", value<int64_t>("2"));
  flag("n-head", "attention heads", value<int64_t>("4"));
  flag("d-model", "model width", value<int64_t>("64"));
  if (llama_arch()) {
    flag("block-size",
         "training sequence length in bytes (the model's max_position_embeddings: this, or "
         "--init-from's config.json)",
         value<int64_t>("32"));
    flag("n-kv-head", "key/value heads (grouped-query attention; divides --n-head)",
         value<int64_t>("2"));
    flag("intermediate-size", "the SwiGLU MLP's width (0: 8/3 of --d-model, rounded up to 16)",
         value<int64_t>("0"));
    flag("rope-theta", "the rotary positions' base", value<double>("10000"));
    flag("rms-norm-eps", "RMSNorm's epsilon", value<double>("1e-5"));
    flag("tie-embeddings", "lm_head is the embedding (tie_word_embeddings)");
  } else {
    flag("block-size", "context length in bytes", value<int64_t>("32"));
    flag("dropout", "dropout probability", value<double>("0"));
  }
  flag("attention", examples::kAttentionHelp, value<std::string>("sdpa"));
}

void add_training_flags(cxxopts::Options& o) {
  auto flag = o.add_options("training");
  flag("batch-size", "global batch in sequences, split across ranks", value<int64_t>("16"));
  flag("grad-accum", "micro-batches per step", value<int64_t>("1"));
  flag("steps",
       "optimizer steps (0: build, load, evaluate and export, and train nothing: "
       "a conversion)",
       value<int64_t>("200"));
  flag("lr", "peak learning rate", value<double>("3e-3"));
  flag("weight-decay", "AdamW weight decay", value<double>("0.01"));
  flag("no-decay-recipe",
       "standard: no weight decay for biases and norm weights (1-D parameters); none: every "
       "parameter decays",
       value<std::string>("standard"));
  flag("warmup-steps", "warm-up steps", value<int64_t>("10"));
  flag("lr-schedule",
       "constant|cosine (each after a linear warm-up to --lr), warmup|warmup_decay (DeepSpeed's "
       "WarmupLR and WarmupDecayLR: --warmup-min-lr to --lr over --warmup-steps, then constant, "
       "or linearly to 0 at --steps)",
       value<std::string>("cosine"));
  flag("warmup-min-lr", "warmup, warmup_decay: the rate they start from", value<double>("0"));
  flag("warmup-type", "warmup, warmup_decay: log|linear (DeepSpeed's warmup_type)",
       value<std::string>("log"));
  flag("adam-betas", "AdamW's betas, B1,B2", value<std::string>("0.9,0.999"));
  flag("adam-eps", "AdamW's eps", value<double>("1e-8"));
  flag("clip-grad", "clip the global gradient norm to this (0: off)", value<double>("1.0"));
  flag("seed", "seed for weights and data", value<uint64_t>("1337"));
  flag("eval-text",
       "before the first step and after the last, print the loss on this file's bytes, cut into "
       "rows of --block-size + 1 (at most 64 rows; every rank computes all of them), with 9 "
       "significant digits: a fixed batch to compare with another framework",
       value<std::string>(""));
  flag("data", "train on this text file, byte-level (default: the synthetic task)",
       value<std::string>(""));
  flag("val-fraction",
       "with --data: hold out this last fraction of the file; its loss is printed as training "
       "goes (0: none)",
       value<double>("0.1"));
}

void add_sharding_flags(cxxopts::Options& o) {
  auto flag = o.add_options("sharding");
  flag("precision",
       "fp32|bf16|fp16 (bf16, fp16: compute and communication in 16 bits over fp32 masters; "
       "fp16 with a dynamic loss scale)",
       value<std::string>("fp32"));
  flag("loss-scale-power",
       "fp16: the dynamic loss scale starts at 2^N (DeepSpeed's initial_scale_power)",
       value<int>("16"));
  flag("loss-scale", "fp16: a static loss scale (0: dynamic)", value<double>("0"));
  flag("loss-scale-window", "fp16: clean steps before the dynamic scale doubles",
       value<int>("1000"));
  flag("loss-scale-hysteresis", "fp16: overflows absorbed before the scale halves",
       value<int>("2"));
  flag("min-loss-scale", "fp16: the dynamic scale's floor", value<double>("1"));
  flag("master-dtype",
       "fp32|bf16: the dtype of the shards, their gradients and the optimizer state; bf16 is "
       "pure bf16 (needs --precision bf16): 8 bytes per parameter instead of 16",
       value<std::string>("fp32"));
  flag("bf16-rounding",
       "auto|nearest|stochastic|compensated: how --master-dtype bf16 writes each update "
       "(fsdp::FusedAdamW::Bf16Rounding); stochastic and compensated need the step on the host "
       "(--device cpu or --offload-optimizer); auto: stochastic there, else nearest",
       value<std::string>("auto"));
  flag("sharding", "full|grad_op|none|hybrid|zero1|zero2|zero3", value<std::string>("full"));
  flag("offload-optimizer",
       "none|cpu|nvme: fp32 masters, gradients and optimizer state off the device (DeepSpeed's "
       "offload_optimizer)",
       value<std::string>("none"));
  flag("offload-param",
       "none|cpu|nvme: the parameter shards too (DeepSpeed's offload_param; needs "
       "--offload-optimizer)",
       value<std::string>("none"));
  flag("nvme-path", "the directory of --offload-optimizer/--offload-param nvme",
       value<std::string>(""));
  flag("max-gathered-units", "prefetching stops while this many units are gathered",
       value<int>("2"));
  flag("max-live-numel",
       "prefetching also stops before the gathered units would hold more parameter elements "
       "(DeepSpeed's stage3_max_live_parameters); 0: no such bound",
       value<int64_t>("0"));
  flag("prefetch-bucket-numel",
       "at most this many parameter elements gathered ahead (DeepSpeed's "
       "stage3_prefetch_bucket_size); 0: no such bound",
       value<int64_t>("0"));
  flag("persistence-threshold-numel",
       "units with fewer parameter elements stay gathered between uses (DeepSpeed's "
       "stage3_param_persistence_threshold); 0: none",
       value<int64_t>("0"));
  flag("hybrid-group-size", "ranks per shard group for --sharding hybrid", value<int>("0"));
  flag("hpz-group-size",
       "ZeRO++ hpZ (FSDP2's reshard_after_forward=K): after forward each unit keeps a 1/K slice in "
       "its group of K consecutive ranks (one node), and backward gathers from there; 0: off",
       value<int>("0"));
  flag("quantize-weights",
       "ZeRO++ qwZ: parameter all-gathers carry int8 (--quantize-weight-bits) with one scale per "
       "--quantize-block elements");
  flag("quantize-gradients",
       "ZeRO++ qgZ: gradients reduce through an all-to-all of int8 (--quantize-gradient-bits) "
       "chunks, summed in fp32; hierarchical with --hpz-group-size");
  flag("quantize-weight-bits", "8 or 4", value<int>("8"));
  flag("quantize-gradient-bits", "8 or 4", value<int>("8"));
  flag("quantize-block", "elements per quantization scale", value<int64_t>("2048"));
  flag("wrap", "block|size:N|none", value<std::string>("block"));
  flag("activation-checkpointing", "none|all|every:K (blocks recomputed in backward)",
       value<std::string>("none"));
  flag("device", examples::kDeviceHelp, value<std::string>("auto"));
  flag("backend", examples::kBackendHelp, value<std::string>("auto"));
  flag("offload-activations",
       "keep the inputs that --activation-checkpointing saves in host memory (pinned on a GPU) "
       "from forward to backward");
  flag("cpu-offload",
       "keep fp32 shards, gradients and optimizer state in host memory (ZeRO-Offload)");
  flag("construction",
       "sharded|eager: sharded shards each block the moment it is built, so no rank ever holds "
       "the whole model (fsdp::make_sharded); eager builds the whole model on every rank, then "
       "shards it (fsdp::fully_shard). Same weights either way",
       value<std::string>("sharded"));
  flag("no-prefetch",
       "gather each unit only when it runs, not while the one before it computes (to measure "
       "how much communication prefetching hides)");
  flag("trace",
       "write a per-unit trace into this directory (each rank's trace_rank<R>.json: gathers, "
       "forwards, backwards, reduce-scatters, optimizer, checkpoints; `fsdp-trace merge DIR`; "
       "FSDP_TRACE does the same)",
       value<std::string>(""));
}

void add_checkpoint_flags(cxxopts::Options& o) {
  auto flag = o.add_options("checkpoint");
  flag("save-dir", "save sharded checkpoints here (every rank writes its own file)",
       value<std::string>(""));
  flag("save-every", "save every K steps (0: only at the end)", value<int64_t>("0"));
  flag("keep", "keep the newest K checkpoints (0: all)", value<int64_t>("3"));
  flag("async-save",
       "save in the background: training waits only while this rank's state is copied to host "
       "memory");
  flag("stop-at",
       "stop after this step, as if preempted (a checkpoint is saved); the schedule still spans "
       "--steps",
       value<int64_t>("0"));
  flag("resume",
       "continue from the newest checkpoint in --save-dir (a fresh start if there is none)");
  flag("init-from",
       "start from these consolidated weights: an HDF5 file, or safetensors (file, index or "
       "directory); step 0, fresh optimizer; the architecture is the file's (model flags given "
       "must agree)",
       value<std::string>(""));
  flag("consolidate-to",
       "at the end, write one consolidated HDF5 file here (for generate and other tools)",
       value<std::string>(""));
  if (current_program().hf_config_json) {
    flag("export-hf",
         "at the end, write a Hugging Face model directory here: config.json and "
         "model.safetensors under transformers' names (AutoModelForCausalLM.from_pretrained "
         "loads it)",
         value<std::string>(""));
    flag("export-dtype", "fp32|bf16|fp16: the dtype of --export-hf's weights",
         value<std::string>("fp32"));
  }
}

void add_pipeline_flags(cxxopts::Options& o) {
  auto flag = o.add_options("pipeline");
  flag("pipeline-stages",
       "pipeline stages over the ranks (divides the world size; each stage sharded over its "
       "world/stages ranks); 1: no pipeline",
       value<int>("1"));
  flag("pipeline-schedule", "gpipe|1f1b", value<std::string>("1f1b"));
  flag("micro-batches", "micro-batches per step through the pipeline (0: 2 x --pipeline-stages)",
       value<int>("0"));
  flag("partition",
       "how the layers (embeddings, each block, the head) split into stages: parameters, "
       "uniform, or the first layer of each stage after the first, e.g. 3,6",
       value<std::string>("parameters"));
}

void add_output_flags(cxxopts::Options& o) {
  auto flag = o.add_options("output");
  flag("log-jsonl", "rank 0 writes one JSON object per step here", value<std::string>(""));
  flag("log-every", "progress line every K steps (0: about 20 lines per run)", value<int64_t>("0"));
  flag("io-log",
       "rank 0 appends one JSON object per checkpoint save, load and consolidated export here "
       "({\"event\", \"path\", \"seconds\"}; timed from a barrier to a barrier)",
       value<std::string>(""));
  flag("config", "JSON file with any of these options; flags given here override it",
       value<std::string>(""));
  flag("deepspeed-config",
       "a DeepSpeed ds_config.json: its keys set the flags above (\"auto\" takes the flag's "
       "value; a flag given with another value is an error); rank 0 prints what each key became",
       value<std::string>(""));
  flag("h,help", "show this help");
}

cxxopts::Options make_options() {
  cxxopts::Options o(current_program().name, current_program().description);
  add_model_flags(o);
  add_training_flags(o);
  add_sharding_flags(o);
  add_checkpoint_flags(o);
  add_output_flags(o);
  add_pipeline_flags(o);
  return o;
}

// The command line with --config's values first, so that flags given here override
// them; std::nullopt after printing --help.
std::optional<std::vector<std::string>> command_line(int argc, char** argv) {
  auto first = make_options();
  first.allow_unrecognised_options();
  auto r = first.parse(argc, argv);
  if (r.count("help")) {
    std::cout << make_options().help() << std::endl;
    return std::nullopt;
  }
  std::vector<std::string> args{argv[0]};
  if (!r["config"].as<std::string>().empty()) {
    auto extra = config_file_args(r["config"].as<std::string>());
    args.insert(args.end(), extra.begin(), extra.end());
  }
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return args;
}

// ---- values: each group read, then checked in the order errors are reported ---------

// A flag given on the command line must agree with the architecture --init-from reads.
template <class T>
void agree(const cxxopts::ParseResult& r, const std::string& flag, const T& ours, const T& theirs,
           const std::string& file, const std::string& key) {
  if (r.count(flag) == 0) return;
  if (r[flag].as<T>() == theirs) return;
  std::ostringstream msg;
  msg << "--" << flag << " " << ours << " but " << file << " has " << key << " " << theirs
      << "; leave the flag out to take the file's, or give another file";
  throw UsageError(msg.str());
}

// --init-from DIR with a config.json (a Hugging Face model directory): the architecture is
// config.json's; the flags given must agree with it.
void apply_hf_dir(const std::string& dir, Config& cfg, const cxxopts::ParseResult& r) {
  Config hf = current_program().read_hf_config(dir, cfg.block_size);
  const std::string file = dir + "/config.json";
  agree<int64_t>(r, "n-layer", cfg.n_layer, hf.n_layer, file, "num_hidden_layers");
  agree<int64_t>(r, "n-head", cfg.n_head, hf.n_head, file, "num_attention_heads");
  agree<int64_t>(r, "n-kv-head", cfg.n_kv_head, hf.n_kv_head, file, "num_key_value_heads");
  agree<int64_t>(r, "d-model", cfg.d_model, hf.d_model, file, "hidden_size");
  agree<int64_t>(r, "intermediate-size", cfg.intermediate_size, hf.intermediate_size, file,
                 "intermediate_size");
  agree<double>(r, "rope-theta", cfg.rope_theta, hf.rope_theta, file, "rope_theta");
  agree<double>(r, "rms-norm-eps", cfg.rms_norm_eps, hf.rms_norm_eps, file, "rms_norm_eps");
  if (r.count("tie-embeddings") && !hf.tie_embeddings) {
    throw UsageError("--tie-embeddings but " + file +
                     " has tie_word_embeddings false; leave the flag out to take the file's");
  }
  if (cfg.block_size > hf.max_positions) {
    throw UsageError("--block-size " + std::to_string(cfg.block_size) + " is past " + file +
                     "'s max_position_embeddings " + std::to_string(hf.max_positions) +
                     "; use a --block-size of at most that");
  }
  cfg = hf;
}

// --init-from FILE: the architecture comes from the file's attributes (HDF5 root
// attributes, or a safetensors __metadata__), or from a Hugging Face directory's
// config.json. A flag given on the command line must agree with the file, each
// disagreement named with both values (checked before any rank starts training).
void apply_init_file(const std::string& file, Config& cfg, const cxxopts::ParseResult& r) {
  if (!std::filesystem::exists(file))
    throw UsageError("--init-from " + file + ": cannot open the file");
  if (std::filesystem::is_regular_file(std::filesystem::path(file) / "config.json")) {
    if (!current_program().read_hf_config) {
      throw UsageError("--init-from " + file +
                       " is a Hugging Face model directory (it holds config.json); " +
                       current_program().name +
                       " starts only from its own files (consolidated HDF5 or safetensors): "
                       "use train_llama for Llama models");
    }
    apply_hf_dir(file, cfg, r);
    return;
  }
  std::map<std::string, fsdp::ckpt::AttrValue> attrs;
  try {
    attrs = fsdp::ckpt::consolidated_attributes(file);
  } catch (const c10::Error& e) {
    throw UsageError("--init-from " + file + ": not a consolidated checkpoint (" +
                     e.what_without_backtrace() + ")");
  }
  for (const auto& [key, field] : architecture_fields(cfg)) {
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
  // The family: a Llama file names its arch; a GPT file names none.
  auto arch = attrs.find("arch");
  const std::string theirs =
      arch != attrs.end() && std::holds_alternative<std::string>(arch->second)
          ? std::get<std::string>(arch->second)
          : "gpt";
  if (theirs != cfg.arch) {
    throw UsageError("--init-from " + file + " holds a " + theirs + " model, and " +
                     current_program().name + " trains " + cfg.arch + " models; use train_" +
                     theirs + " for it");
  }
  if (cfg.arch != "llama") return;
  auto number = [&](const char* key) -> const fsdp::ckpt::AttrValue& {
    auto it = attrs.find(key);
    if (it == attrs.end())
      throw UsageError("--init-from " + file + " has no attribute " + key +
                       " (a Llama file records it)");
    return it->second;
  };
  for (const auto& [key, field] : llama_int_fields(cfg)) {
    if (!std::holds_alternative<int64_t>(number(key)))
      throw UsageError("--init-from " + file + ": attribute " + key + " is not an integer");
    *field = std::get<int64_t>(number(key));
  }
  for (const auto& [key, field] : llama_real_fields(cfg)) {
    const auto& v = number(key);
    *field =
        std::holds_alternative<double>(v) ? std::get<double>(v)
        : std::holds_alternative<int64_t>(v)
            ? static_cast<double>(std::get<int64_t>(v))
            : throw UsageError("--init-from " + file + ": attribute " + key + " is not a number");
  }
  const auto& tie = number("tie_embeddings");
  cfg.tie_embeddings = std::holds_alternative<int64_t>(tie) && std::get<int64_t>(tie) != 0;
}

Config read_model(const cxxopts::ParseResult& r) {
  Config cfg;
  cfg.arch = current_program().arch;
  cfg.n_layer = r["n-layer"].as<int64_t>();
  cfg.n_head = r["n-head"].as<int64_t>();
  cfg.d_model = r["d-model"].as<int64_t>();
  cfg.block_size = r["block-size"].as<int64_t>();
  if (llama_arch()) {
    cfg.dropout = 0;
    cfg.n_kv_head = r["n-kv-head"].as<int64_t>();
    cfg.intermediate_size = r["intermediate-size"].as<int64_t>();
    if (cfg.intermediate_size == 0) cfg.intermediate_size = (8 * cfg.d_model / 3 + 15) / 16 * 16;
    cfg.rope_theta = r["rope-theta"].as<double>();
    cfg.rms_norm_eps = r["rms-norm-eps"].as<double>();
    cfg.tie_embeddings = r.count("tie-embeddings") > 0;
  } else {
    cfg.dropout = r["dropout"].as<double>();
  }
  cfg.attention = examples::parse_attention_flag(r["attention"].as<std::string>());
  const std::string init_from = r["init-from"].as<std::string>();
  if (!init_from.empty()) apply_init_file(init_from, cfg, r);
  return cfg;
}

TrainingFlags read_training(const cxxopts::ParseResult& r) {
  TrainingFlags t;
  t.batch_size = r["batch-size"].as<int64_t>();
  t.grad_accum = r["grad-accum"].as<int64_t>();
  t.steps = r["steps"].as<int64_t>();
  t.lr = r["lr"].as<double>();
  t.weight_decay = r["weight-decay"].as<double>();
  t.no_decay_recipe = r["no-decay-recipe"].as<std::string>();
  t.warmup_steps = r["warmup-steps"].as<int64_t>();
  t.lr_schedule = r["lr-schedule"].as<std::string>();
  t.warmup_min_lr = r["warmup-min-lr"].as<double>();
  t.warmup_type = r["warmup-type"].as<std::string>();
  t.eps = r["adam-eps"].as<double>();
  const std::string betas = r["adam-betas"].as<std::string>();
  std::istringstream in(betas);
  char comma = 0;
  if (!(in >> t.beta1 >> comma >> t.beta2) || comma != ',' || !in.eof() || t.beta1 < 0 ||
      t.beta1 >= 1 || t.beta2 < 0 || t.beta2 >= 1) {
    throw UsageError("--adam-betas " + betas + " must be two numbers in [0, 1), e.g. 0.9,0.95");
  }
  t.clip_grad = r["clip-grad"].as<double>();
  t.seed = r["seed"].as<uint64_t>();
  t.data = r["data"].as<std::string>();
  t.eval_text = r["eval-text"].as<std::string>();
  t.val_fraction = r["val-fraction"].as<double>();
  return t;
}

void check_model_and_training(const Config& cfg, const TrainingFlags& t) {
  auto positive = [](const char* flag, double v) {
    if (v > 0) return;
    // An integer flag prints as one ("--n-layer 0", not "0.000000").
    std::ostringstream text;
    if (v == std::floor(v) && std::abs(v) < 1e15)
      text << static_cast<int64_t>(v);
    else
      text << v;
    throw UsageError(std::string("--") + flag + " " + text.str() + " must be positive");
  };
  positive("n-layer", cfg.n_layer);
  positive("n-head", cfg.n_head);
  positive("d-model", cfg.d_model);
  positive("block-size", cfg.block_size);
  positive("batch-size", t.batch_size);
  positive("grad-accum", t.grad_accum);
  if (t.steps < 0) {
    throw UsageError("--steps " + std::to_string(t.steps) +
                     " must not be negative (0: load, evaluate and export without training)");
  }
  if (!(t.lr >= 0)) {
    std::ostringstream lr;
    lr << t.lr;
    throw UsageError("--lr " + lr.str() + " must not be negative");
  }
  if (cfg.d_model % cfg.n_head != 0) {
    throw UsageError("--d-model " + std::to_string(cfg.d_model) +
                     " must be divisible by --n-head " + std::to_string(cfg.n_head));
  }
  if (cfg.arch == "llama") {
    positive("n-kv-head", cfg.n_kv_head);
    positive("intermediate-size", cfg.intermediate_size);
    positive("rope-theta", cfg.rope_theta);
    positive("rms-norm-eps", cfg.rms_norm_eps);
    if (cfg.n_head % cfg.n_kv_head != 0) {
      throw UsageError("--n-kv-head " + std::to_string(cfg.n_kv_head) + " must divide --n-head " +
                       std::to_string(cfg.n_head) +
                       " (each key/value head serves n_head / n_kv_head query heads)");
    }
    if ((cfg.d_model / cfg.n_head) % 2 != 0) {
      throw UsageError("--d-model / --n-head = " + std::to_string(cfg.d_model / cfg.n_head) +
                       " must be even: rotary positions rotate pairs of a head's dimensions");
    }
    if (cfg.vocab_size < 256) {
      throw UsageError("vocab_size " + std::to_string(cfg.vocab_size) +
                       " is below 256: the training data are bytes (token ids 0-255)");
    }
  }
  if (cfg.dropout < 0 || cfg.dropout >= 1) throw UsageError("--dropout must be in [0, 1)");
  if (t.warmup_steps < 0) throw UsageError("--warmup-steps must not be negative");
  if (t.clip_grad < 0) throw UsageError("--clip-grad must not be negative (0 turns clipping off)");
  if (t.no_decay_recipe != "standard" && t.no_decay_recipe != "none") {
    throw UsageError("--no-decay-recipe " + t.no_decay_recipe +
                     " is unknown; use standard or none");
  }
  if (t.lr_schedule != "constant" && t.lr_schedule != "cosine" && t.lr_schedule != "warmup" &&
      t.lr_schedule != "warmup_decay") {
    throw UsageError("--lr-schedule " + t.lr_schedule +
                     " is unknown; use constant, cosine, warmup or warmup_decay");
  }
  if (t.warmup_type != "log" && t.warmup_type != "linear")
    throw UsageError("--warmup-type " + t.warmup_type + " is unknown; use log or linear");
  if ((t.lr_schedule == "warmup" || t.lr_schedule == "warmup_decay") && t.warmup_steps < 1) {
    throw UsageError("--lr-schedule " + t.lr_schedule +
                     " needs --warmup-steps of at least 1 (DeepSpeed's warmup_num_steps)");
  }
  if (!(t.eps > 0)) throw UsageError("--adam-eps must be positive");
  if (t.warmup_min_lr < 0) throw UsageError("--warmup-min-lr must not be negative");
}

void check_val_fraction(double val_fraction) {
  if (!(val_fraction >= 0 && val_fraction < 1)) {
    std::ostringstream v;
    v << val_fraction;
    throw UsageError("--val-fraction " + v.str() +
                     " must be at least 0 and below 1 (0: no validation)");
  }
}

}  // namespace

void check_loss_scaler(const fsdp::LossScalerOptions& ls) {
  if (ls.initial_scale_power < 0 || ls.initial_scale_power > 60) {
    throw UsageError("--loss-scale-power " + std::to_string(ls.initial_scale_power) +
                     " must be between 0 and 60 (the default is 16)");
  }
  if (ls.loss_scale < 0) throw UsageError("--loss-scale must not be negative (0: dynamic)");
  if (ls.loss_scale_window < 1) throw UsageError("--loss-scale-window must be at least 1");
  if (ls.hysteresis < 1) throw UsageError("--loss-scale-hysteresis must be at least 1");
  if (!(ls.min_loss_scale > 0)) throw UsageError("--min-loss-scale must be positive");
}

fsdp::OffloadDevice parse_offload_device(const std::string& flag, const std::string& v) {
  const auto option = flag == "offload-param" ? fsdp::core::Option::kOffloadParam
                                              : fsdp::core::Option::kOffloadOptimizer;
  return usage_checked(
      [&] { return fsdp::core::parse_offload(v, option, fsdp::core::Surface::kFlags); });
}

namespace {

// --master-dtype and --bf16-rounding, after the device and the offload flags: whether
// the shards step on the host decides which roundings can apply.
void read_pure_bf16(const cxxopts::ParseResult& r, ShardingFlags& s) {
  using Rounding = fsdp::FusedAdamW::Bf16Rounding;
  const auto master = r["master-dtype"].as<std::string>();
  const auto rounding = r["bf16-rounding"].as<std::string>();
  if (master == "bf16") s.options.mixed_precision.master_dtype = torch::kBFloat16;
  if (rounding != "auto" && rounding != "nearest" && rounding != "stochastic" &&
      rounding != "compensated") {
    throw UsageError("--bf16-rounding " + rounding +
                     " is unknown; use auto, nearest, stochastic or compensated");
  }
  if (rounding != "auto" && master != "bf16") {
    throw UsageError("--bf16-rounding " + rounding +
                     " applies only to --master-dtype bf16 (this run's shards are fp32)");
  }
  // FusedAdamW rounds in its host kernel; shards on a GPU step with ATen's, which rounds to
  // nearest.
  const bool host_step =
      s.options.device.is_cpu() || s.options.offload_optimizer.device != fsdp::OffloadDevice::kNone;
  if (!host_step && (rounding == "stochastic" || rounding == "compensated")) {
    throw UsageError("--bf16-rounding " + rounding +
                     " rounds in the optimizer's host kernel, "
                     "but the shards step on " +
                     s.options.device.str() +
                     " (ATen's fused kernel, which rounds to nearest); use --bf16-rounding "
                     "nearest (or auto), or --offload-optimizer cpu");
  }
  s.bf16_rounding = rounding == "nearest"                   ? Rounding::kNearest
                    : rounding == "compensated"             ? Rounding::kCompensated
                    : rounding == "stochastic" || host_step ? Rounding::kStochastic
                                                            : Rounding::kNearest;
}

// ZeRO++'s flags: hpZ and the quantized communication (fsdp::QuantizedCommunication).
void read_zero_plus_plus(const cxxopts::ParseResult& r, fsdp::ShardingOptions& o) {
  o.reshard_after_forward_group_size = r["hpz-group-size"].as<int>();
  fsdp::QuantizedCommunication& q = o.quantized_communication;
  q.weights = r.count("quantize-weights") > 0;
  q.gradients = r.count("quantize-gradients") > 0;
  q.weight_bits = r["quantize-weight-bits"].as<int>();
  q.gradient_bits = r["quantize-gradient-bits"].as<int>();
  q.block_size = r["quantize-block"].as<int64_t>();
  const bool tuned = r.count("quantize-weight-bits") + r.count("quantize-gradient-bits") +
                     r.count("quantize-block");
  if (tuned && !q.weights && !q.gradients)
    throw UsageError(
        "--quantize-weight-bits, --quantize-gradient-bits and --quantize-block tune "
        "--quantize-weights and --quantize-gradients, and neither is given; add one");
}

// The sharding options' rules, in the flags' words (Note [Options core]). The world's
// size is not known yet: the engine checks what needs it (--hybrid-group-size,
// --hpz-group-size's range) when it builds the model. --cpu-offload then means what it
// always did: both offloads on the host.
void check_options(const cxxopts::ParseResult& r, ShardingFlags& s) {
  namespace core = fsdp::core;
  const fsdp::ShardingOptions& o = s.options;
  core::Options c;
  c.world_size_known = false;
  c.strategy = o.strategy;
  c.hybrid_group_size = o.hybrid_group_size;
  c.hpz_group_size = o.reshard_after_forward_group_size;
  c.offload_optimizer = o.offload_optimizer.device;
  c.offload_param = o.offload_param.device;
  c.cpu_offload = r.count("cpu-offload") > 0;
  usage_checked([&] {
    c.param = c.reduce =
        core::parse_precision(s.precision, core::Option::kPrecision, core::Surface::kFlags);
    c.master = core::parse_precision(r["master-dtype"].as<std::string>(),
                                     core::Option::kMasterDtype, core::Surface::kFlags);
    c.max_gathered_units = o.max_gathered_units;
    c.activation_checkpointing = o.checkpoint_policy != nullptr;
    c.offload_activations = o.offload_activations;
    const fsdp::QuantizedCommunication& q = o.quantized_communication;
    c.quantize_weights = q.weights;
    c.quantize_gradients = q.gradients;
    c.weight_bits = q.weight_bits;
    c.gradient_bits = q.gradient_bits;
    c.quantize_block = q.block_size;
    core::validate(c, core::Surface::kFlags);
    return 0;
  });
  const core::Options resolved = core::resolved(c);
  s.options.offload_optimizer.device = resolved.offload_optimizer;
  s.options.offload_param.device = resolved.offload_param;
}

ShardingFlags read_sharding(const cxxopts::ParseResult& r) {
  ShardingFlags s;
  s.precision = r["precision"].as<std::string>();
  fsdp::LossScalerOptions& ls = s.loss_scaler;
  ls.initial_scale_power = r["loss-scale-power"].as<int>();
  ls.loss_scale = r["loss-scale"].as<double>();
  ls.loss_scale_window = r["loss-scale-window"].as<int>();
  ls.hysteresis = r["loss-scale-hysteresis"].as<int>();
  ls.min_loss_scale = r["min-loss-scale"].as<double>();
  for (const char* name : {"loss-scale-power", "loss-scale", "loss-scale-window",
                           "loss-scale-hysteresis", "min-loss-scale"}) {
    if (r.count(name) && s.precision != "fp16") {
      throw UsageError(std::string("--") + name +
                       " applies only to --precision fp16 (this run is " + s.precision + ")");
    }
  }
  check_loss_scaler(ls);
  s.options = sharding_options(s.precision, r["sharding"].as<std::string>(),
                               r["hybrid-group-size"].as<int>(), r["wrap"].as<std::string>(),
                               r["activation-checkpointing"].as<std::string>(),
                               current_program().block_policy);
  s.options.offload_activations = r.count("offload-activations") > 0;
  s.options.offload_optimizer.device =
      parse_offload_device("offload-optimizer", r["offload-optimizer"].as<std::string>());
  s.options.offload_param.device =
      parse_offload_device("offload-param", r["offload-param"].as<std::string>());
  s.options.offload_optimizer.nvme_path = s.options.offload_param.nvme_path =
      r["nvme-path"].as<std::string>();
  s.options.max_gathered_units = r["max-gathered-units"].as<int>();
  for (const auto& [name, field] :
       {std::pair<const char*, int64_t*>{"max-live-numel", &s.options.max_live_numel},
        {"prefetch-bucket-numel", &s.options.prefetch_bucket_numel},
        {"persistence-threshold-numel", &s.options.persistence_threshold_numel}}) {
    *field = r[name].as<int64_t>();
    if (*field < 0)
      throw UsageError("--" + std::string(name) + " " + std::to_string(*field) +
                       " must be 0 (off) or a positive number of parameter elements");
  }
  const auto construction = r["construction"].as<std::string>();
  if (construction != "sharded" && construction != "eager") {
    throw UsageError("--construction " + construction + " is unknown; use sharded or eager");
  }
  s.sharded_construction = construction == "sharded";
  s.device = r["device"].as<std::string>();
  s.wrap = r["wrap"].as<std::string>();
  const std::string backend = r["backend"].as<std::string>();
  usage_checked([&] {
    fsdp::core::check_backend(backend, "--backend", fsdp::core::Surface::kFlags);
    return 0;
  });
  s.options.device = examples::parse_device_flag(s.device, backend);
  s.backend = examples::parse_backend_flag(s.options.device, backend);
  s.options.prefetch = r.count("no-prefetch") == 0;
  read_zero_plus_plus(r, s.options);
  check_options(r, s);
  read_pure_bf16(r, s);
  s.options.trace = r["trace"].as<std::string>();
  return s;
}

CheckpointFlags read_checkpoint(const cxxopts::ParseResult& r) {
  CheckpointFlags c;
  c.save_dir = r["save-dir"].as<std::string>();
  c.save_every = r["save-every"].as<int64_t>();
  c.keep = r["keep"].as<int64_t>();
  c.async_save = r.count("async-save") > 0;
  c.stop_at = r["stop-at"].as<int64_t>();
  c.resume = r.count("resume") > 0;
  c.init_from = r["init-from"].as<std::string>();
  c.consolidate_to = r["consolidate-to"].as<std::string>();
  if (current_program().hf_config_json) {
    c.export_hf = r["export-hf"].as<std::string>();
    c.export_dtype = r["export-dtype"].as<std::string>();
    usage_checked([&] {
      return fsdp::core::parse_precision(c.export_dtype, "--export-dtype",
                                         fsdp::core::Surface::kFlags);
    });
  }
  return c;
}

}  // namespace

// What a pipelined run (fsdp::pipeline) does not do yet, refused by flag.
void check_pipeline_flags(const Flags& f) {
  if (f.pipeline.stages <= 1) return;
  const auto refuse = [&](bool given, const std::string& what) {
    if (given)
      throw UsageError("--pipeline-stages " + std::to_string(f.pipeline.stages) + " with " + what +
                       ": pipelined runs do not do that yet; leave it out, or use "
                       "--pipeline-stages 1");
  };
  if (!current_program().layers)
    throw UsageError("--pipeline-stages " + std::to_string(f.pipeline.stages) + ": " + program() +
                     " cannot split its model into stages yet (train_gpt and train_llama can); use "
                     "--pipeline-stages 1");
  if (f.training.grad_accum != 1)
    throw UsageError("--grad-accum " + std::to_string(f.training.grad_accum) +
                     " with --pipeline-stages " + std::to_string(f.pipeline.stages) +
                     ": a pipeline's micro-batches are its gradient accumulation; give "
                     "--micro-batches " +
                     std::to_string(f.training.grad_accum) + " instead");
  refuse(f.model.tie_embeddings,
         "--tie-embeddings (the embedding would be the first stage's and lm_head the last's)");
}

namespace {

PipelineFlags read_pipeline(const cxxopts::ParseResult& r) {
  PipelineFlags p;
  p.stages = r["pipeline-stages"].as<int>();
  usage_checked([&] {
    fsdp::core::check_pipeline_stages(p.stages, 0, "--pipeline-stages",
                                      fsdp::core::Surface::kFlags);
    return 0;
  });
  try {
    p.schedule = fsdp::parse_pipeline_schedule(r["pipeline-schedule"].as<std::string>(),
                                               "--pipeline-schedule");
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  p.micro_batches = r["micro-batches"].as<int>();
  usage_checked([&] {
    fsdp::core::check_micro_batches(p.micro_batches, "--micro-batches",
                                    fsdp::core::Surface::kFlags);
    return 0;
  });
  if (p.micro_batches == 0) p.micro_batches = 2 * p.stages;
  p.partition = r["partition"].as<std::string>();
  return p;
}

OutputFlags read_output(const cxxopts::ParseResult& r, int64_t steps) {
  OutputFlags o;
  o.log_jsonl = r["log-jsonl"].as<std::string>();
  const int64_t log_every = r["log-every"].as<int64_t>();
  o.log_every = log_every > 0 ? log_every : std::max<int64_t>(1, steps / 20);
  o.io_log = r["io-log"].as<std::string>();
  return o;
}

}  // namespace

const std::string& program() { return current_program().name; }
const Program& program_info() { return current_program(); }

std::optional<Flags> parse_flags(const Program& program, int argc, char** argv) {
  current_program() = program;
  const auto args = command_line(argc, argv);
  if (!args) return std::nullopt;
  std::vector<char*> cargs;
  for (const auto& a : *args) cargs.push_back(const_cast<char*>(a.data()));
  auto options = make_options();
  const auto r = options.parse(static_cast<int>(cargs.size()), cargs.data());
  if (!r.unmatched().empty())
    throw UsageError("unexpected argument '" + r.unmatched()[0] + "'; see --help");

  Flags f;
  for (const auto& kv : r.arguments()) f.given.insert(kv.key());
  f.deepspeed_config = r["deepspeed-config"].as<std::string>();
  f.model = read_model(r);
  f.training = read_training(r);
  check_model_and_training(f.model, f.training);
  f.sharding = read_sharding(r);
  check_val_fraction(f.training.val_fraction);
  f.checkpoint = read_checkpoint(r);
  f.output = read_output(r, f.training.steps);
  f.pipeline = read_pipeline(r);
  check_pipeline_flags(f);  // run() checks again once a DeepSpeed config may set stages
  return f;
}

void check_batch_for_world(const TrainingFlags& t, int world, const PipelineFlags& p) {
  if (p.stages > 1) {
    usage_checked([&] {
      fsdp::core::check_pipeline_stages(p.stages, world, "--pipeline-stages",
                                        fsdp::core::Surface::kFlags);
      return 0;
    });
    const int64_t dp = world / p.stages, unit = dp * p.micro_batches;
    if (t.batch_size % unit != 0)
      throw UsageError("--batch-size " + std::to_string(t.batch_size) + " must be divisible by " +
                       std::to_string(dp) + " data-parallel ranks x --micro-batches " +
                       std::to_string(p.micro_batches) + "; try --batch-size " +
                       std::to_string((t.batch_size / unit + 1) * unit));
    return;
  }
  const int64_t batch = t.batch_size, accum = t.grad_accum;
  if (batch % (world * accum) != 0) {
    throw UsageError("--batch-size " + std::to_string(batch) + " must be divisible by world size " +
                     std::to_string(world) + " x --grad-accum " + std::to_string(accum) +
                     "; try --batch-size " +
                     std::to_string((batch / (world * accum) + 1) * world * accum));
  }
}

void check_checkpoint_flags(const CheckpointFlags& c, int64_t steps) {
  if (c.save_every < 0)
    throw UsageError("--save-every " + std::to_string(c.save_every) + " must not be negative");
  if (c.stop_at < 0 || c.stop_at > steps) {
    throw UsageError("--stop-at " + std::to_string(c.stop_at) + " must be between 1 and --steps " +
                     std::to_string(steps) + " (0: run all steps)");
  }
  if (c.keep < 0)
    throw UsageError("--keep " + std::to_string(c.keep) + " must not be negative (0 keeps all)");
  if ((c.resume || c.save_every > 0 || c.async_save) && c.save_dir.empty()) {
    throw UsageError(std::string(c.resume           ? "--resume"
                                 : c.save_every > 0 ? "--save-every"
                                                    : "--async-save") +
                     " needs --save-dir DIR");
  }
  // Output locations are checked now, not after hours of training.
  if (!c.save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(c.save_dir, ec);
    if (ec || !std::filesystem::is_directory(c.save_dir)) {
      throw UsageError("--save-dir " + c.save_dir + ": cannot create the directory (" +
                       ec.message() + ")");
    }
  }
  if (!c.export_hf.empty()) {
    const auto parent = std::filesystem::absolute(c.export_hf).parent_path();
    if (!std::filesystem::is_directory(parent)) {
      throw UsageError("--export-hf " + c.export_hf + ": the directory " + parent.string() +
                       " does not exist");
    }
  }
  if (!c.consolidate_to.empty()) {
    const auto parent = std::filesystem::absolute(c.consolidate_to).parent_path();
    if (!std::filesystem::is_directory(parent)) {
      throw UsageError("--consolidate-to " + c.consolidate_to + ": the directory " +
                       parent.string() + " does not exist");
    }
  }
}

}  // namespace lm
