// fsdp-estimate: per-rank memory of a sharded training run, term by term, on the device
// and on the host, before running it (DeepSpeed users know this as
// estimate_zero3_model_states_mem_needs). The arithmetic is fsdp::estimate_memory
// (include/fsdp/estimate.h); this file only reads flags and prints.
//
//   fsdp-estimate (--n-layer L --n-head H --d-model D --block-size S [--vocab-size V]
//                  | --params N [--units K])
//                 [--world-size W] [--strategy full|grad_op|none|hybrid] [--hybrid-group-size G]
//                 [--precision fp32|bf16|fp16] [--cpu-offload] [--activation-checkpointing]
//                 [--micro-batch B] [--max-gathered-units K] [--json]
#include <fsdp/estimate.h>
#include <fsdp/version.h>

#include "gpt_units.h"
#include "tool_main.h"

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <stdexcept>

namespace {

// Bad input: exit status 2 with this message (tool_main).
[[noreturn]] void bad_input(const std::string& msg) { throw fsdp::tools::UsageError(msg); }

std::string human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

// A parameter count: exact below a million, in millions above.
std::string millions(int64_t n) {
  if (n < 1000000) return std::to_string(n);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1fM", static_cast<double>(n) / 1e6);
  return buf;
}

const char* kNotes = R"(
Model: one unit per GPT block plus a root unit (wte, wpe, ln_f, lm_head), as train_gpt
--wrap block; with --params, an empty root and --units equal units. Per rank, each unit
is padded to a multiple of the shard group and split: fp32 master shard (4 B/element),
fp32 gradient shard (4 B) and AdamW's exp_avg and exp_avg_sq (8 B), on the host with
--cpu-offload. Gathered units are in the --precision dtype: the root plus at most
--max-gathered-units others under full and hybrid, every unit under grad_op and none,
and none at all for a shard group of one in fp32 without offload. Parameters, gradients
and optimizer state equal the engine's counters ("exact"); gathered units and buffers
are upper bounds ("bound"); activations are a formula (Korthikanti et al. 2022), not
measured ("rough"). The construction peaks come before gradients and optimizer state
exist: eager (the model built in full on every rank, then fully_shard) holds every
parameter in fp32 on the host; sharded (fsdp::make_sharded, train_gpt's default) the
shards, plus the root unit and the largest other unit on the host. Exit status: 0, or 2 for bad input.
)";

cxxopts::Options make_options() {
  cxxopts::Options o("fsdp-estimate",
                     "Per-rank memory of fully sharded training, by term, on device and host.");
  o.add_options("Model (a GPT shape, or --params)")(
      "n-layer", "GPT blocks", cxxopts::value<int64_t>())("n-head", "GPT attention heads",
                                                          cxxopts::value<int64_t>())(
      "d-model", "GPT width", cxxopts::value<int64_t>())("block-size", "GPT context length",
                                                         cxxopts::value<int64_t>())(
      "vocab-size", "GPT vocabulary", cxxopts::value<int64_t>()->default_value("256"))(
      "params", "a parameter count instead of a GPT shape (e.g. 1.3e9)",
      cxxopts::value<std::string>())("units", "with --params: equal units it is wrapped into",
                                     cxxopts::value<int64_t>()->default_value("1"));
  o.add_options("Run")("world-size", "ranks", cxxopts::value<int>()->default_value("1"))(
      "strategy", "full|grad_op|none|hybrid", cxxopts::value<std::string>()->default_value("full"))(
      "hybrid-group-size", "ranks per shard group for hybrid (0: the world)",
      cxxopts::value<int>()->default_value("0"))(
      "reshard-after-forward-group-size",
      "hpZ: after forward each unit keeps 1/K of its parameters, and backward gathers within K "
      "ranks (ShardingOptions::reshard_after_forward_group_size; 0: off)",
      cxxopts::value<int>()->default_value("0"))(
      "precision", "fp32|bf16|fp16: gathered parameters and reduced gradients",
      cxxopts::value<std::string>()->default_value("fp32"))(
      "cpu-offload",
      "fp32 shards, gradients and optimizer state in host memory (ShardingOptions::cpu_offload)")(
      "activation-checkpointing", "recompute every block in backward")(
      "micro-batch", "sequences per rank per micro-batch, for activations (GPT only)",
      cxxopts::value<int64_t>()->default_value("1"))("max-gathered-units",
                                                     "ShardingOptions::max_gathered_units",
                                                     cxxopts::value<int>()->default_value("2"));
  o.add_options("Output")("json", "print JSON instead of a table")("h,help", "show this help")(
      "version", "print the version");
  return o;
}

// The names --strategy and --precision take, and what they mean.
struct StrategyName {
  const char* name;
  fsdp::ShardingStrategy strategy;
};
constexpr StrategyName kStrategies[] = {{"full", fsdp::ShardingStrategy::kFullShard},
                                        {"grad_op", fsdp::ShardingStrategy::kShardGradOp},
                                        {"none", fsdp::ShardingStrategy::kNoShard},
                                        {"hybrid", fsdp::ShardingStrategy::kHybridShard}};
constexpr fsdp::Precision kPrecisions[] = {fsdp::Precision::kFp32, fsdp::Precision::kBf16,
                                           fsdp::Precision::kFp16};

fsdp::ShardingStrategy parse_strategy(const std::string& text) {
  for (const auto& s : kStrategies) {
    if (text == s.name) return s.strategy;
  }
  bad_input("--strategy '" + text + "' is unknown; use full, grad_op, none or hybrid");
}

const char* strategy_name(fsdp::ShardingStrategy strategy) {
  for (const auto& s : kStrategies) {
    if (s.strategy == strategy) return s.name;
  }
  return "unknown";
}

fsdp::Precision parse_precision(const std::string& text) {
  for (fsdp::Precision p : kPrecisions) {
    if (text == fsdp::to_string(p)) return p;
  }
  bad_input("--precision '" + text + "' is unknown; use fp32, bf16 or fp16");
}

// --params: a count such as 1300000000 or 1.3e9, read here rather than by cxxopts so that
// the error names the flag.
int64_t parse_count(const std::string& text) {
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    bad_input("--params '" + text + "' is not a number; give a count such as 1.3e9");
  if (!(v >= 1) || v > 1e15)
    bad_input("--params " + text + " is invalid; give a positive count such as 1.3e9");
  return static_cast<int64_t>(std::llround(v));
}

// Reads the GPT shape, or the parameter count, into `in`.
void read_model(const cxxopts::ParseResult& r, fsdp::EstimateInput& in) {
  const char* shape[] = {"n-layer", "n-head", "d-model", "block-size"};
  bool gpt = false;
  for (const char* f : shape) gpt = gpt || r.count(f) > 0;
  if (gpt && r.count("params")) bad_input("give either a GPT shape or --params, not both");
  if (gpt) {
    for (const char* f : shape) {
      if (!r.count(f))
        bad_input(std::string("--") + f +
                  " is missing; a GPT shape needs --n-layer, --n-head, --d-model and --block-size");
    }
    if (r.count("units"))
      bad_input("--units applies to --params only; a GPT shape has one unit per block");
    fsdp::TransformerShape& m = in.activations;
    m.n_layer = r["n-layer"].as<int64_t>();
    m.n_head = r["n-head"].as<int64_t>();
    m.d_model = r["d-model"].as<int64_t>();
    m.block_size = r["block-size"].as<int64_t>();
    m.vocab_size = r["vocab-size"].as<int64_t>();
    m.micro_batch = r["micro-batch"].as<int64_t>();
    if (m.n_layer <= 0)
      bad_input("--n-layer " + std::to_string(m.n_layer) + " is invalid; it must be positive");
    if (m.micro_batch <= 0)
      bad_input("--micro-batch " + std::to_string(m.micro_batch) +
                " is invalid; it must be positive");
    // Shape errors (d_model % n_head, ...) are estimate_memory's, in the same words.
    in.unit_params = fsdp::tools::gpt_unit_params(m.n_layer, std::max<int64_t>(m.d_model, 0),
                                                  std::max<int64_t>(m.block_size, 0),
                                                  std::max<int64_t>(m.vocab_size, 0));
    return;
  }
  if (!r.count("params"))
    bad_input(
        "no model given; give a GPT shape (--n-layer --n-head --d-model --block-size) or --params "
        "N");
  const int64_t params = parse_count(r["params"].as<std::string>());
  const int64_t units = r["units"].as<int64_t>();
  if (units <= 0)
    bad_input("--units " + std::to_string(units) + " is invalid; it must be positive");
  // An empty root and `units` units as equal as integers allow: the largest is what
  // bounds the gathered memory.
  in.unit_params = {0};
  for (int64_t i = 0; i < units; ++i)
    in.unit_params.push_back(params / units + (i < params % units ? 1 : 0));
}

fsdp::EstimateInput read_input(const cxxopts::ParseResult& r) {
  if (!r.unmatched().empty())
    bad_input("unexpected argument '" + r.unmatched()[0] + "'; see --help");
  fsdp::EstimateInput in;
  read_model(r, in);
  in.world_size = r["world-size"].as<int>();
  in.strategy = parse_strategy(r["strategy"].as<std::string>());
  in.hybrid_group_size = r["hybrid-group-size"].as<int>();
  in.reshard_after_forward_group_size = r["reshard-after-forward-group-size"].as<int>();
  if (r.count("hybrid-group-size") && in.strategy != fsdp::ShardingStrategy::kHybridShard) {
    bad_input("--hybrid-group-size applies to --strategy hybrid only");
  }
  in.precision = parse_precision(r["precision"].as<std::string>());
  in.cpu_offload = r.count("cpu-offload") > 0;
  in.activation_checkpointing = r.count("activation-checkpointing") > 0;
  in.max_gathered_units = r["max-gathered-units"].as<int>();
  return in;
}

void print_json(const fsdp::EstimateInput& in, const fsdp::MemoryEstimate& est) {
  nlohmann::json j = {{"params", est.total_params},
                      {"largest_unit_params", est.largest_unit_params},
                      {"units", in.unit_params},
                      {"world_size", in.world_size},
                      {"strategy", strategy_name(in.strategy)},
                      {"shard_group_size", est.shard_group_size},
                      {"precision", fsdp::to_string(in.precision)},
                      {"cpu_offload", in.cpu_offload},
                      {"activation_checkpointing", in.activation_checkpointing},
                      {"max_gathered_units", in.max_gathered_units},
                      {"reshard_after_forward_group_size", in.reshard_after_forward_group_size},
                      {"micro_batch", in.activations.micro_batch},
                      {"device_total_bytes", est.device_total()},
                      {"host_total_bytes", est.host_total()},
                      {"model_states_device_bytes", est.model_states_device()},
                      {"model_states_host_bytes", est.model_states_host()},
                      {"terms", nlohmann::json::array()}};
  for (const auto* list : {&est.terms, &est.construction}) {
    auto& out = j[list == &est.terms ? "terms" : "construction"];
    out = nlohmann::json::array();
    for (const auto& t : *list) {
      out.push_back({{"key", t.key},
                     {"label", t.label},
                     {"basis", t.basis},
                     {"device_bytes", t.device_bytes},
                     {"host_bytes", t.host_bytes}});
    }
  }
  std::cout << j.dump(2) << std::endl;
}

void print_table(const fsdp::EstimateInput& in, const fsdp::MemoryEstimate& est) {
  const size_t units = in.unit_params.size();
  const fsdp::TransformerShape& m = in.activations;
  const std::string model =
      m.n_layer > 0
          ? "GPT " + std::to_string(m.n_layer) + " x " + std::to_string(m.d_model) + ": " +
                std::to_string(units - 1) + " blocks + root; micro-batch " +
                std::to_string(m.micro_batch) + " x " + std::to_string(m.block_size) + " tokens"
          : std::to_string(units - 1) + " equal units + empty root";
  const char* strategy = strategy_name(in.strategy);
  const char* precision = fsdp::to_string(in.precision);
  std::printf(
      "Per-rank memory: %s parameters (%s), world size %d, strategy %s (shard group %d), %s%s%s\n",
      millions(est.total_params).c_str(), model.c_str(), in.world_size, strategy,
      est.shard_group_size, precision, in.cpu_offload ? ", CPU offload" : "",
      in.activation_checkpointing ? ", activation checkpointing" : "");
  std::printf("  %-34s %-6s %14s %14s\n", "term", "basis", "device", "host");
  for (const auto& t : est.terms) {
    std::printf("  %-34s %-6s %14s %14s\n", t.label.c_str(), t.basis.c_str(),
                human(t.device_bytes).c_str(), human(t.host_bytes).c_str());
  }
  std::printf("  %-34s %-6s %14s %14s\n", "total", "", human(est.device_total()).c_str(),
              human(est.host_total()).c_str());
  std::printf("Peak while the model is built (before gradients and optimizer state):\n");
  for (const auto& t : est.construction) {
    std::printf("  %-34s %-6s %14s %14s\n", t.label.c_str(), t.basis.c_str(),
                human(t.device_bytes).c_str(), human(t.host_bytes).c_str());
  }
  // DeepSpeed's layout (estimate_zero3_model_states_mem_needs), with this engine's
  // model states: 16 B per sharded element plus the gathered units. Host is per rank.
  std::printf("\nEstimated memory needed for params, optim states and gradients for a:\n");
  std::printf("HW: Setup with %d ranks.\n", in.world_size);
  std::printf("SW: Model with %s total params, %s largest unit params.\n",
              millions(est.total_params).c_str(), millions(est.largest_unit_params).c_str());
  std::printf("  per CPU (rank) |    per GPU |   Options\n");
  std::printf("  %14s | %10s | offload_optimizer=%s, strategy=%s, precision=%s\n",
              human(est.model_states_host()).c_str(), human(est.model_states_device()).c_str(),
              in.cpu_offload ? "cpu" : "none", strategy, precision);
}

int run(int argc, char** argv) {
  auto options = make_options();
  const auto r = options.parse(argc, argv);
  if (r.count("help")) {
    std::cout << options.help() << kNotes;
    return 0;
  }
  if (r.count("version")) {
    std::cout << fsdp::version_line("fsdp-estimate") << std::endl;
    return 0;
  }
  const auto in = read_input(r);
  fsdp::MemoryEstimate est;
  try {
    est = fsdp::estimate_memory(in);
  } catch (const std::invalid_argument& e) {  // it names the flag's value and the fix
    bad_input(e.what());
  }
  if (r.count("json")) {
    print_json(in, est);
  } else {
    print_table(in, est);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-estimate", [&] { return run(argc, argv); });
}
