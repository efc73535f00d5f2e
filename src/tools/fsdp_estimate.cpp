// fsdp-estimate: per-rank memory of a sharded training run, term by term, on the device
// and on the host, before running it (DeepSpeed users know this as
// estimate_zero3_model_states_mem_needs).
//
//   fsdp-estimate (--n-layer L --n-head H --d-model D --block-size S [--vocab-size V]
//                  | --params N [--units K])
//                 [--world-size W] [--strategy full|grad_op|none|hybrid] [--hybrid-group-size G]
//                 [--precision fp32|bf16|fp16] [--cpu-offload] [--activation-checkpointing]
//                 [--micro-batch B] [--json]
#include <fsdp/estimate.h>

#include <cxxopts.hpp>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace {

std::string human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

int run(int argc, char** argv) {
  cxxopts::Options o("fsdp-estimate", "Per-rank memory of fully sharded training, by term, on device and host.");
  o.add_options()
    ("n-layer", "GPT blocks", cxxopts::value<int64_t>()->default_value("0"))
    ("n-head", "GPT attention heads", cxxopts::value<int64_t>()->default_value("0"))
    ("d-model", "GPT width", cxxopts::value<int64_t>()->default_value("0"))
    ("block-size", "GPT context length", cxxopts::value<int64_t>()->default_value("0"))
    ("vocab-size", "GPT vocabulary", cxxopts::value<int64_t>()->default_value("256"))
    ("params", "instead of a GPT shape: a parameter count (e.g. 1.3e9)", cxxopts::value<double>()->default_value("0"))
    ("units", "with --params: equal units it is wrapped into (plus an empty root)", cxxopts::value<int64_t>()->default_value("1"))
    ("world-size", "ranks", cxxopts::value<int>()->default_value("1"))
    ("strategy", "full|grad_op|none|hybrid", cxxopts::value<std::string>()->default_value("full"))
    ("hybrid-group-size", "ranks per shard group for hybrid (0: the world)", cxxopts::value<int>()->default_value("0"))
    ("precision", "fp32|bf16|fp16 (compute and gathered parameters)", cxxopts::value<std::string>()->default_value("fp32"))
    ("cpu-offload", "fp32 shards, gradients and optimizer state in host memory")
    ("activation-checkpointing", "recompute blocks in backward")
    ("micro-batch", "sequences per rank per micro-batch, for activations (GPT only)", cxxopts::value<int64_t>()->default_value("1"))
    ("json", "print JSON instead of a table")
    ("h,help", "show this help");
  auto r = o.parse(argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << std::endl;
    return 0;
  }
  if (!r.unmatched().empty()) throw std::invalid_argument("unexpected argument '" + r.unmatched()[0] + "'; see --help");
  fsdp::EstimateInput in;
  const bool gpt = r["n-layer"].as<int64_t>() > 0 || r["d-model"].as<int64_t>() > 0;
  const double params = r["params"].as<double>();
  if (gpt && params > 0) throw std::invalid_argument("give either a GPT shape or --params, not both");
  if (gpt) {
    in.n_layer = r["n-layer"].as<int64_t>();
    in.n_head = r["n-head"].as<int64_t>();
    in.d_model = r["d-model"].as<int64_t>();
    in.block_size = r["block-size"].as<int64_t>();
    in.vocab_size = r["vocab-size"].as<int64_t>();
    for (auto [flag, v] : {std::pair<const char*, int64_t>{"n-layer", in.n_layer}, {"n-head", in.n_head},
                           {"d-model", in.d_model}, {"block-size", in.block_size}, {"vocab-size", in.vocab_size}}) {
      if (v <= 0) throw std::invalid_argument(std::string("--") + flag + " " + std::to_string(v) + " must be positive");
    }
    if (in.d_model % in.n_head != 0) {
      throw std::invalid_argument("--d-model " + std::to_string(in.d_model) + " must be divisible by --n-head " +
                                  std::to_string(in.n_head));
    }
    in.unit_params = fsdp::gpt_unit_params(in.n_layer, in.d_model, in.block_size, in.vocab_size);
    in.micro_batch = r["micro-batch"].as<int64_t>();
    if (in.micro_batch <= 0) throw std::invalid_argument("--micro-batch must be positive");
  } else if (params > 0) {
    const int64_t units = r["units"].as<int64_t>();
    if (units <= 0) throw std::invalid_argument("--units " + std::to_string(units) + " must be positive");
    const auto total = static_cast<int64_t>(params);
    in.unit_params = {0};
    for (int64_t i = 0; i < units; ++i) in.unit_params.push_back(total / units + (i < total % units ? 1 : 0));
  } else {
    throw std::invalid_argument("give a GPT shape (--n-layer --n-head --d-model --block-size) or --params N");
  }
  in.world_size = r["world-size"].as<int>();
  in.strategy = r["strategy"].as<std::string>();
  in.hybrid_group_size = r["hybrid-group-size"].as<int>();
  in.precision = r["precision"].as<std::string>();
  in.cpu_offload = r.count("cpu-offload") > 0;
  in.activation_checkpointing = r.count("activation-checkpointing") > 0;
  const auto est = fsdp::estimate_memory(in);

  if (r.count("json")) {
    nlohmann::json j = {{"params", est.total_params}, {"world_size", in.world_size}, {"strategy", in.strategy},
                        {"shard_group_size", est.shard_group_size}, {"precision", in.precision},
                        {"cpu_offload", in.cpu_offload}, {"activation_checkpointing", in.activation_checkpointing},
                        {"device_total_bytes", est.device_total()}, {"host_total_bytes", est.host_total()}};
    for (const auto& t : est.terms) j["terms"].push_back({{"name", t.name}, {"device_bytes", t.device_bytes}, {"host_bytes", t.host_bytes}});
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::printf("Estimated memory per rank: %lld parameters, world size %d, strategy %s (shard group %d), %s%s%s\n",
              static_cast<long long>(est.total_params), in.world_size, in.strategy.c_str(), est.shard_group_size,
              in.precision.c_str(), in.cpu_offload ? ", CPU offload" : "",
              in.activation_checkpointing ? ", activation checkpointing" : "");
  std::printf("  %-34s %14s %14s\n", "term", "device", "host");
  for (const auto& t : est.terms) {
    std::printf("  %-34s %14s %14s\n", t.name.c_str(), human(t.device_bytes).c_str(), human(t.host_bytes).c_str());
  }
  std::printf("  %-34s %14s %14s\n", "total", human(est.device_total()).c_str(), human(est.host_total()).c_str());
  std::printf("Model states (DeepSpeed's estimate_zero3_model_states_mem_needs terms): %s per device, %s per host "
              "rank%s.\n",
              human(est.device_total() - est.term(est.terms.back().name).device_bytes).c_str(),
              human(est.host_total()).c_str(), in.cpu_offload ? " (offloaded)" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cerr << "fsdp-estimate: error: " << e.what() << std::endl;
    return 2;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "fsdp-estimate: error: " << e.what() << "; see --help" << std::endl;
    return 2;
  }
}
