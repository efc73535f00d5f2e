// generate: text from a consolidated GPT checkpoint, on one process, unsharded.
//
//   generate --weights FILE.h5 --prompt TEXT --max-new-tokens N
//            [--greedy | --temperature T --top-k K --seed S] [--device cpu|cuda|cuda:N|auto]
//            [--attention sdpa|math]
//
// The architecture comes from the file's root attributes (n_layer, n_head, d_model,
// block_size, vocab_size), so no model flags are needed. Only the generated
// continuation goes to stdout; errors go to stderr (exit 2: bad flags, 1: bad file).
#include <fsdp/checkpoint.h>

#include "../common/cli.h"
#include "../common/device.h"
#include "../common/trainer/architecture.h"
#include "gpt_model.h"

#include <cxxopts.hpp>

#include <iostream>
#include <sstream>
#include <string>

namespace {

using examples::UsageError;

int64_t int_attr(const std::map<std::string, fsdp::ckpt::AttrValue>& attrs, const std::string& key,
                 const std::string& file) {
  auto it = attrs.find(key);
  if (it == attrs.end() || !std::holds_alternative<int64_t>(it->second)) {
    throw std::runtime_error(
        file + " has no integer root attribute '" + key +
        "': it is not a GPT checkpoint from train_gpt (needs n_layer, n_head, d_model, "
        "block_size, vocab_size)");
  }
  return std::get<int64_t>(it->second);
}

cxxopts::Options make_options() {
  cxxopts::Options o(
      "generate", "Generate text from a consolidated GPT checkpoint (train_gpt --consolidate-to).");
  o.add_options()("weights", "consolidated HDF5 file", cxxopts::value<std::string>())(
      "prompt", "text to continue (bytes)", cxxopts::value<std::string>())(
      "max-new-tokens", "bytes to generate", cxxopts::value<int64_t>())(
      "greedy", "always take the most likely next byte (deterministic)")(
      "temperature", "sampling temperature (> 0)", cxxopts::value<double>()->default_value("1.0"))(
      "top-k", "sample among the K most likely bytes (1..vocab; 0: all)",
      cxxopts::value<int64_t>()->default_value("0"))(
      "seed", "sampling seed (same seed, same text)",
      cxxopts::value<uint64_t>()->default_value("0"))(
      "threads", "LibTorch intra-op threads (one sequence is small work: more threads mostly wait)",
      cxxopts::value<int>()->default_value("1"))(
      "device", examples::kDeviceHelp, cxxopts::value<std::string>()->default_value("auto"))(
      "attention", examples::kAttentionHelp, cxxopts::value<std::string>()->default_value("sdpa"))(
      "h,help", "show this help");
  return o;
}

/// The model's shape, from the file's root attributes.
gpt::Config read_architecture(const std::string& file) {
  const auto attrs = fsdp::ckpt::consolidated_attributes(file);
  gpt::Config cfg;
  for (const auto& [key, field] : lm::architecture_fields(cfg)) *field = int_attr(attrs, key, file);
  return cfg;
}

/// How the next byte is picked: the most likely one, or a sample.
struct Sampling {
  bool greedy = false;     ///< --greedy: the most likely byte
  double temperature = 1;  ///< --temperature
  int64_t top_k = 0;       ///< --top-k: sample among the K most likely (0: all)
  at::Generator gen;       ///< seeded by --seed
};

/// The byte after `tokens`, of which the last block_size are the model's context.
int64_t next_token(gpt::GPT& model, const std::vector<int64_t>& tokens, int64_t block_size,
                   const Sampling& how, const torch::Device& device) {
  const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - block_size);
  auto ctx = torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), torch::kLong)
                 .unsqueeze(0)
                 .to(device);
  // Picked on the host, where the --seed generator lives.
  auto logits = model->forward(ctx).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat);
  if (how.greedy) return logits.argmax().item<int64_t>();
  logits = logits / how.temperature;
  if (how.top_k > 0 && how.top_k < logits.size(0)) {
    auto kth = std::get<0>(logits.topk(how.top_k)).min();
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  return torch::multinomial(torch::softmax(logits, 0), 1, false, how.gen).item<int64_t>();
}

int run(int argc, char** argv) {
  auto o = make_options();
  const auto parsed =
      examples::parse_command_line(o, argc, argv, {"weights", "prompt", "max-new-tokens"});
  if (!parsed) return 0;  // --help
  const cxxopts::ParseResult& r = *parsed;
  const bool greedy = r.count("greedy") > 0;
  if (greedy && (r.count("temperature") || r.count("top-k") || r.count("seed"))) {
    throw UsageError("--greedy takes no --temperature, --top-k or --seed (it does not sample)");
  }
  const std::string prompt = r["prompt"].as<std::string>();
  const int64_t n_new = r["max-new-tokens"].as<int64_t>();
  const double temperature = r["temperature"].as<double>();
  const int64_t top_k = r["top-k"].as<int64_t>();
  examples::check_prompt(prompt.empty());
  if (n_new <= 0)
    throw UsageError("--max-new-tokens " + std::to_string(n_new) + " must be positive");
  if (!(temperature > 0)) {
    std::ostringstream t;  // as given: "0", "-0.5", not "0.000000"
    t << temperature;
    throw UsageError("--temperature " + t.str() + " must be positive");
  }
  const int threads = r["threads"].as<int>();
  if (threads <= 0) throw UsageError("--threads " + std::to_string(threads) + " must be positive");
  // One token at a time is a chain of tiny ops. With LibTorch 2.6 on Debian 13 (OpenMP
  // threads beside OpenBLAS's own pthreads), two threads made 50 tokens take 7.0 s
  // instead of 0.95 s on 2 cores: the pools spin against each other.
  at::set_num_threads(threads);

  const torch::Device device = examples::parse_device_flag(r["device"].as<std::string>());
  const std::string file = r["weights"].as<std::string>();
  const auto attention = examples::parse_attention_flag(r["attention"].as<std::string>());
  gpt::Config cfg = read_architecture(file);
  cfg.attention = attention;
  if (top_k < 0 || top_k > cfg.vocab_size) {
    throw UsageError("--top-k " + std::to_string(top_k) + " must be in 1.." +
                     std::to_string(cfg.vocab_size) + " (0: no limit)");
  }
  gpt::GPT model(cfg);
  fsdp::ckpt::load_consolidated(file, *model);
  model->to(device);
  model->eval();

  torch::NoGradGuard no_grad;
  const Sampling how{greedy, temperature, top_k,
                     at::detail::createCPUGenerator(r["seed"].as<uint64_t>())};
  std::vector<int64_t> tokens;
  for (unsigned char c : prompt) tokens.push_back(c);
  for (int64_t i = 0; i < n_new; ++i) {
    tokens.push_back(next_token(model, tokens, cfg.block_size, how, device));
    std::cout.put(static_cast<char>(tokens.back()));
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::program_main("generate", [&] { return run(argc, argv); });
}
