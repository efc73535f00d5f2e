#pragma once
// The GPT of docs/design.md, "Contracts": byte-level, pre-LayerNorm blocks, untied lm_head.
// Blocks are wrap points (fsdp::FullyShardedModule<Block>): unsharded they are plain
// calls, and fsdp::fully_shard can make each one a unit. FQNs are
// wte.weight, wpe.weight, blocks.{i}.ln1.weight, blocks.{i}.attn.qkv.weight, ...,
// ln_f.weight, lm_head.weight, so other frameworks can load the weights.

#include <fsdp/fully_sharded_module.h>
#include <fsdp/pipeline.h>

#include "../common/attention.h"
#include "../common/layers.h"
#include "../common/trainer/lm_config.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace gpt {

using Config = lm::Config;

/// GPT-2 style initial weights for the parameters under `m`: N(0, 0.02) weights, zero
/// biases, LayerNorms left at one and zero. Every part initialises itself as it is built,
/// in layer order (the embeddings, each block before its wrap point is built, which
/// fsdp::make_sharded shards then, the head): so the same seed gives the same weights
/// whether the model is constructed in full, sharded, or one pipeline stage at a time
/// (layer_factory), at any world size.
inline void init_gpt2(torch::nn::Module& m) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) {
    const auto& n = p.key();
    if (n.find("ln") != std::string::npos) continue;
    if (n.size() >= 4 && n.compare(n.size() - 4, 4, "bias") == 0) {
      p.value().zero_();
    } else {
      p.value().normal_(0.0, 0.02);
    }
  }
}

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& c)
      : n_head_(c.n_head),
        kernel_(c.attention),
        dropout_(c.dropout),
        qkv(register_module("qkv", torch::nn::Linear(c.d_model, 3 * c.d_model))),
        proj(register_module("proj", torch::nn::Linear(c.d_model, c.d_model))),
        resid_drop(register_module("resid_drop", torch::nn::Dropout(c.dropout))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head_;
    auto parts = qkv(x).split(C, /*dim=*/2);
    auto heads = [&](const torch::Tensor& t) {
      return t.view({B, T, n_head_, hd}).transpose(1, 2);
    };
    // Causal attention (examples/common/attention.h): the fused kernel, or the explicit
    // softmax; dropout on the attention probabilities either way.
    examples::AttentionOptions o;
    o.kernel = kernel_;
    o.dropout_p = dropout_;
    o.training = is_training();
    auto y = examples::causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), o)
                 .transpose(1, 2)
                 .contiguous()
                 .view({B, T, C});
    return resid_drop(proj(y));
  }

 private:
  int64_t n_head_;
  examples::AttentionKernel kernel_;
  double dropout_;

 public:
  torch::nn::Linear qkv, proj;
  torch::nn::Dropout resid_drop;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& c)
      : fc(register_module("fc", torch::nn::Linear(c.d_model, 4 * c.d_model))),
        proj(register_module("proj", torch::nn::Linear(4 * c.d_model, c.d_model))),
        drop(register_module("drop", torch::nn::Dropout(c.dropout))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(proj(torch::gelu(fc(x))));  // exact (erf) GELU
  }
  torch::nn::Linear fc, proj;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const Config& c)
      : ln1(register_module(
            "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(1e-5)))),
        attn(register_module("attn", Attention(c))),
        ln2(register_module(
            "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(1e-5)))),
        mlp(register_module("mlp", Mlp(c))) {
    init_gpt2(*this);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + mlp(ln2(x));
  }
  torch::nn::LayerNorm ln1;
  Attention attn;
  torch::nn::LayerNorm ln2;
  Mlp mlp;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const Config& c)
      : config(c),
        wte(register_module("wte", torch::nn::Embedding(c.vocab_size, c.d_model))),
        wpe(register_module("wpe", torch::nn::Embedding(c.block_size, c.d_model))) {
    init_gpt2(*wte);
    init_gpt2(*wpe);
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layer; ++i) {
      blocks.emplace_back(Block(c));
      list->push_back(blocks.back());
    }
    ln_f = register_module(
        "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(1e-5)));
    lm_head = register_module(
        "lm_head",
        torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)));
    init_gpt2(*lm_head);
  }

  /// idx: (B, T) int64 tokens -> (B, T, vocab) logits.
  torch::Tensor forward(const torch::Tensor& idx) {
    const auto T = idx.size(1);
    TORCH_CHECK(T <= config.block_size, "sequence length ", T, " exceeds block_size ",
                config.block_size);
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    auto x = wte(idx) + wpe(pos);
    for (auto& b : blocks) x = b(x);
    return lm_head(ln_f(x));
  }

  Config config;
  torch::nn::Embedding wte, wpe;
  std::vector<fsdp::FullyShardedModule<Block>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(GPT);

/// The GPT's first pipeline layer: token and position embeddings.
class EmbedImpl : public torch::nn::Module {
 public:
  EmbedImpl(torch::nn::Embedding wte_, torch::nn::Embedding wpe_)
      : wte(register_module("wte", std::move(wte_))),
        wpe(register_module("wpe", std::move(wpe_))) {}
  torch::Tensor forward(torch::Tensor idx) {
    auto pos =
        torch::arange(idx.size(1), torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    return wte(idx) + wpe(pos);
  }
  torch::nn::Embedding wte, wpe;
};
TORCH_MODULE(Embed);

/// The GPT's last pipeline layer: the final norm and lm_head.
class HeadImpl : public torch::nn::Module {
 public:
  HeadImpl(torch::nn::LayerNorm ln_f_, torch::nn::Linear lm_head_)
      : ln_f(register_module("ln_f", std::move(ln_f_))),
        lm_head(register_module("lm_head", std::move(lm_head_))) {}
  torch::Tensor forward(torch::Tensor x) { return lm_head(ln_f(x)); }
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear lm_head;
};
TORCH_MODULE(Head);

/// `model` as pipeline layers (fsdp::pipeline): "embed", "block0" .. "block{n-1}", "head",
/// sharing its modules, so the weights are its own. Their FQNs differ from the GPT's
/// (embed.wte.weight for wte.weight, block3.ln1.weight for blocks.3.ln1.weight).
inline torch::nn::Sequential as_layers(const GPT& model) {
  torch::nn::Sequential seq;
  seq->push_back("embed", Embed(model->wte, model->wpe));
  for (size_t i = 0; i < model->blocks.size(); ++i)
    seq->push_back("block" + std::to_string(i), model->blocks[i]->module());
  seq->push_back("head", Head(model->ln_f, model->lm_head));
  return seq;
}

/// The GPT's pipeline layers (as_layers' names and modules) made one at a time, for
/// fsdp::pipeline to build only a rank's own stage: layer i draws from the generator what
/// GPT(c) draws for it, so every layout of stages starts from GPT(c)'s weights.
inline fsdp::PipelineLayers layer_factory(const Config& c) {
  fsdp::PipelineLayers layers;
  layers.count = c.n_layer + 2;
  layers.make = [c](int64_t i) -> std::pair<std::string, torch::nn::AnyModule> {
    if (i == 0) {
      torch::nn::Embedding wte(c.vocab_size, c.d_model), wpe(c.block_size, c.d_model);
      init_gpt2(*wte);
      init_gpt2(*wpe);
      return {"embed", torch::nn::AnyModule(Embed(wte, wpe))};
    }
    if (i <= c.n_layer) return {"block" + std::to_string(i - 1), torch::nn::AnyModule(Block(c))};
    torch::nn::LayerNorm ln_f(torch::nn::LayerNormOptions({c.d_model}).eps(1e-5));
    torch::nn::Linear lm_head(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false));
    init_gpt2(*lm_head);
    return {"head", torch::nn::AnyModule(Head(ln_f, lm_head))};
  };
  return layers;
}

/// A parameter's name among as_layers' layers as the GPT names it (the checkpoint
/// contract): "embed.wte.weight" -> "wte.weight", "block3.ln1.weight" ->
/// "blocks.3.ln1.weight", "head.lm_head.weight" -> "lm_head.weight".
inline std::string layer_param_name(const std::string& name) {
  for (const char* layer : {"embed.", "head."})
    if (name.rfind(layer, 0) == 0) return name.substr(std::strlen(layer));
  const size_t dot = name.find('.');
  examples::check_layer_param_name(name.rfind("block", 0) == 0 && dot != std::string::npos &&
                                       dot > 5 && name.find_first_not_of("0123456789", 5) == dot,
                                   "gpt::layer_param_name", name);
  return "blocks." + name.substr(5, dot - 5) + name.substr(dot);
}

/// Mean next-token cross-entropy of `model` on (B, T+1) token rows.
template <class Model>
torch::Tensor loss_on(Model& model, const torch::Tensor& rows) {
  auto x = rows.narrow(1, 0, rows.size(1) - 1);
  auto y = rows.narrow(1, 1, rows.size(1) - 1);
  auto logits = model->forward(x);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              y.reshape({-1}));
}

}  // namespace gpt
