// fsdp-estimate: per-rank memory of a sharded training run, term by term, on the device
// and on the host, before running it (DeepSpeed users know this as
// estimate_zero3_model_states_mem_needs). The arithmetic is fsdp::estimate_memory
// (include/fsdp/estimate.h); this file only reads flags and prints.
//
//   fsdp-estimate (--n-layer L --n-head H --d-model D --block-size S [--vocab-size V]
//                  | --params N [--units K] | --unit-sizes N0,N1,... | --unit-sizes-file F)
//                 [--world-size W | --nodes M] [--gpus-per-node G]
//                 [--sharding full|grad_op|none|hybrid|zero1|zero2|zero3] [--hybrid-group-size G]
//                 [--precision fp32|bf16|fp16] [--offload-optimizer none|cpu|nvme]
//                 [--offload-param none|cpu|nvme] [--cpu-offload] [--activation-checkpointing
//                 none|all]
//                 [--master-dtype fp32|bf16] [--hpz-group-size K] [--micro-batch B]
//                 [--max-gathered-units K] [--deepspeed-table] [--json]
// Its flags are train_gpt's; --strategy, --pure-bf16 and --reshard-after-forward-group-size
// are the deprecated names of --sharding, --master-dtype bf16 and --hpz-group-size.
#include <fsdp/core/options.h>
#include <fsdp/tools/estimate.h>
#include <fsdp/version.h>

#include "gpt_units.h"
#include "tool_main.h"

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <vector>

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
--wrap block; with --params, an empty root and --units equal units; with --unit-sizes
(or --unit-sizes-file, one count a line, '#' comments), the units as given, root first.
Per rank, each unit is padded to a multiple of the shard group and split: fp32 master
shard (4 B/element), fp32 gradient shard (4 B) and AdamW's exp_avg and exp_avg_sq (8 B).
--offload-optimizer cpu moves all three to the host and keeps a --precision copy of the
shard on the device; nvme puts the AdamW state in files. --offload-param (zero3 and
hybrid only, with --offload-optimizer) drops that device copy; nvme puts the fp32 masters
in files. --cpu-offload is both to cpu. Gathered units are in the --precision dtype: the
root plus at most --max-gathered-units others under zero3/full and hybrid, every unit
under grad_op and none, every unit between steps under zero2 and zero1 (zero1 also holds
all full gradients at the end of backward), and none at all for a shard group of one in fp32 without offload.
Figures are per rank; per node is --gpus-per-node ranks (default: all on one node).
--deepspeed-table prints DeepSpeed's estimate_zero3 (or zero2) model-state table, its own
figures (with its 1.5x host factor) beside this engine's. Parameters, gradients
and optimizer state equal the engine's counters ("exact"); gathered units and buffers
are upper bounds ("bound"); activations are a formula (Korthikanti et al. 2022), not
measured ("rough"). The construction peaks come before gradients and optimizer state
exist: eager (the model built in full on every rank, then fully_shard) holds every
parameter in fp32 on the host; sharded (fsdp::make_sharded, train_gpt's default) the
shards, plus the root unit and the largest other unit on the host.
--pipeline-stages S estimates each stage: its layers (split by --partition, as
fsdp::pipeline splits them), sharded over world/S ranks, with the activations of the
micro-batches it holds at once (1F1B: S - stage; gpipe: all --micro-batches) and, unless
--reduce-every-micro-batch, its layers' full parameters and gradients, which it keeps
from its first backward of a step to its last. Exit status: 0, or 2 for bad input.
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
                                     cxxopts::value<int64_t>()->default_value("1"))(
      "unit-sizes", "parameters per unit, root first (e.g. 0,1000,2000)",
      cxxopts::value<std::string>())("unit-sizes-file", "a file of parameters per unit, one a line",
                                     cxxopts::value<std::string>());
  o.add_options("Run")("world-size", "ranks", cxxopts::value<int>()->default_value("1"))(
      "nodes", "nodes (world size = nodes x --gpus-per-node)", cxxopts::value<int>())(
      "gpus-per-node", "ranks per node, for the per-node figures (0: all on one node)",
      cxxopts::value<int>()->default_value("0"))(
      "sharding", "full|grad_op|none|hybrid|zero1|zero2|zero3 (zero3 = full), as train_gpt's",
      cxxopts::value<std::string>()->default_value(fsdp::core::strategy_name(
          fsdp::ShardingStrategy::kFullShard, fsdp::core::Surface::kFlags)))(
      "hybrid-group-size", "ranks per shard group for hybrid (0: the world)",
      cxxopts::value<int>()->default_value("0"))(
      "quantize-weights",
      "ZeRO++ qwZ: gathers travel quantized (ShardingOptions::"
      "quantized_communication.weights)")("quantize-gradients",
                                          "ZeRO++ qgZ: reductions travel quantized")(
      "quantize-weight-bits", "8 or 4", cxxopts::value<int>()->default_value("8"))(
      "quantize-gradient-bits", "8 or 4", cxxopts::value<int>()->default_value("8"))(
      "quantize-block", "elements per quantization scale",
      cxxopts::value<int64_t>()->default_value("2048"))(
      "hpz-group-size",
      "ZeRO++ hpZ: after forward each unit keeps 1/K of its parameters, and backward gathers "
      "within K ranks (ShardingOptions::reshard_after_forward_group_size; 0: off)",
      cxxopts::value<int>()->default_value("0"))(
      "precision", "fp32|bf16|fp16: gathered parameters and reduced gradients",
      cxxopts::value<std::string>()->default_value(fsdp::to_string(fsdp::Precision::kFp32)))(
      "offload-optimizer",
      "none|cpu|nvme: fp32 shards, gradients and AdamW state off the device "
      "(ShardingOptions::offload_optimizer)",
      cxxopts::value<std::string>()->default_value("none"))(
      "offload-param",
      "none|cpu|nvme: no parameter shard on the device (ShardingOptions::offload_param)",
      cxxopts::value<std::string>()->default_value("none"))(
      "nvme-buffer-bytes",
      "host bytes per NVMe offload for chunks in flight (OffloadConfig::buffer_bytes)",
      cxxopts::value<int64_t>()->default_value("67108864"))(
      "cpu-offload",
      "fp32 shards, gradients and optimizer state in host memory (the same as "
      "--offload-optimizer cpu --offload-param cpu)")(
      "activation-checkpointing", "none|all (all: every block recomputed in backward)",
      cxxopts::value<std::string>()->default_value("none"))(
      "offload-activations",
      "the checkpointed blocks' inputs in host memory (ShardingOptions::offload_activations)")(
      "master-dtype",
      "fp32|bf16: the shards, their gradients and the optimizer state (bf16 is pure bf16: "
      "MixedPrecision::master_dtype, with --precision bf16)",
      cxxopts::value<std::string>()->default_value(fsdp::to_string(fsdp::Precision::kFp32)))(
      "micro-batch", "sequences per rank per micro-batch, for activations (GPT only)",
      cxxopts::value<int64_t>()->default_value("1"))("max-gathered-units",
                                                     "ShardingOptions::max_gathered_units",
                                                     cxxopts::value<int>()->default_value("2"));
  o.add_options("Pipeline (train_gpt --pipeline-stages)")(
      "pipeline-stages",
      "stages over the ranks (divides --world-size; each stage sharded over world/stages "
      "ranks): one estimate per stage, of the model's layers (a GPT's: embeddings, blocks, "
      "head; else the units as given)",
      cxxopts::value<int>()->default_value("1"))(
      "micro-batches",
      "micro-batches per step (0: 2 x --pipeline-stages); --micro-batch is "
      "the sequences in each",
      cxxopts::value<int>()->default_value("0"))(
      "pipeline-schedule", "1f1b|gpipe", cxxopts::value<std::string>()->default_value("1f1b"))(
      "partition", "parameters|uniform|B1,B2,... (the first layer of stages 1..)",
      cxxopts::value<std::string>()->default_value("parameters"))(
      "reduce-every-micro-batch",
      "each micro-batch's backward reduces (PipelineOptions::reduce_once = false)");
  // The names before fsdp-estimate took train_gpt's (CHANGELOG.md); they go in the next
  // release.
  o.add_options("Deprecated (train_gpt's names above replace them)")(
      "strategy", "deprecated: --sharding", cxxopts::value<std::string>())(
      "reshard-after-forward-group-size", "deprecated: --hpz-group-size", cxxopts::value<int>())(
      "pure-bf16", "deprecated: --master-dtype bf16");
  o.add_options("Output")("json", "print JSON instead of a table")(
      "deepspeed-table",
      "DeepSpeed's model-state table (offload_param x offload_optimizer x zero_init) with this "
      "engine's figures beside")("h,help", "show this help")("version", "print the version");
  return o;
}

// A value the options core reads (Note [Options core]), its error a UsageError.
template <class Fn>
auto flag_checked(Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    bad_input(e.what());
  }
}

// --pure-bf16 (deprecated): --master-dtype bf16.
fsdp::Precision renamed_switch(const cxxopts::ParseResult& r, fsdp::Precision master) {
  std::cerr << "fsdp-estimate: --pure-bf16 is deprecated and goes in the next release; use "
               "--master-dtype bf16\n";
  if (r.count("master-dtype") > 0 && master != fsdp::Precision::kBf16)
    bad_input("--pure-bf16 (deprecated) and --master-dtype " + r["master-dtype"].as<std::string>() +
              " disagree; give --master-dtype alone");
  return fsdp::Precision::kBf16;
}

const char* strategy_name(fsdp::ShardingStrategy strategy) {
  return fsdp::core::strategy_name(strategy, fsdp::core::Surface::kFlags);
}

// A flag renamed to train_gpt's name: the old one still works, with a warning, and the
// two may not disagree.
template <class T>
T renamed(const cxxopts::ParseResult& r, const char* now, const char* before) {
  if (r.count(before) == 0) return r[now].as<T>();
  std::cerr << "fsdp-estimate: --" << before
            << " is deprecated and goes in the next release; use --" << now << "\n";
  const T old = r[before].as<T>();
  if (r.count(now) > 0 && !(r[now].as<T>() == old))
    bad_input(std::string("--") + before + " (deprecated) and --" + now + " disagree; give --" +
              now + " alone");
  return old;
}

// --unit-sizes / --unit-sizes-file: whole non-negative counts, root first.
std::vector<int64_t> parse_unit_sizes(const std::string& flag, const std::string& text, char sep) {
  std::vector<int64_t> units;
  std::stringstream in(text);
  std::string item;
  int line = 0;
  while (std::getline(in, item, sep)) {
    ++line;
    if (sep == '\n') {
      item = item.substr(0, item.find('#'));
    }
    const auto b = item.find_first_not_of(" \t\r"), e = item.find_last_not_of(" \t\r");
    if (b == std::string::npos) {
      if (sep == '\n') continue;  // blank lines and comments
      bad_input(flag + " has an empty entry; give counts separated by commas, e.g. 0,1000,2000");
    }
    item = item.substr(b, e - b + 1);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 0) {
      bad_input(flag + " entry '" + item + "'" +
                (sep == '\n' ? " (line " + std::to_string(line) + ")" : std::string()) +
                " is not a count; give whole non-negative parameter counts, root unit first");
    }
    units.push_back(v);
  }
  if (units.empty()) bad_input(flag + " gives no unit; give at least one count");
  return units;
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
  const int sources = (gpt ? 1 : 0) + static_cast<int>(r.count("params")) +
                      static_cast<int>(r.count("unit-sizes")) +
                      static_cast<int>(r.count("unit-sizes-file"));
  if (sources > 1) {
    bad_input(gpt && r.count("params")
                  ? "give either a GPT shape or --params, not both"
                  : "give one model: a GPT shape, --params, --unit-sizes or --unit-sizes-file");
  }
  if (r.count("unit-sizes") || r.count("unit-sizes-file")) {
    if (r.count("units")) bad_input("--units applies to --params only");
    if (r.count("unit-sizes")) {
      in.unit_params = parse_unit_sizes("--unit-sizes", r["unit-sizes"].as<std::string>(), ',');
    } else {
      const std::string path = r["unit-sizes-file"].as<std::string>();
      std::ifstream f(path);
      if (!f) bad_input("--unit-sizes-file '" + path + "' cannot be read; give an existing file");
      std::stringstream text;
      text << f.rdbuf();
      in.unit_params = parse_unit_sizes("--unit-sizes-file '" + path + "'", text.str(), '\n');
    }
    return;
  }
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
    flag_checked([&] {
      fsdp::core::check_positive(m.n_layer, "--n-layer", fsdp::core::Surface::kFlags);
      fsdp::core::check_positive(m.micro_batch, "--micro-batch", fsdp::core::Surface::kFlags);
      return 0;
    });
    // Shape errors (d_model % n_head, ...) are estimate_memory's, in the same words.
    in.unit_params = fsdp::tools::gpt_unit_params(m.n_layer, std::max<int64_t>(m.d_model, 0),
                                                  std::max<int64_t>(m.block_size, 0),
                                                  std::max<int64_t>(m.vocab_size, 0));
    return;
  }
  if (!r.count("params")) return;  // no model: estimate_memory says so, and how to give one
  const int64_t params = parse_count(r["params"].as<std::string>());
  const int64_t units = r["units"].as<int64_t>();
  flag_checked([&] {
    fsdp::core::check_positive(units, "--units", fsdp::core::Surface::kFlags);
    return 0;
  });
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
  in.gpus_per_node = r["gpus-per-node"].as<int>();
  if (r.count("nodes")) {
    const int nodes = r["nodes"].as<int>();
    if (nodes < 1)
      bad_input("--nodes " + std::to_string(nodes) + " is invalid; it must be at least 1");
    if (in.gpus_per_node < 1)
      bad_input("--nodes needs --gpus-per-node (the world size is their product)");
    if (r.count("world-size") && in.world_size != nodes * in.gpus_per_node) {
      bad_input("--world-size " + std::to_string(in.world_size) + " contradicts --nodes " +
                std::to_string(nodes) + " x --gpus-per-node " + std::to_string(in.gpus_per_node) +
                "; give one or the other");
    }
    in.world_size = nodes * in.gpus_per_node;
  }
  namespace core = fsdp::core;
  const auto flags = core::Surface::kFlags;
  in.strategy = flag_checked([&] {
    return core::parse_strategy(renamed<std::string>(r, "sharding", "strategy"), "--sharding");
  });
  in.hybrid_group_size = r["hybrid-group-size"].as<int>();
  in.reshard_after_forward_group_size =
      renamed<int>(r, "hpz-group-size", "reshard-after-forward-group-size");
  in.quantized_weights = r.count("quantize-weights") > 0;
  in.quantized_gradients = r.count("quantize-gradients") > 0;
  in.weight_bits = r["quantize-weight-bits"].as<int>();
  in.gradient_bits = r["quantize-gradient-bits"].as<int>();
  in.quantization_block = r["quantize-block"].as<int64_t>();
  if (r.count("hybrid-group-size") && in.strategy != fsdp::ShardingStrategy::kHybridShard) {
    bad_input("--hybrid-group-size applies to --sharding hybrid only");
  }
  in.precision = flag_checked([&] {
    return core::parse_precision(r["precision"].as<std::string>(), core::Option::kPrecision, flags);
  });
  in.offload_optimizer = flag_checked([&] {
    return core::parse_offload(r["offload-optimizer"].as<std::string>(),
                               core::Option::kOffloadOptimizer, flags);
  });
  in.offload_param = flag_checked([&] {
    return core::parse_offload(r["offload-param"].as<std::string>(), core::Option::kOffloadParam,
                               flags);
  });
  in.nvme_buffer_bytes = r["nvme-buffer-bytes"].as<int64_t>();
  const std::string checkpointing = r["activation-checkpointing"].as<std::string>();
  if (checkpointing != "none" && checkpointing != "all") {
    bad_input("--activation-checkpointing " + checkpointing +
              " is not estimated; use none or all (train_gpt's every:K checkpoints fewer blocks, "
              "so all is its upper bound)");
  }
  in.activation_checkpointing = checkpointing == "all";
  in.offload_activations = r.count("offload-activations") > 0;
  fsdp::Precision master = flag_checked([&] {
    return core::parse_precision(r["master-dtype"].as<std::string>(), core::Option::kMasterDtype,
                                 flags);
  });
  if (master == fsdp::Precision::kFp16) {  // a precision, but not a master's
    flag_checked([&] {
      core::unsupported_dtype(core::Option::kMasterDtype, fsdp::to_string(master), flags);
      return 0;
    });
  }
  if (r.count("pure-bf16") > 0) master = renamed_switch(r, master);
  in.pure_bf16 = master == fsdp::Precision::kBf16;
  in.max_gathered_units = r["max-gathered-units"].as<int>();
  // --cpu-offload: both offloads on the host; the rules (an NVMe offload beside it is
  // refused) are the core's, which estimate_memory applies with the rest.
  core::Options legacy;
  legacy.cpu_offload = r.count("cpu-offload") > 0;
  legacy.offload_optimizer = in.offload_optimizer;
  legacy.offload_param = in.offload_param;
  legacy.world_size_known = false;
  flag_checked([&] {
    core::validate(legacy, flags);
    return 0;
  });
  const core::Options both = core::resolved(legacy);
  in.offload_optimizer = both.offload_optimizer;
  in.offload_param = both.offload_param;
  return in;
}

// Every term's device, host and NVMe bytes.
nlohmann::json terms_json(const std::vector<fsdp::MemoryTerm>& terms) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& t : terms) {
    out.push_back({{"key", t.key},
                   {"label", t.label},
                   {"basis", t.basis},
                   {"device_bytes", t.device_bytes},
                   {"host_bytes", t.host_bytes},
                   {"nvme_bytes", t.nvme_bytes}});
  }
  return out;
}

nlohmann::json deepspeed_json(const std::vector<fsdp::DeepSpeedRow>& rows, int stage) {
  nlohmann::json out = {{"stage", stage}, {"rows", nlohmann::json::array()}};
  for (const auto& row : rows) {
    out["rows"].push_back({{"offload_param", fsdp::to_string(row.offload_param)},
                           {"offload_optimizer", fsdp::to_string(row.offload_optimizer)},
                           {"zero_init", row.zero_init},
                           {"deepspeed_cpu_bytes", row.deepspeed_cpu_bytes},
                           {"deepspeed_gpu_bytes", row.deepspeed_gpu_bytes},
                           {"host_per_node_bytes", row.host_per_node},
                           {"device_per_gpu_bytes", row.device_per_gpu},
                           {"nvme_per_node_bytes", row.nvme_per_node},
                           {"host_states_per_node_bytes", row.host_states_per_node},
                           {"host_construction_per_node_bytes", row.host_construction_per_node}});
  }
  return out;
}

void print_json(const fsdp::EstimateInput& in, const fsdp::MemoryEstimate& est,
                const std::vector<fsdp::DeepSpeedRow>* table, int stage) {
  const int64_t g = est.gpus_per_node;
  nlohmann::json j = {{"params", est.total_params},
                      {"largest_unit_params", est.largest_unit_params},
                      {"units", in.unit_params},
                      {"world_size", in.world_size},
                      {"gpus_per_node", est.gpus_per_node},
                      {"nodes", est.nodes},
                      {"strategy", strategy_name(in.strategy)},
                      {"shard_group_size", est.shard_group_size},
                      {"precision", fsdp::to_string(in.precision)},
                      {"cpu_offload", in.offload_optimizer == fsdp::OffloadDevice::kCpu &&
                                          in.offload_param == fsdp::OffloadDevice::kCpu},
                      {"offload_optimizer", fsdp::to_string(in.offload_optimizer)},
                      {"offload_param", fsdp::to_string(in.offload_param)},
                      {"activation_checkpointing", in.activation_checkpointing},
                      {"offload_activations", in.offload_activations},
                      {"pure_bf16", in.pure_bf16},
                      {"max_gathered_units", in.max_gathered_units},
                      {"reshard_after_forward_group_size", in.reshard_after_forward_group_size},
                      {"quantized_weights", in.quantized_weights},
                      {"quantized_gradients", in.quantized_gradients},
                      {"micro_batch", in.activations.micro_batch},
                      {"device_total_bytes", est.device_total()},
                      {"host_total_bytes", est.host_total()},
                      {"nvme_total_bytes", est.nvme_total()},
                      {"per_node",
                       {{"device_total_bytes", g * est.device_total()},
                        {"host_total_bytes", g * est.host_total()},
                        {"nvme_total_bytes", g * est.nvme_total()},
                        {"model_states_device_bytes", g * est.model_states_device()},
                        {"model_states_host_bytes", g * est.model_states_host()},
                        {"model_states_nvme_bytes", g * est.model_states_nvme()}}},
                      {"model_states_device_bytes", est.model_states_device()},
                      {"model_states_host_bytes", est.model_states_host()},
                      {"model_states_nvme_bytes", est.model_states_nvme()},
                      {"terms", terms_json(est.terms)},
                      {"construction", terms_json(est.construction)}};
  if (table != nullptr) j["deepspeed_table"] = deepspeed_json(*table, stage);
  std::cout << j.dump(2) << std::endl;
}

void print_row(const std::string& label, const std::string& basis, int64_t device, int64_t host,
               int64_t nvme) {
  std::printf("  %-36s %-6s %12s %12s %12s\n", label.c_str(), basis.c_str(), human(device).c_str(),
              human(host).c_str(), human(nvme).c_str());
}

// DeepSpeed's table as estimate_zero3_model_states_mem_needs_all_cold prints it (GB = 2^30
// bytes, per CPU = per node), this engine's figures in the same units beside.
void print_deepspeed(const fsdp::EstimateInput& in, const fsdp::MemoryEstimate& est,
                     const std::vector<fsdp::DeepSpeedRow>& rows, int stage) {
  auto gb = [](int64_t b, int width) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%*.2fGB", width, static_cast<double>(b) / (1 << 30));
    return std::string(buf);
  };
  std::printf(
      "\nDeepSpeed's estimate_zero%d_model_states_mem_needs_all_cold%s, and this engine:\n", stage,
      in.strategy == fsdp::ShardingStrategy::kZero1 ? " (stage 2's; it has none for stage 1)" : "");
  std::printf("HW: Setup with %d %s, %d %s per node.\n", est.nodes,
              est.nodes > 1 ? "nodes" : "node", est.gpus_per_node,
              est.gpus_per_node > 1 ? "GPUs" : "GPU");
  std::string sw =
      "SW: Model with " + std::to_string(est.total_params / 1000000) + "M total params";
  if (stage == 3)
    sw += ", " + std::to_string(est.largest_unit_params / 1000000) + "M largest layer params";
  std::printf("%s.\n", sw.c_str());
  std::printf("   DeepSpeed:          | this engine (%s, %s):\n", fsdp::to_string(in.precision),
              strategy_name(in.strategy));
  std::printf("  per CPU  |  per GPU |  per CPU  |  per GPU |   Options\n");
  for (const auto& row : rows) {
    std::string options;
    if (stage == 3)
      options += std::string("offload_param=") + fsdp::to_string(row.offload_param) + ", ";
    options += std::string("offload_optimizer=") + fsdp::to_string(row.offload_optimizer);
    if (stage == 3) options += std::string(", zero_init=") + (row.zero_init ? "1" : "0");
    std::printf(" %s | %s | %s | %s | %s\n", gb(row.deepspeed_cpu_bytes, 7).c_str(),
                gb(row.deepspeed_gpu_bytes, 6).c_str(), gb(row.host_per_node, 7).c_str(),
                gb(row.device_per_gpu, 6).c_str(), options.c_str());
  }
  if (stage == 3) {
    std::printf(
        "Per CPU is host bytes per node, per GPU device bytes per rank. DeepSpeed multiplies the\n"
        "host by additional_buffer_factor 1.5, keeps a 2-byte copy of each shard (on the GPU, or\n"
        "on the host with offload_param) and counts 4 B x the largest layer on the GPU, where\n"
        "this engine has its gathered units (README, \"fsdp-estimate beside DeepSpeed\").\n");
  } else {
    std::printf(
        "Per CPU is host bytes per node, per GPU device bytes per rank. DeepSpeed multiplies the\n"
        "host by additional_buffer_factor 1.5, counts 2-byte gradient partitions on the GPU, and\n"
        "its host figure with offload is the whole job's; this engine keeps a 2-byte copy of the\n"
        "shard with offload_optimizer%s (README, \"fsdp-estimate beside DeepSpeed\").\n",
        in.strategy == fsdp::ShardingStrategy::kZero1 ? ", and ZeRO-1 the full gradients" : "");
  }
}

void print_table(const fsdp::EstimateInput& in, const fsdp::MemoryEstimate& est) {
  const size_t units = in.unit_params.size();
  const fsdp::TransformerShape& m = in.activations;
  const std::string model =
      m.n_layer > 0
          ? "GPT " + std::to_string(m.n_layer) + " x " + std::to_string(m.d_model) + ": " +
                std::to_string(units - 1) + " blocks + root; micro-batch " +
                std::to_string(m.micro_batch) + " x " + std::to_string(m.block_size) + " tokens"
          : std::to_string(units) + " units, root first";
  const char* strategy = strategy_name(in.strategy);
  const char* precision = fsdp::to_string(in.precision);
  const fsdp::OffloadDevice opt = in.offload_optimizer, par = in.offload_param;
  std::string offload;
  if (opt != fsdp::OffloadDevice::kNone)
    offload += std::string(", offload_optimizer=") + fsdp::to_string(opt);
  if (par != fsdp::OffloadDevice::kNone)
    offload += std::string(", offload_param=") + fsdp::to_string(par);
  std::printf(
      "Per-rank memory: %s parameters (%s), world size %d (%d node%s x %d), strategy %s (shard "
      "group %d), %s%s%s\n",
      millions(est.total_params).c_str(), model.c_str(), in.world_size, est.nodes,
      est.nodes > 1 ? "s" : "", est.gpus_per_node, strategy, est.shard_group_size, precision,
      offload.c_str(), in.activation_checkpointing ? ", activation checkpointing" : "");
  std::printf("  %-36s %-6s %12s %12s %12s\n", "term", "basis", "device", "host", "nvme");
  for (const auto& t : est.terms)
    print_row(t.label, t.basis, t.device_bytes, t.host_bytes, t.nvme_bytes);
  print_row("total per rank", "", est.device_total(), est.host_total(), est.nvme_total());
  const int64_t g = est.gpus_per_node;
  print_row("total per node (" + std::to_string(g) + " ranks)", "", g * est.device_total(),
            g * est.host_total(), g * est.nvme_total());
  std::printf("Peak while the model is built (before gradients and optimizer state), per rank:\n");
  for (const auto& t : est.construction)
    print_row(t.label, t.basis, t.device_bytes, t.host_bytes, t.nvme_bytes);
  // DeepSpeed's layout (estimate_zero3_model_states_mem_needs), with this engine's
  // model states: 16 B per sharded element plus the gathered units.
  std::printf("\nEstimated memory needed for params, optim states and gradients for a:\n");
  std::printf("HW: Setup with %d ranks (%d per node).\n", in.world_size, est.gpus_per_node);
  std::printf("SW: Model with %s total params, %s largest unit params.\n",
              millions(est.total_params).c_str(), millions(est.largest_unit_params).c_str());
  std::printf("  per CPU (node) |    per GPU |  NVMe (node) |   Options\n");
  std::printf(
      "  %14s | %10s | %12s | offload_param=%s, offload_optimizer=%s, strategy=%s, "
      "precision=%s\n",
      human(g * est.model_states_host()).c_str(), human(est.model_states_device()).c_str(),
      human(g * est.model_states_nvme()).c_str(), fsdp::to_string(par), fsdp::to_string(opt),
      strategy, precision);
}

// --pipeline-stages: each stage's estimate (fsdp::estimate_pipeline), as a table each or
// one JSON document.
int run_pipeline(const cxxopts::ParseResult& r, fsdp::EstimateInput in) {
  fsdp::PipelineShape p;
  p.stages = r["pipeline-stages"].as<int>();
  p.micro_batches = r["micro-batches"].as<int>();
  const std::string schedule = r["pipeline-schedule"].as<std::string>();
  if (schedule != "1f1b" && schedule != "gpipe")
    bad_input("--pipeline-schedule '" + schedule + "' is unknown; use 1f1b or gpipe");
  p.gpipe = schedule == "gpipe";
  p.partition = r["partition"].as<std::string>();
  p.reduce_once = r.count("reduce-every-micro-batch") == 0;
  if (r.count("deepspeed-table"))
    bad_input(
        "--deepspeed-table has no pipeline stages (DeepSpeed estimates ZeRO alone); leave "
        "out one or the other");
  const fsdp::TransformerShape& m = in.activations;
  if (m.n_layer > 0) {  // a GPT: its pipeline layers, not its units
    in.unit_params =
        fsdp::tools::gpt_layer_params(m.n_layer, m.d_model, m.block_size, m.vocab_size);
  } else if (r.count("params") && in.unit_params.size() > 1) {
    in.unit_params.erase(in.unit_params.begin());  // --units equal layers, no empty root
  }
  std::vector<fsdp::StageEstimate> stages;
  try {
    stages = fsdp::estimate_pipeline(in, p);
  } catch (const std::invalid_argument& e) {
    bad_input(e.what());
  }
  if (r.count("json")) {
    nlohmann::json j = {{"pipeline_stages", p.stages},
                        {"micro_batches", p.micro_batches > 0 ? p.micro_batches : 2 * p.stages},
                        {"schedule", schedule},
                        {"partition", p.partition},
                        {"reduce_once", p.reduce_once},
                        {"layers", in.unit_params},
                        {"world_size", in.world_size},
                        {"stages", nlohmann::json::array()}};
    for (const auto& st : stages) {
      j["stages"].push_back({{"stage", st.stage},
                             {"first_layer", st.first_layer},
                             {"last_layer", st.last_layer},
                             {"micro_batches_in_flight", st.micro_batches_in_flight},
                             {"params", st.memory.total_params},
                             {"shard_group_size", st.memory.shard_group_size},
                             {"device_total_bytes", st.memory.device_total()},
                             {"host_total_bytes", st.memory.host_total()},
                             {"nvme_total_bytes", st.memory.nvme_total()},
                             {"terms", terms_json(st.memory.terms)},
                             {"construction", terms_json(st.memory.construction)}});
    }
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::printf(
      "Pipeline: %d stages over %d ranks (%d a stage), %s, %d micro-batches, partition "
      "%s%s; %zu layers\n",
      p.stages, in.world_size, in.world_size / p.stages, schedule.c_str(),
      p.micro_batches > 0 ? p.micro_batches : 2 * p.stages, p.partition.c_str(),
      p.reduce_once ? "" : ", every micro-batch reduced", in.unit_params.size());
  for (const auto& st : stages) {
    std::printf("\nStage %d: layers [%lld, %lld), %s parameters, %d micro-batch%s in flight\n",
                st.stage, static_cast<long long>(st.first_layer),
                static_cast<long long>(st.last_layer), millions(st.memory.total_params).c_str(),
                st.micro_batches_in_flight, st.micro_batches_in_flight == 1 ? "" : "es");
    std::printf("  %-36s %-6s %12s %12s %12s\n", "term", "basis", "device", "host", "nvme");
    for (const auto& t : st.memory.terms)
      print_row(t.label, t.basis, t.device_bytes, t.host_bytes, t.nvme_bytes);
    print_row("total per rank", "", st.memory.device_total(), st.memory.host_total(),
              st.memory.nvme_total());
  }
  return 0;
}

// --activation-checkpointing was a switch before it took train_gpt's values; alone (the
// last argument, or one before another flag) it still means all, with a warning.
std::vector<char*> with_switches_resolved(int argc, char** argv) {
  static char all[] = "--activation-checkpointing=all";
  std::vector<char*> args(argv, argv + argc);
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) != "--activation-checkpointing") continue;
    if (i + 1 < argc && argv[i + 1][0] != '-') continue;
    std::cerr << "fsdp-estimate: --activation-checkpointing alone is deprecated and goes in the "
                 "next release; write --activation-checkpointing all\n";
    args[i] = all;
  }
  return args;
}

int run(int argc, char** argv) {
  auto options = make_options();
  std::vector<char*> args = with_switches_resolved(argc, argv);
  const auto r = options.parse(static_cast<int>(args.size()), args.data());
  if (r.count("help")) {
    std::cout << options.help() << kNotes;
    return 0;
  }
  if (r.count("version")) {
    std::cout << fsdp::version_line("fsdp-estimate") << std::endl;
    return 0;
  }
  const auto in = read_input(r);
  if (r["pipeline-stages"].as<int>() != 1 || r.count("micro-batches") ||
      r.count("pipeline-schedule") || r.count("partition") || r.count("reduce-every-micro-batch"))
    return run_pipeline(r, in);
  fsdp::MemoryEstimate est;
  try {
    est = fsdp::estimate_memory(in);
  } catch (const std::invalid_argument& e) {  // it names the flag's value and the fix
    bad_input(e.what());
  }
  std::vector<fsdp::DeepSpeedRow> table;
  int stage = 0;
  const bool want_table = r.count("deepspeed-table") > 0;
  if (want_table) {
    try {
      table = fsdp::deepspeed_table(in, &stage);
    } catch (const std::invalid_argument& e) {
      bad_input(e.what());
    }
  }
  if (r.count("json")) {
    print_json(in, est, want_table ? &table : nullptr, stage);
  } else {
    print_table(in, est);
    if (want_table) print_deepspeed(in, est, table, stage);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-estimate", [&] { return run(argc, argv); });
}
