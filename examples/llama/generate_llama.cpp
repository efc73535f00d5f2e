// generate_llama: greedy generation from a Hugging Face Llama directory (transformers'
// LlamaForCausalLM: config.json and model.safetensors, or shards with
// model.safetensors.index.json), on one process, unsharded, with a KV cache.
//
//   generate_llama --model DIR (--prompt TEXT | --prompt-ids 3,5,7) --max-new-tokens N
//                  [--no-kv-cache | --compare-no-cache] [--dump-logits FILE]
//                  [--device cpu|cuda|cuda:N|auto] [--dtype fp32|bf16] [--threads N]
//
// Tokens are bytes (the project's byte-level vocabulary): --prompt's bytes are its token
// ids. The weights may be fp32, bf16 or fp16 in the file; they are computed in --dtype.
// With tie_word_embeddings the file may lack lm_head.weight (transformers does not write
// it): that is the only key allowed to be missing. Every position must fit in
// max_position_embeddings: a prompt plus --max-new-tokens past it is an error before any
// work (nothing is cut short silently).
//
// stdout, one item per line, for scripts:
//   tokens: 72,101,108           the generated token ids
//   text: Hel\n\x01              the same as bytes; \\, \n, \t, \xHH for the rest, [id] past 255
//   tokens_per_s: kv_cache=812.3                   (or no_kv_cache=... with --no-kv-cache)
//   tokens_per_s: kv_cache=812.3 no_kv_cache=95.1 speedup=8.54   (--compare-no-cache)
// Errors go to stderr as "generate_llama: error: ..." (exit 2: bad flags or config, 1: bad
// weights or a --compare-no-cache mismatch).
#include <fsdp/checkpoint.h>

#include "../common/cli.h"
#include "../common/device.h"
#include "hf_config.h"
#include "llama_model.h"

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using examples::UsageError;

const char* const kModelDirHint =
    "give a Hugging Face model directory (config.json and model.safetensors), e.g. one "
    "that train_llama --export-hf wrote";

cxxopts::Options make_options() {
  cxxopts::Options o("generate_llama",
                     "Greedy generation from a Hugging Face Llama directory (LlamaForCausalLM), "
                     "with a KV cache.");
  o.add_options()("model", "Hugging Face model directory (config.json + safetensors)",
                  cxxopts::value<std::string>())(
      "prompt", "text to continue (its bytes are the token ids)", cxxopts::value<std::string>())(
      "prompt-ids", "the prompt as comma-separated token ids, e.g. 3,5,7",
      cxxopts::value<std::string>())("max-new-tokens", "tokens to generate (greedy, argmax)",
                                     cxxopts::value<int64_t>())(
      "no-kv-cache", "recompute the whole prefix for every token (the baseline)")(
      "compare-no-cache",
      "generate with and without the KV cache, require identical tokens, print both speeds")(
      "dump-logits",
      "write the logits of one uncached forward over the prompt to FILE (raw little-endian "
      "float32, T x vocab) and FILE.json ({\"shape\": [T, vocab]})",
      cxxopts::value<std::string>())("dtype", "fp32|bf16: the compute dtype",
                                     cxxopts::value<std::string>()->default_value("fp32"))(
      "threads", "LibTorch intra-op threads (one sequence is small work: more threads mostly wait)",
      cxxopts::value<int>()->default_value("1"))(
      "device", examples::kDeviceHelp, cxxopts::value<std::string>()->default_value("auto"))(
      "attention", examples::kAttentionHelp, cxxopts::value<std::string>()->default_value("sdpa"))(
      "h,help", "show this help");
  return o;
}

/// "3,5,7" -> {3, 5, 7}, each in [0, vocab).
std::vector<int64_t> parse_ids(const std::string& s, int64_t vocab) {
  std::vector<int64_t> ids;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size()) {
      throw UsageError("--prompt-ids " + s + ": '" + item +
                       "' is not a token id; give comma-separated integers, e.g. 3,5,7");
    }
    if (v < 0 || v >= vocab) {
      throw UsageError("--prompt-ids: token " + std::to_string(v) + " is not in 0.." +
                       std::to_string(vocab - 1) + " (vocab_size " + std::to_string(vocab) + ")");
    }
    ids.push_back(v);
  }
  if (!s.empty() && s.back() == ',')
    throw UsageError("--prompt-ids " + s + ": ends with ','; give comma-separated integers");
  return ids;
}

/// Bytes as text: printable ASCII as is, \\, \n, \t, \xHH for other bytes, [id] past 255.
std::string escaped(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) {
    if (id > 255) {
      out += "[" + std::to_string(id) + "]";
    } else if (id == '\\') {
      out += "\\\\";
    } else if (id == '\n') {
      out += "\\n";
    } else if (id == '\t') {
      out += "\\t";
    } else if (id >= 0x20 && id < 0x7f) {
      out += static_cast<char>(id);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(id));
      out += buf;
    }
  }
  return out;
}

std::string join(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(ids[i]);
  }
  return out;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ", ";
    out += names[i];
  }
  return out;
}

/// Loads `dir`'s safetensors into `model`. With tied embeddings the file may lack
/// lm_head.weight (it is model.embed_tokens.weight); anything else missing or unexpected
/// is an error naming the keys.
void load_weights(const std::string& dir, llama::Llama& model) {
  fsdp::ckpt::LoadOptions lo;
  lo.strict = false;
  lo.restore_rng = false;
  const auto report = fsdp::ckpt::load_consolidated(dir, *model, lo);
  std::vector<std::string> missing;
  for (const auto& k : report.missing) {
    if (!(model->config.tie_embeddings && k == "lm_head.weight")) missing.push_back(k);
  }
  std::string problems;
  if (!missing.empty()) {
    problems += "missing " + join(missing);
    if (std::find(missing.begin(), missing.end(), "lm_head.weight") != missing.end())
      problems += " (config.json has tie_word_embeddings false, so lm_head.weight must be there)";
  }
  if (!report.unexpected.empty())
    problems += std::string(problems.empty() ? "" : "; ") + "unexpected " + join(report.unexpected);
  if (!problems.empty()) {
    throw std::runtime_error(report.path + ": the weights do not match " + dir +
                             "/config.json's LlamaForCausalLM: " + problems +
                             "; use the config.json written with these weights");
  }
}

/// The next token: the argmax of the last position's logits.
int64_t argmax_last(const torch::Tensor& logits) {
  return logits.select(1, -1).squeeze(0).argmax().item<int64_t>();
}

torch::Tensor as_input(const std::vector<int64_t>& ids, const torch::Device& device) {
  return torch::tensor(ids, torch::kLong).unsqueeze(0).to(device);
}

/// `n_new` greedy tokens after `prompt`; with the cache, the prompt once then one token per
/// step; without, the whole prefix every step.
std::vector<int64_t> generate(llama::Llama& model, const std::vector<int64_t>& prompt,
                              int64_t n_new, bool use_cache, const torch::Device& device) {
  std::vector<int64_t> out;
  if (use_cache) {
    llama::KvCache cache;
    auto logits = model->forward_cached(as_input(prompt, device), cache);
    for (int64_t i = 0; i < n_new; ++i) {
      out.push_back(argmax_last(logits));
      if (i + 1 < n_new) logits = model->forward_cached(as_input({out.back()}, device), cache);
    }
  } else {
    std::vector<int64_t> seq = prompt;
    for (int64_t i = 0; i < n_new; ++i) {
      out.push_back(argmax_last(model->forward(as_input(seq, device))));
      seq.push_back(out.back());
    }
  }
  return out;
}

struct Timed {
  std::vector<int64_t> tokens;
  double tokens_per_s = 0;
};

Timed timed_generate(llama::Llama& model, const std::vector<int64_t>& prompt, int64_t n_new,
                     bool use_cache, const torch::Device& device) {
  const auto t0 = std::chrono::steady_clock::now();
  Timed t;
  t.tokens = generate(model, prompt, n_new, use_cache, device);  // .item() syncs the device
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t.tokens_per_s = static_cast<double>(n_new) / s;
  return t;
}

void dump_logits(const std::string& file, llama::Llama& model, const std::vector<int64_t>& prompt,
                 const torch::Device& device) {
  const uint16_t probe = 1;
  unsigned char first = 0;
  std::memcpy(&first, &probe, 1);
  if (first != 1) throw std::runtime_error("--dump-logits writes little-endian hosts' floats only");
  auto logits = model->forward(as_input(prompt, device))
                    .squeeze(0)
                    .to(torch::kCPU, torch::kFloat)
                    .contiguous();
  {
    std::ofstream out(file, std::ios::binary);
    out.write(static_cast<const char*>(logits.data_ptr()),
              static_cast<std::streamsize>(logits.nbytes()));
    if (!out) throw std::runtime_error("--dump-logits " + file + ": cannot write the file");
  }
  std::ofstream meta(file + ".json");
  meta << nlohmann::json{{"shape", {logits.size(0), logits.size(1)}}}.dump() << "\n";
  if (!meta) throw std::runtime_error("--dump-logits " + file + ".json: cannot write the file");
}

std::string fixed(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

int run(int argc, char** argv) {
  auto o = make_options();
  const auto parsed = examples::parse_command_line(o, argc, argv, {"model", "max-new-tokens"});
  if (!parsed) return 0;  // --help
  const cxxopts::ParseResult& r = *parsed;
  if (r.count("prompt") + r.count("prompt-ids") != 1)
    throw UsageError("give one of --prompt TEXT or --prompt-ids 3,5,7");
  const bool no_cache = r.count("no-kv-cache") > 0, compare = r.count("compare-no-cache") > 0;
  if (no_cache && compare)
    throw UsageError(
        "--no-kv-cache and --compare-no-cache exclude each other (the comparison "
        "runs both)");
  const int64_t n_new = r["max-new-tokens"].as<int64_t>();
  if (n_new <= 0)
    throw UsageError("--max-new-tokens " + std::to_string(n_new) + " must be positive");
  const std::string dtype_name = r["dtype"].as<std::string>();
  if (dtype_name != "fp32" && dtype_name != "bf16")
    throw UsageError("--dtype " + dtype_name + " is not a compute dtype here; use fp32 or bf16");
  const torch::Dtype dtype = dtype_name == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  const int threads = r["threads"].as<int>();
  if (threads <= 0) throw UsageError("--threads " + std::to_string(threads) + " must be positive");
  at::set_num_threads(threads);  // see generate.cpp: more threads mostly spin on 2 cores

  const auto attention = examples::parse_attention_flag(r["attention"].as<std::string>());
  const std::string dir = r["model"].as<std::string>();
  if (!std::filesystem::is_directory(dir))
    throw UsageError("--model " + dir + ": no such directory; " + kModelDirHint);
  if (!llama::is_hf_model_dir(dir))
    throw UsageError("--model " + dir + " has no config.json; " + kModelDirHint);
  llama::Config cfg = llama::from_lm(llama::read_hf_config(dir, 0));
  cfg.attention = attention;
  const torch::Device device = examples::parse_device_flag(r["device"].as<std::string>());

  std::vector<int64_t> prompt;
  if (r.count("prompt")) {
    for (unsigned char c : r["prompt"].as<std::string>()) prompt.push_back(c);
    examples::check_prompt(prompt.empty());
    for (int64_t id : prompt) {
      if (id >= cfg.vocab_size) {
        throw UsageError("--prompt has byte " + std::to_string(id) + ", not below vocab_size " +
                         std::to_string(cfg.vocab_size) + " of " + dir +
                         "/config.json; use --prompt-ids");
      }
    }
  } else {
    prompt = parse_ids(r["prompt-ids"].as<std::string>(), cfg.vocab_size);
    if (prompt.empty()) throw UsageError("--prompt-ids is empty; give at least one token id");
  }
  const int64_t T = static_cast<int64_t>(prompt.size());
  if (T > cfg.block_size) {
    throw UsageError(
        "the prompt is " + std::to_string(T) + " tokens, more than max_position_embeddings " +
        std::to_string(cfg.block_size) + " of " + dir + "/config.json; shorten the prompt");
  }
  // The last generated token is never fed back, so T + n_new - 1 positions are computed.
  if (T + n_new - 1 > cfg.block_size) {
    throw UsageError("the prompt's " + std::to_string(T) + " tokens and --max-new-tokens " +
                     std::to_string(n_new) + " need " + std::to_string(T + n_new - 1) +
                     " positions, more than max_position_embeddings " +
                     std::to_string(cfg.block_size) + " of " + dir +
                     "/config.json; use --max-new-tokens " +
                     std::to_string(cfg.block_size - T + 1) + " or less");
  }

  llama::Llama model(cfg);
  load_weights(dir, model);
  model->to(device, dtype);
  model->eval();
  torch::NoGradGuard no_grad;

  if (r.count("dump-logits"))
    dump_logits(r["dump-logits"].as<std::string>(), model, prompt, device);

  const Timed first = timed_generate(model, prompt, n_new, !no_cache, device);
  std::cout << "tokens: " << join(first.tokens) << "\n";
  std::cout << "text: " << escaped(first.tokens) << "\n";
  if (!compare) {
    std::cout << "tokens_per_s: " << (no_cache ? "no_kv_cache=" : "kv_cache=")
              << fixed(first.tokens_per_s) << std::endl;
    return 0;
  }
  const Timed base = timed_generate(model, prompt, n_new, false, device);
  if (base.tokens != first.tokens) {
    size_t i = 0;
    while (base.tokens[i] == first.tokens[i]) ++i;
    throw std::runtime_error("--compare-no-cache: the tokens differ at new token " +
                             std::to_string(i) + ": " + std::to_string(first.tokens[i]) +
                             " with the KV cache, " + std::to_string(base.tokens[i]) +
                             " without (without: " + join(base.tokens) + ")");
  }
  char ratio[32];
  std::snprintf(ratio, sizeof(ratio), "%.2f", first.tokens_per_s / base.tokens_per_s);
  std::cout << "tokens_per_s: kv_cache=" << fixed(first.tokens_per_s)
            << " no_kv_cache=" << fixed(base.tokens_per_s) << " speedup=" << ratio << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::program_main("generate_llama", [&] { return run(argc, argv); });
}
