// The Llama example's inference path: forward_cached (examples/llama/llama_model.h)
// against the uncached forward, the KV cache's size, and generate_llama as a user runs it
// on what train_llama --export-hf writes, with its errors for bad input.
#include "support/multirank.h"

#include "../examples/llama/llama_model.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_llama_cases {

namespace {

std::string bin(const std::string& name) { return bin_dir() + "/" + name; }

llama::Config small_config(int64_t n_kv_head, bool tied) {
  llama::Config c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = n_kv_head;
  c.d_model = 32;
  c.intermediate_size = 48;
  c.block_size = 32;
  c.vocab_size = 64;
  c.rope_theta = 50000.0;
  c.tie_embeddings = tied;
  return c;
}

/// max |a - b| / max |b|.
double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// The prompt through forward_cached in one call, then one token per call, gives the
// logits of one uncached forward over the whole sequence, with grouped-query attention
// and without, tied and untied.
void expect_cached_equals_uncached(int64_t n_kv_head, bool tied) {
  SCOPED_TRACE("n_kv_head " + std::to_string(n_kv_head) + (tied ? " tied" : " untied"));
  torch::manual_seed(3);
  llama::Llama model(small_config(n_kv_head, tied));
  model->eval();
  torch::NoGradGuard g;
  const int64_t B = 2, T = 20, prompt = 7;
  auto idx = torch::randint(0, 64, {B, T}, torch::kLong);
  auto full = model->forward(idx);
  ASSERT_EQ(full.sizes(), (std::vector<int64_t>{B, T, 64}));

  llama::KvCache cache;
  std::vector<torch::Tensor> parts{model->forward_cached(idx.narrow(1, 0, prompt), cache)};
  EXPECT_EQ(cache.length, prompt);
  for (int64_t t = prompt; t < T; ++t) {
    parts.push_back(model->forward_cached(idx.narrow(1, t, 1), cache));
    EXPECT_EQ(cache.length, t + 1);
  }
  auto cached = torch::cat(parts, 1);
  ASSERT_EQ(cached.sizes(), full.sizes());
  const double rel = relative_difference(cached, full);
  EXPECT_LE(rel, 1e-5);
  // The cache is no copy of the uncached path: the two differ in how they are computed,
  // but every position's argmax agrees.
  EXPECT_TRUE(torch::equal(cached.argmax(-1), full.argmax(-1)));
}

TEST(LlamaKvCache, CachedLogitsEqualUncachedWithGroupedQueryAttention) {
  expect_cached_equals_uncached(/*n_kv_head=*/2, /*tied=*/false);
  expect_cached_equals_uncached(/*n_kv_head=*/2, /*tied=*/true);
}

TEST(LlamaKvCache, CachedLogitsEqualUncachedWithOneKvHeadPerHead) {
  expect_cached_equals_uncached(/*n_kv_head=*/4, /*tied=*/false);
  expect_cached_equals_uncached(/*n_kv_head=*/4, /*tied=*/true);
}

// A wrong cache is caught: logits computed with the positions of a cache that forgot its
// length are not the uncached ones (the check above can fail).
TEST(LlamaKvCache, ACacheAtTheWrongPositionGivesOtherLogits) {
  torch::manual_seed(3);
  llama::Llama model(small_config(2, false));
  model->eval();
  torch::NoGradGuard g;
  auto idx = torch::randint(0, 64, {1, 8}, torch::kLong);
  auto full = model->forward(idx);
  llama::KvCache cache;
  model->forward_cached(idx.narrow(1, 0, 7), cache);
  cache.length = 3;  // rotary positions restart at 3 instead of 7
  auto last = model->forward_cached(idx.narrow(1, 7, 1), cache);
  EXPECT_GT(relative_difference(last, full.narrow(1, 7, 1)), 1e-3);
}

int64_t cache_bytes(const llama::KvCache& cache) {
  int64_t n = 0;
  for (const auto& l : cache.layers) n += l.k.nbytes() + l.v.nbytes();
  return static_cast<int64_t>(n);
}

// Each position adds 2 (k and v) * n_layer * B * n_kv_head * head_dim fp32 values.
TEST(LlamaKvCache, GrowsByExactlyOnePositionsKeysAndValuesPerToken) {
  torch::manual_seed(3);
  const auto c = small_config(2, false);
  llama::Llama model(c);
  model->eval();
  torch::NoGradGuard g;
  const int64_t B = 3;
  const int64_t per_position = 2 * c.n_layer * B * c.n_kv_head * c.head_dim() * 4;
  ASSERT_EQ(per_position, 2 * 2 * 3 * 2 * 8 * 4);  // 768 bytes
  llama::KvCache cache;
  model->forward_cached(torch::zeros({B, 5}, torch::kLong), cache);
  EXPECT_EQ(cache_bytes(cache), 5 * per_position);
  for (int64_t t = 6; t <= 9; ++t) {
    model->forward_cached(torch::zeros({B, 1}, torch::kLong), cache);
    EXPECT_EQ(cache_bytes(cache), t * per_position);
  }
  for (const auto& l : cache.layers)
    EXPECT_EQ(l.k.sizes(), (std::vector<int64_t>{B, c.n_kv_head, 9, c.head_dim()}));
}

// Past max_position_embeddings the cached forward refuses, naming the position.
TEST(LlamaKvCache, RefusesPositionsPastMaxPositionEmbeddings) {
  llama::Llama model(small_config(2, false));
  torch::NoGradGuard g;
  llama::KvCache cache;
  model->forward_cached(torch::zeros({1, 32}, torch::kLong), cache);
  try {
    model->forward_cached(torch::zeros({1, 1}, torch::kLong), cache);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("position 32 is past max_position_embeddings 32"),
              std::string::npos)
        << e.what();
  }
}

// ---- generate_llama --------------------------------------------------------------------

std::string temp_dir(const std::string& stem) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof(tmpl), "/tmp/fsdp_%s_XXXXXX", stem.c_str());
  return mkdtemp(tmpl);
}

/// A model directory from train_llama --steps 2 --export-hf (config.json +
/// model.safetensors), made once per test binary.
const std::string& trained_model_dir(bool tied) {
  static std::string dirs[2];
  std::string& dir = dirs[tied ? 1 : 0];
  if (!dir.empty()) return dir;
  const std::string root = temp_dir(tied ? "genllama_tied" : "genllama");
  std::vector<std::string> cmd{bin("train_llama"),
                               "--device",
                               "cpu",
                               "--steps",
                               "2",
                               "--n-layer",
                               "2",
                               "--n-head",
                               "4",
                               "--n-kv-head",
                               "2",
                               "--d-model",
                               "32",
                               "--block-size",
                               "32",
                               "--batch-size",
                               "4",
                               "--export-hf",
                               root + "/hf"};
  if (tied) cmd.push_back("--tie-embeddings");
  auto r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  dir = root + "/hf";
  return dir;
}

/// Copies the safetensors file `src` to `dst` without the tensor `name` (as transformers'
/// save_pretrained leaves out lm_head.weight when the embeddings are tied).
void copy_without_tensor(const std::string& src, const std::string& dst, const std::string& name) {
  std::ifstream in(src, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, ' ');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto h = nlohmann::json::parse(header);
  ASSERT_TRUE(h.contains(name)) << header;
  h.erase(name);
  std::string out_data;
  for (auto& [key, entry] : h.items()) {
    if (key == "__metadata__") continue;
    const auto begin = entry["data_offsets"][0].get<size_t>();
    const auto end = entry["data_offsets"][1].get<size_t>();
    entry["data_offsets"] = {out_data.size(), out_data.size() + (end - begin)};
    out_data += data.substr(begin, end - begin);
  }
  const std::string out_header = h.dump();
  const uint64_t m = out_header.size();
  std::ofstream out(dst, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&m), 8);
  out << out_header << out_data;
}

/// `src`'s config.json in `dst` with `from` replaced by `to`.
void copy_config_replacing(const std::string& src, const std::string& dst, const std::string& from,
                           const std::string& to) {
  std::ifstream in(src + "/config.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_NE(text.find(from), std::string::npos) << text;
  text.replace(text.find(from), from.size(), to);
  std::ofstream(dst + "/config.json") << text;
}

std::string line_after(const std::string& output, const std::string& prefix) {
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  }
  return "<no line starting with " + prefix + ">";
}

std::vector<int64_t> ids_of(const std::string& csv) {
  std::vector<int64_t> out;
  std::stringstream in(csv);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// With and without the KV cache the same tokens come out, on an exported model, tied and
// untied; --max-new-tokens of them, each a byte.
TEST(GenerateLlama, CompareNoCacheGivesIdenticalTokensOnATrainLlamaExport) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::string dir = trained_model_dir(tied);
    auto r = run_command({bin("generate_llama"), "--model", dir, "--prompt", "To be, or",
                          "--max-new-tokens", "12", "--device", "cpu", "--compare-no-cache"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto tokens = ids_of(line_after(r.output, "tokens: "));
    ASSERT_EQ(tokens.size(), 12u) << r.output;
    for (int64_t t : tokens) EXPECT_TRUE(t >= 0 && t < 256) << t;
    EXPECT_NE(line_after(r.output, "tokens_per_s: kv_cache=").find(" no_kv_cache="),
              std::string::npos)
        << r.output;
    // --no-kv-cache alone and --prompt-ids of the same bytes write the same tokens.
    auto base = run_command({bin("generate_llama"), "--model", dir, "--prompt-ids",
                             "84,111,32,98,101,44,32,111,114", "--max-new-tokens", "12", "--device",
                             "cpu", "--no-kv-cache"});
    ASSERT_EQ(base.exit_code, 0) << base.output;
    EXPECT_EQ(ids_of(line_after(base.output, "tokens: ")), tokens) << base.output;
  }
}

// --dump-logits writes T x vocab float32 values and their shape.
TEST(GenerateLlama, DumpLogitsWritesPromptLengthTimesVocabFloats) {
  const std::string dir = trained_model_dir(false);
  const std::string file = temp_dir("genllama_logits") + "/logits.f32";
  auto r = run_command({bin("generate_llama"), "--model", dir, "--prompt", "abcde",
                        "--max-new-tokens", "1", "--device", "cpu", "--dump-logits", file});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(std::filesystem::file_size(file), 5u * 256u * 4u);
  std::ifstream meta(file + ".json");
  std::string json((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  EXPECT_EQ(json, "{\"shape\":[5,256]}\n");
}

void expect_error(const std::vector<std::string>& args, int code, const std::string& message) {
  std::vector<std::string> cmd{bin("generate_llama")};
  cmd.insert(cmd.end(), args.begin(), args.end());
  auto r = run_command(cmd);
  EXPECT_EQ(r.exit_code, code) << r.output;
  EXPECT_NE(r.output.find("generate_llama: error: " + message), std::string::npos)
      << "expected: " << message << "\n"
      << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;  // no backtrace
}

TEST(GenerateLlama, BadModelDirectoriesAreErrorsNamingTheValueAndTheFix) {
  const std::string hint =
      "give a Hugging Face model directory (config.json and model.safetensors), e.g. one that "
      "train_llama --export-hf wrote";
  expect_error({"--prompt", "a", "--max-new-tokens", "1"}, 2, "--model is required; see --help");
  expect_error({"--model", "/nonexistent/m", "--prompt", "a", "--max-new-tokens", "1"}, 2,
               "--model /nonexistent/m: no such directory; " + hint);
  const std::string empty = temp_dir("genllama_empty");
  expect_error({"--model", empty, "--prompt", "a", "--max-new-tokens", "1"}, 2,
               "--model " + empty + " has no config.json; " + hint);
  // Another architecture's config.json.
  const std::string gpt2 = temp_dir("genllama_gpt2");
  std::ofstream(gpt2 + "/config.json") << "{\"model_type\": \"gpt2\"}\n";
  expect_error({"--model", gpt2, "--prompt", "a", "--max-new-tokens", "1"}, 2,
               gpt2 +
                   "/config.json: model_type \"gpt2\"; train_llama and generate_llama build "
                   "Llama models (model_type \"llama\", LlamaForCausalLM)");
  // Weights of another shape under the same names: a config.json with 3 layers beside
  // 2 layers' weights names the missing keys.
  const std::string src = trained_model_dir(false);
  const std::string three = temp_dir("genllama_three");
  std::filesystem::copy_file(src + "/model.safetensors", three + "/model.safetensors");
  copy_config_replacing(src, three, "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
  expect_error(
      {"--model", three, "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"}, 1,
      three + ": the weights do not match " + three +
          "/config.json's LlamaForCausalLM: missing model.layers.2.input_layernorm.weight, "
          "model.layers.2.self_attn.q_proj.weight, ");
  // Untied config.json beside weights without lm_head.weight.
  const std::string untied = temp_dir("genllama_untied");
  copy_without_tensor(src + "/model.safetensors", untied + "/model.safetensors", "lm_head.weight");
  std::filesystem::copy_file(src + "/config.json", untied + "/config.json");
  expect_error({"--model", untied, "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"}, 1,
               untied + ": the weights do not match " + untied +
                   "/config.json's LlamaForCausalLM: missing lm_head.weight (config.json has "
                   "tie_word_embeddings false, so lm_head.weight must be there); use the "
                   "config.json written with these weights");
  // A tensor the architecture lacks.
  const std::string tied_src = trained_model_dir(true);
  const std::string extra = temp_dir("genllama_extra");
  std::filesystem::copy_file(tied_src + "/model.safetensors", extra + "/model.safetensors");
  copy_config_replacing(tied_src, extra, "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
  expect_error({"--model", extra, "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"}, 1,
               extra + ": the weights do not match " + extra +
                   "/config.json's LlamaForCausalLM: unexpected model.layers.1.");
}

// Tied embeddings: a file without lm_head.weight (as transformers writes it) loads, and
// generates what the same weights with it generate.
TEST(GenerateLlama, TiedModelsLoadWithoutLmHeadWeight) {
  const std::string src = trained_model_dir(true);
  const std::string dir = temp_dir("genllama_nohead");
  copy_without_tensor(src + "/model.safetensors", dir + "/model.safetensors", "lm_head.weight");
  std::filesystem::copy_file(src + "/config.json", dir + "/config.json");
  auto with_head = run_command({bin("generate_llama"), "--model", src, "--prompt", "abc",
                                "--max-new-tokens", "8", "--device", "cpu"});
  auto without = run_command({bin("generate_llama"), "--model", dir, "--prompt", "abc",
                              "--max-new-tokens", "8", "--device", "cpu"});
  ASSERT_EQ(with_head.exit_code, 0) << with_head.output;
  ASSERT_EQ(without.exit_code, 0) << without.output;
  EXPECT_EQ(ids_of(line_after(without.output, "tokens: ")).size(), 8u);
  EXPECT_EQ(line_after(without.output, "tokens: "), line_after(with_head.output, "tokens: "));
}

TEST(GenerateLlama, BadPromptsAndLengthsAreErrorsNamingTheValueAndTheFix) {
  const std::string dir = trained_model_dir(false);  // max_position_embeddings 32
  const std::string cfg = dir + "/config.json";
  expect_error({"--model", dir, "--prompt", std::string(33, 'a'), "--max-new-tokens", "1"}, 2,
               "the prompt is 33 tokens, more than max_position_embeddings 32 of " + cfg +
                   "; shorten the prompt");
  expect_error({"--model", dir, "--prompt", std::string(30, 'a'), "--max-new-tokens", "4"}, 2,
               "the prompt's 30 tokens and --max-new-tokens 4 need 33 positions, more than "
               "max_position_embeddings 32 of " +
                   cfg + "; use --max-new-tokens 3 or less");
  expect_error({"--model", dir, "--prompt-ids", "3,x", "--max-new-tokens", "1"}, 2,
               "--prompt-ids 3,x: 'x' is not a token id; give comma-separated integers, e.g. "
               "3,5,7");
  expect_error({"--model", dir, "--prompt-ids", "3,256", "--max-new-tokens", "1"}, 2,
               "--prompt-ids: token 256 is not in 0..255 (vocab_size 256)");
  expect_error({"--model", dir, "--prompt", "a", "--prompt-ids", "3", "--max-new-tokens", "1"}, 2,
               "give one of --prompt TEXT or --prompt-ids 3,5,7");
  expect_error({"--model", dir, "--prompt", "a", "--max-new-tokens", "0"}, 2,
               "--max-new-tokens 0 must be positive");
  expect_error({"--model", dir, "--prompt", "a", "--max-new-tokens", "1", "--dtype", "fp16"}, 2,
               "--dtype fp16 is not a compute dtype here; use fp32 or bf16");
  expect_error({"--model", dir, "--prompt", "a", "--max-new-tokens", "1", "--no-kv-cache",
                "--compare-no-cache"},
               2, "--no-kv-cache and --compare-no-cache exclude each other");
}

}  // namespace

}  // namespace test_llama_cases
