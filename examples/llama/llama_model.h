#pragma once
// A Llama-architecture decoder (transformers' LlamaForCausalLM, without its rope scaling
// variants): RMSNorm, rotary positions (rope_theta; the rotate-half form), a SwiGLU MLP,
// grouped-query attention (num_key_value_heads) and optional tied embeddings. Parameter
// names are transformers' own, so the safetensors this library exports load into
// LlamaForCausalLM as they are, and its checkpoints load here:
//   model.embed_tokens.weight, model.layers.{i}.input_layernorm.weight,
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
//   model.layers.{i}.post_attention_layernorm.weight,
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.norm.weight, lm_head.weight
// (lm_head.weight is the embedding itself when tied; our exports write it under both names,
// transformers under the first only, and either loads).
// Each decoder layer is a wrap point (fsdp::FullyShardedModule<DecoderLayer>).
// The forward computes what transformers does: with --attention math its eager attention,
// in the same order; by default the fused kernel, as its "sdpa" attention. With a KvCache
// it appends each new position's keys and values and attends over the cache.

#include <fsdp/fully_sharded_module.h>

#include <fsdp/pipeline.h>
#include "../common/layers.h"

#include "../common/attention.h"
#include "../common/trainer/lm_config.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace llama {

struct Config {
  int64_t n_layer = 2;              ///< num_hidden_layers
  int64_t n_head = 4;               ///< num_attention_heads
  int64_t n_kv_head = 2;            ///< num_key_value_heads (divides n_head)
  int64_t d_model = 64;             ///< hidden_size
  int64_t intermediate_size = 176;  ///< the SwiGLU MLP's width
  int64_t block_size = 64;          ///< max_position_embeddings
  int64_t vocab_size = 256;         ///< byte-level by default
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_embeddings = false;  ///< tie_word_embeddings
  /// The fused kernel or the explicit softmax (examples/common/attention.h).
  examples::AttentionKernel attention = examples::AttentionKernel::kSdpa;
  int64_t head_dim() const { return d_model / n_head; }
};

/// The Llama fields of the trainer's shared Config (max_position_embeddings: max_positions,
/// or block_size when that is 0).
inline Config from_lm(const lm::Config& c) {
  Config l;
  l.n_layer = c.n_layer;
  l.n_head = c.n_head;
  l.n_kv_head = c.n_kv_head;
  l.d_model = c.d_model;
  l.intermediate_size = c.intermediate_size;
  l.block_size = c.max_positions > 0 ? c.max_positions : c.block_size;
  l.vocab_size = c.vocab_size;
  l.rope_theta = c.rope_theta;
  l.rms_norm_eps = c.rms_norm_eps;
  l.tie_embeddings = c.tie_embeddings;
  l.attention = c.attention;
  return l;
}

/// transformers' _init_weights for Llama: N(0, initializer_range = 0.02) for linear and
/// embedding weights; RMSNorm weights stay one.
inline void init_llama(torch::nn::Module& m) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) {
    if (p.key().find("norm") != std::string::npos) continue;
    p.value().normal_(0.0, 0.02);
  }
}

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps)
      : eps_(eps), weight(register_parameter("weight", torch::ones({dim}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    // In fp32 whatever the input, as transformers' LlamaRMSNorm.
    auto h = x.to(torch::kFloat);
    h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * h.to(x.scalar_type());
  }

 private:
  double eps_;

 public:
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// cos and sin of the rotary angles at `positions` (T,), each (T, head_dim) in `dtype`.
inline std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const Config& c,
                                                            const torch::Tensor& positions,
                                                            torch::Dtype dtype) {
  const int64_t d = c.head_dim();
  auto opts = torch::TensorOptions().dtype(torch::kFloat).device(positions.device());
  auto exponent = torch::arange(0, d, 2, torch::TensorOptions().dtype(torch::kLong))
                      .to(torch::kFloat)
                      .div(static_cast<double>(d));
  auto inv_freq = torch::pow(torch::tensor(c.rope_theta, torch::kFloat), exponent)
                      .reciprocal()
                      .to(positions.device());
  auto freqs = torch::outer(positions.to(opts), inv_freq);  // (T, d/2)
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

/// The cos and sin tables of positions 0 .. T-1, made once per (T, device, dtype) and
/// shared by every layer of a model (each layer's forward would otherwise make the same
/// tables again, in training and in each recompute).
class RopeTables {
 public:
  explicit RopeTables(const Config& c) : cfg_(c) {}
  std::pair<torch::Tensor, torch::Tensor> get(int64_t T, const torch::Device& device,
                                              torch::Dtype dtype) {
    if (!cos_.defined() || cos_.size(0) != T || cos_.device() != device ||
        cos_.scalar_type() != dtype) {
      torch::NoGradGuard constant;
      std::tie(cos_, sin_) = rope_cos_sin(
          cfg_, torch::arange(T, torch::TensorOptions(torch::kLong).device(device)), dtype);
    }
    return {cos_, sin_};
  }

 private:
  Config cfg_;
  torch::Tensor cos_, sin_;
};

inline torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

/// One layer's cached keys and values, (B, n_kv_head, positions so far, head_dim).
struct LayerCache {
  torch::Tensor k, v;
};
/// generate's cache: one entry per layer, and how many positions it holds.
struct KvCache {
  std::vector<LayerCache> layers;
  int64_t length = 0;
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& c)
      : cfg_(c),
        q_proj(register_module(
            "q_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.d_model, c.n_head * c.head_dim()).bias(false)))),
        k_proj(register_module(
            "k_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.d_model, c.n_kv_head * c.head_dim()).bias(false)))),
        v_proj(register_module(
            "v_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.d_model, c.n_kv_head * c.head_dim()).bias(false)))),
        o_proj(register_module(
            "o_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.n_head * c.head_dim(), c.d_model).bias(false)))) {}

  /// x: (B, T, d_model) at positions [start, start + T); `cache` (optional) holds the
  /// earlier positions' keys and values and receives these.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        LayerCache* cache = nullptr) {
    const int64_t B = x.size(0), T = x.size(1), hd = cfg_.head_dim();
    auto q = q_proj(x).view({B, T, cfg_.n_head, hd}).transpose(1, 2);
    auto k = k_proj(x).view({B, T, cfg_.n_kv_head, hd}).transpose(1, 2);
    auto v = v_proj(x).view({B, T, cfg_.n_kv_head, hd}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (cache != nullptr) {
      if (cache->k.defined()) {
        k = torch::cat({cache->k, k}, 2);
        v = torch::cat({cache->v, v}, 2);
      }
      cache->k = k;
      cache->v = v;
    }
    // Causal attention over the cached positions and these (examples/common/attention.h):
    // the fused kernel reads grouped key/value heads in place where it can; the explicit
    // path repeats them and takes the softmax in fp32, as transformers' eager attention.
    examples::AttentionOptions o;
    o.kernel = cfg_.attention;
    o.softmax_in_fp32 = true;
    auto y =
        examples::causal_attention(q, k, v, o).transpose(1, 2).reshape({B, T, cfg_.n_head * hd});
    return o_proj(y);
  }

 private:
  Config cfg_;

 public:
  torch::nn::Linear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& c)
      : gate_proj(register_module(
            "gate_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.d_model, c.intermediate_size).bias(false)))),
        up_proj(register_module(
            "up_proj", torch::nn::Linear(
                           torch::nn::LinearOptions(c.d_model, c.intermediate_size).bias(false)))),
        down_proj(register_module(
            "down_proj",
            torch::nn::Linear(
                torch::nn::LinearOptions(c.intermediate_size, c.d_model).bias(false)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
  }
  torch::nn::Linear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(Mlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  /// `rope`: the model's shared tables (a layer built alone makes its own).
  explicit DecoderLayerImpl(const Config& c, std::shared_ptr<RopeTables> rope = nullptr)
      : rope_(rope ? std::move(rope) : std::make_shared<RopeTables>(c)),
        input_layernorm(register_module("input_layernorm", RMSNorm(c.d_model, c.rms_norm_eps))),
        self_attn(register_module("self_attn", Attention(c))),
        post_attention_layernorm(
            register_module("post_attention_layernorm", RMSNorm(c.d_model, c.rms_norm_eps))),
        mlp(register_module("mlp", Mlp(c))) {
    init_llama(*this);
  }
  /// Training and evaluation: positions 0 .. T-1, no cache.
  torch::Tensor forward(torch::Tensor x) {
    auto [cos, sin] = rope_->get(x.size(1), x.device(), x.scalar_type());
    return forward_at(x, cos, sin, nullptr);
  }
  torch::Tensor forward_at(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                           LayerCache* cache) {
    x = x + self_attn(input_layernorm(x), cos, sin, cache);
    return x + mlp(post_attention_layernorm(x));
  }

 private:
  std::shared_ptr<RopeTables> rope_;

 public:
  RMSNorm input_layernorm;
  Attention self_attn;
  RMSNorm post_attention_layernorm;
  Mlp mlp;
};
TORCH_MODULE(DecoderLayer);

/// transformers' LlamaModel: the embedding, the layers and the final norm.
class ModelImpl : public torch::nn::Module {
 public:
  explicit ModelImpl(const Config& c)
      : embed_tokens(
            register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.d_model))) {
    init_llama(*embed_tokens);  // in layer order (layer_factory draws the same)
    auto list = register_module("layers", torch::nn::ModuleList());
    auto rope = std::make_shared<RopeTables>(c);
    for (int64_t i = 0; i < c.n_layer; ++i) {
      layers.emplace_back(DecoderLayer(c, rope));
      list->push_back(layers.back());
    }
    norm = register_module("norm", RMSNorm(c.d_model, c.rms_norm_eps));
  }
  torch::nn::Embedding embed_tokens;
  std::vector<fsdp::FullyShardedModule<DecoderLayer>> layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Model);

/// The output projection: logits = x W^T. Its weight is its own, or the embedding's
/// tensor itself (tie_word_embeddings: one tensor under both names, in one unit).
class HeadImpl : public torch::nn::Module {
 public:
  explicit HeadImpl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(Head);

/// transformers' LlamaForCausalLM.
class LlamaImpl : public torch::nn::Module {
 public:
  explicit LlamaImpl(const Config& c) : config(c), model(register_module("model", Model(c))) {
    lm_head = register_module("lm_head",
                              Head(c.tie_embeddings ? model->embed_tokens->weight
                                                    : torch::empty({c.vocab_size, c.d_model})));
    if (!c.tie_embeddings) init_llama(*lm_head);
  }

  /// idx: (B, T) int64 tokens at positions 0 .. T-1 -> (B, T, vocab) logits.
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK(idx.size(1) <= config.block_size, "sequence length ", idx.size(1),
                " exceeds max_position_embeddings ", config.block_size);
    auto x = model->embed_tokens(idx);
    for (auto& layer : model->layers) x = layer(x);
    return lm_head(model->norm(x));
  }

  /// generate: the logits of `idx` (B, T), the positions after the cache's, appending
  /// their keys and values to `cache`. Unsharded models only (a plain module).
  torch::Tensor forward_cached(const torch::Tensor& idx, KvCache& cache) {
    const int64_t start = cache.length, T = idx.size(1);
    TORCH_CHECK(start + T <= config.block_size, "position ", start + T - 1,
                " is past max_position_embeddings ", config.block_size);
    if (cache.layers.empty()) cache.layers.resize(static_cast<size_t>(config.n_layer));
    auto x = model->embed_tokens(idx);
    auto positions =
        torch::arange(start, start + T, torch::TensorOptions(torch::kLong).device(idx.device()));
    auto [cos, sin] = rope_cos_sin(config, positions, x.scalar_type());
    for (size_t i = 0; i < model->layers.size(); ++i)
      x = model->layers[i]->module()->forward_at(x, cos, sin, &cache.layers[i]);
    cache.length = start + T;
    return lm_head(model->norm(x));
  }

  Config config;
  Model model;
  Head lm_head{nullptr};
};
TORCH_MODULE(Llama);

/// The final norm and lm_head: a pipeline's last layer.
class NormHeadImpl : public torch::nn::Module {
 public:
  NormHeadImpl(RMSNorm norm_, Head lm_head_)
      : norm(register_module("norm", std::move(norm_))),
        lm_head(register_module("lm_head", std::move(lm_head_))) {}
  torch::Tensor forward(torch::Tensor x) { return lm_head(norm(x)); }
  RMSNorm norm;
  Head lm_head;
};
TORCH_MODULE(NormHead);

/// `model` as pipeline layers (fsdp::pipeline): "embed_tokens", "layer0" .. "layer{n-1}",
/// "head", sharing its modules. Untied embeddings only: a tied embedding would be in the
/// first stage and lm_head in the last.
inline torch::nn::Sequential as_layers(const Llama& model) {
  TORCH_CHECK(!model->config.tie_embeddings,
              "pipeline stages need untied embeddings (the embedding is the first stage's, "
              "lm_head the last's)");
  torch::nn::Sequential seq;
  seq->push_back("embed_tokens", model->model->embed_tokens);
  for (size_t i = 0; i < model->model->layers.size(); ++i)
    seq->push_back("layer" + std::to_string(i), model->model->layers[i]->module());
  seq->push_back("head", NormHead(model->model->norm, model->lm_head));
  return seq;
}

/// The pipeline layers of Llama(c) (as_layers' names and modules) made one at a time, for
/// fsdp::pipeline to build only a rank's own stage: layer i draws from the generator what
/// Llama(c) draws for it. Untied embeddings only, as as_layers.
inline fsdp::PipelineLayers layer_factory(const Config& c) {
  TORCH_CHECK(!c.tie_embeddings,
              "pipeline stages need untied embeddings (the embedding is the first stage's, "
              "lm_head the last's)");
  fsdp::PipelineLayers layers;
  layers.count = c.n_layer + 2;
  auto rope = std::make_shared<RopeTables>(c);  // shared by the layers a rank makes
  layers.make = [c, rope](int64_t i) -> std::pair<std::string, torch::nn::AnyModule> {
    if (i == 0) {
      torch::nn::Embedding embed(c.vocab_size, c.d_model);
      init_llama(*embed);
      return {"embed_tokens", torch::nn::AnyModule(embed)};
    }
    if (i <= c.n_layer)
      return {"layer" + std::to_string(i - 1), torch::nn::AnyModule(DecoderLayer(c, rope))};
    Head lm_head(torch::empty({c.vocab_size, c.d_model}));
    init_llama(*lm_head);
    return {"head", torch::nn::AnyModule(NormHead(RMSNorm(c.d_model, c.rms_norm_eps), lm_head))};
  };
  return layers;
}

/// A parameter's name among as_layers' layers as transformers' LlamaForCausalLM names it:
/// "embed_tokens.weight" -> "model.embed_tokens.weight", "layer3.mlp.up_proj.weight" ->
/// "model.layers.3.mlp.up_proj.weight", "head.norm.weight" -> "model.norm.weight",
/// "head.lm_head.weight" -> "lm_head.weight".
inline std::string layer_param_name(const std::string& name) {
  if (name.rfind("embed_tokens.", 0) == 0 || name.rfind("head.norm.", 0) == 0)
    return "model." + (name[0] == 'h' ? name.substr(5) : name);
  if (name.rfind("head.", 0) == 0) return name.substr(5);
  const size_t dot = name.find('.');
  examples::check_layer_param_name(name.rfind("layer", 0) == 0 && dot != std::string::npos &&
                                       dot > 5 && name.find_first_not_of("0123456789", 5) == dot,
                                   "llama::layer_param_name", name);
  return "model.layers." + name.substr(5, dot - 5) + name.substr(dot);
}

}  // namespace llama
