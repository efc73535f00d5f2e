#include "hf_config.h"

#include "../common/cli.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace llama {
namespace {

using examples::UsageError;
using nlohmann::json;

std::string where(const std::string& dir) { return dir + "/config.json"; }

// A field of config.json, or `fallback` (LlamaConfig's default) when it is absent or null.
template <class T>
T field(const json& j, const char* key, T fallback, const std::string& dir) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw UsageError(where(dir) + ": " + key + " is " + it->dump() + ", not " +
                     (std::is_same_v<T, bool>          ? "a boolean"
                      : std::is_same_v<T, double>      ? "a number"
                      : std::is_same_v<T, std::string> ? "a string"
                                                       : "an integer"));
  }
}

}  // namespace

bool is_hf_model_dir(const std::string& dir) {
  return std::filesystem::is_directory(dir) &&
         std::filesystem::is_regular_file(std::filesystem::path(dir) / "config.json");
}

lm::Config read_hf_config(const std::string& dir, int64_t block_size) {
  std::ifstream in(where(dir));
  if (!in) throw UsageError(where(dir) + ": cannot open the file");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw UsageError(where(dir) + ": not valid JSON (" + e.what() + ")");
  }
  const auto model_type = field<std::string>(j, "model_type", "", dir);
  if (model_type != "llama") {
    throw UsageError(where(dir) + ": model_type \"" + model_type +
                     "\"; train_llama and generate_llama build Llama models (model_type \"llama\", "
                     "LlamaForCausalLM)");
  }
  lm::Config c;
  c.arch = "llama";
  // LlamaConfig's defaults where a field is absent.
  c.vocab_size = field<int64_t>(j, "vocab_size", 32000, dir);
  c.d_model = field<int64_t>(j, "hidden_size", 4096, dir);
  c.intermediate_size = field<int64_t>(j, "intermediate_size", 11008, dir);
  c.n_layer = field<int64_t>(j, "num_hidden_layers", 32, dir);
  c.n_head = field<int64_t>(j, "num_attention_heads", 32, dir);
  c.n_kv_head = field<int64_t>(j, "num_key_value_heads", c.n_head, dir);
  c.max_positions = field<int64_t>(j, "max_position_embeddings", 2048, dir);
  c.rms_norm_eps = field<double>(j, "rms_norm_eps", 1e-6, dir);
  c.tie_embeddings = field<bool>(j, "tie_word_embeddings", false, dir);
  c.dropout = 0;
  c.block_size = block_size;
  // rope_theta: transformers 5 writes it in rope_parameters, earlier versions at the top.
  c.rope_theta = field<double>(j, "rope_theta", 10000.0, dir);
  std::string rope_type = "default";
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_object()) throw UsageError(where(dir) + ": " + key + " is not an object");
    if (it->contains("rope_theta")) c.rope_theta = field<double>(*it, "rope_theta", 10000.0, dir);
    rope_type =
        field<std::string>(*it, "rope_type", field<std::string>(*it, "type", "default", dir), dir);
  }
  if (rope_type != "default") {
    throw UsageError(where(dir) + ": rope_type \"" + rope_type +
                     "\" (rope scaling) is not implemented here; this example computes "
                     "default rotary positions only");
  }
  const auto act = field<std::string>(j, "hidden_act", "silu", dir);
  if (act != "silu")
    throw UsageError(where(dir) + ": hidden_act \"" + act +
                     "\"; the Llama MLP here is SwiGLU (silu)");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (field<bool>(j, key, false, dir))
      throw UsageError(where(dir) + ": " + key + " true; this Llama has no biases");
  }
  if (c.n_head <= 0 || c.d_model % c.n_head != 0) {
    throw UsageError(where(dir) + ": hidden_size " + std::to_string(c.d_model) +
                     " is not a multiple of num_attention_heads " + std::to_string(c.n_head));
  }
  const int64_t head_dim = field<int64_t>(j, "head_dim", c.d_model / c.n_head, dir);
  if (head_dim != c.d_model / c.n_head) {
    throw UsageError(where(dir) + ": head_dim " + std::to_string(head_dim) +
                     " differs from hidden_size / num_attention_heads = " +
                     std::to_string(c.d_model / c.n_head) + "; not implemented here");
  }
  return c;
}

std::string hf_config_json(const lm::Config& c) {
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.d_model},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.n_layer},
            {"num_attention_heads", c.n_head},
            {"num_key_value_heads", c.n_kv_head},
            {"head_dim", c.d_model / c.n_head},
            {"hidden_act", "silu"},
            {"max_position_embeddings", c.max_positions > 0 ? c.max_positions : c.block_size},
            {"initializer_range", 0.02},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"mlp_bias", false},
            {"tie_word_embeddings", c.tie_embeddings},
            {"use_cache", true}};
  return j.dump(2) + "\n";
}

}  // namespace llama
