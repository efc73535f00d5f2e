// The example models' two attention kernels (examples/common/attention.h): the fused
// kernel (at::scaled_dot_product_attention, the default) against the explicit softmax
// (--attention math), on the shapes training and generation give it, in the GPT and the
// Llama; its causality, built on purpose; and dropout through the kernel, which activation
// checkpointing must redraw exactly.
#include "support/models.h"

#include "../examples/llama/llama_model.h"

#include <fsdp/activation_checkpoint.h>

#include <gtest/gtest.h>

using namespace fsdp::testing;
// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_attention_cases {

using examples::AttentionKernel;

namespace {

/// max |a - b| / max |b|.
double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

torch::Tensor attend(AttentionKernel k, const torch::Tensor& q, const torch::Tensor& key,
                     const torch::Tensor& v) {
  examples::AttentionOptions o;
  o.kernel = k;
  return examples::causal_attention(q, key, v, o);
}

struct Shape {
  int64_t heads, kv_heads, queries, keys;
};

// Training (T = S), grouped-query attention, one decoding step after a cache (T = 1) and a
// chunk of queries after a cache (1 < T < S, the explicit bottom-right mask).
TEST(Attention, FusedKernelEqualsTheExplicitSoftmaxOnEveryShape) {
  for (const Shape s : {Shape{4, 4, 16, 16}, Shape{4, 2, 16, 16}, Shape{4, 1, 1, 9},
                        Shape{4, 2, 5, 12}, Shape{6, 3, 1, 1}}) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + ", " +
                 std::to_string(s.queries) + " queries over " + std::to_string(s.keys) + " keys");
    torch::manual_seed(11);
    auto q = torch::randn({2, s.heads, s.queries, 8});
    auto k = torch::randn({2, s.kv_heads, s.keys, 8});
    auto v = torch::randn({2, s.kv_heads, s.keys, 8});
    auto fused = attend(AttentionKernel::kSdpa, q, k, v);
    auto math = attend(AttentionKernel::kMath, q, k, v);
    ASSERT_EQ(fused.sizes(), (std::vector<int64_t>{2, s.heads, s.queries, 8}));
    ASSERT_EQ(math.sizes(), fused.sizes());
    EXPECT_LE((fused - math).abs().max().item<double>(), 1e-5);
  }
}

// Query i of T (at position S - T + i) must not read keys or values after its position:
// changing those keys and values leaves it unchanged, and changing the one at its position
// changes it. Built for each query of a chunk after a cache, in both kernels.
TEST(Attention, NoQueryReadsAKeyAfterItsPosition) {
  const int64_t T = 4, S = 10;
  torch::manual_seed(12);
  auto q = torch::randn({1, 2, T, 8});
  auto k = torch::randn({1, 2, S, 8});
  auto v = torch::randn({1, 2, S, 8});
  for (auto kernel : {AttentionKernel::kSdpa, AttentionKernel::kMath}) {
    SCOPED_TRACE(examples::attention_name(kernel));
    auto base = attend(kernel, q, k, v);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t pos = S - T + i;
      auto k2 = k.clone(), v2 = v.clone();
      if (pos + 1 < S) {
        k2.narrow(2, pos + 1, S - pos - 1).normal_();
        v2.narrow(2, pos + 1, S - pos - 1).normal_();
      }
      auto later = attend(kernel, q, k2, v2);
      EXPECT_TRUE(torch::allclose(later.select(2, i), base.select(2, i), 0, 1e-6)) << "query " << i;
      auto k3 = k.clone();
      k3.narrow(2, pos, 1).mul_(-3);
      auto own = attend(kernel, q, k3, v);
      EXPECT_GT((own.select(2, i) - base.select(2, i)).abs().max().item<double>(), 1e-4)
          << "query " << i << " ignores the key at its own position";
    }
  }
}

gpt::Config gpt_config(AttentionKernel kernel) {
  auto c = small_gpt_config();
  c.attention = kernel;
  return c;
}

// The GPT's logits, loss and gradients with the fused kernel are the explicit path's,
// within fp32 rounding.
TEST(Attention, GptLogitsAndGradientsOfTheFusedKernelMatchTheMathPath) {
  torch::manual_seed(21);
  gpt::GPT fused(gpt_config(AttentionKernel::kSdpa));
  torch::manual_seed(21);
  gpt::GPT math(gpt_config(AttentionKernel::kMath));
  auto rows = gpt_batch(0, 4, 16);
  {
    torch::NoGradGuard g;
    fused->eval();
    math->eval();
    auto x = rows.narrow(1, 0, 16);
    EXPECT_LE(relative_difference(fused->forward(x), math->forward(x)), 1e-5);
  }
  fused->train();
  math->train();
  auto lf = gpt::loss_on(fused, rows), lm = gpt::loss_on(math, rows);
  EXPECT_NEAR(lf.item<double>(), lm.item<double>(), 1e-5);
  lf.backward();
  lm.backward();
  auto pf = fused->named_parameters(), pm = math->named_parameters();
  for (const auto& p : pf) {
    SCOPED_TRACE(p.key());
    ASSERT_TRUE(p.value().grad().defined());
    EXPECT_LE(relative_difference(p.value().grad(), pm[p.key()].grad()), 1e-4);
  }
}

llama::Config llama_config(int64_t n_kv_head, AttentionKernel kernel) {
  llama::Config c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = n_kv_head;
  c.d_model = 32;
  c.intermediate_size = 48;
  c.block_size = 32;
  c.vocab_size = 64;
  c.rope_theta = 50000.0;
  c.attention = kernel;
  return c;
}

// The Llama with the fused kernel gives the explicit path's logits, uncached and through
// the KV cache (a prompt, single tokens, then a chunk of three), with grouped-query
// attention and without.
TEST(Attention, LlamaLogitsOfTheFusedKernelMatchTheMathPathWithAndWithoutTheCache) {
  for (int64_t kv : {2, 4}) {
    SCOPED_TRACE("n_kv_head " + std::to_string(kv));
    torch::manual_seed(31);
    llama::Llama fused(llama_config(kv, AttentionKernel::kSdpa));
    torch::manual_seed(31);
    llama::Llama math(llama_config(kv, AttentionKernel::kMath));
    fused->eval();
    math->eval();
    torch::NoGradGuard g;
    const int64_t T = 20;
    auto idx = torch::randint(0, 64, {2, T}, torch::kLong);
    auto reference = math->forward(idx);
    EXPECT_LE(relative_difference(fused->forward(idx), reference), 1e-5);

    llama::KvCache cache;
    std::vector<torch::Tensor> parts{fused->forward_cached(idx.narrow(1, 0, 7), cache)};
    for (int64_t t = 7; t < 12; ++t)
      parts.push_back(fused->forward_cached(idx.narrow(1, t, 1), cache));
    parts.push_back(fused->forward_cached(idx.narrow(1, 12, 3), cache));  // 3 after 12 cached
    parts.push_back(fused->forward_cached(idx.narrow(1, 15, T - 15), cache));
    EXPECT_EQ(cache.length, T);
    EXPECT_LE(relative_difference(torch::cat(parts, 1), reference), 1e-5);
  }
}

// Dropout goes through the kernel: a training forward at dropout 0.1 differs from the
// evaluation forward and repeats under the same seed; activation checkpointing recomputes
// the block under the forward's RNG state, so the gradients (and the RNG stream after
// backward) are bitwise those of the run without it. For both kernels.
TEST(Attention, DropoutThroughTheKernelIsRedrawnExactlyByActivationCheckpointing) {
  for (auto kernel : {AttentionKernel::kSdpa, AttentionKernel::kMath}) {
    SCOPED_TRACE(examples::attention_name(kernel));
    auto cfg = gpt_config(kernel);
    cfg.dropout = 0.1;
    torch::manual_seed(41);
    gpt::Attention attn(cfg);
    auto x0 = torch::randn({2, cfg.block_size, cfg.d_model});
    {
      torch::NoGradGuard g;
      attn->eval();
      auto clean = attn(x0);
      attn->train();
      torch::manual_seed(6);
      auto a = attn(x0);
      torch::manual_seed(6);
      auto b = attn(x0);
      EXPECT_TRUE(torch::equal(a, b)) << "the same seed must draw the same mask";
      EXPECT_GT((a - clean).abs().max().item<double>(), 1e-3) << "dropout was not applied";
    }
    torch::manual_seed(42);
    gpt::Block block(cfg);
    auto run = [&](bool ckpt) {
      block->zero_grad();
      auto x = x0.clone().requires_grad_(true);
      torch::manual_seed(5);
      auto y =
          ckpt ? fsdp::activation_checkpoint([&](const torch::Tensor& t) { return block(t); }, x)
               : block(x);
      y.pow(2).sum().backward();
      std::vector<torch::Tensor> g;
      for (auto& p : block->parameters()) g.push_back(p.grad().clone());
      g.push_back(x.grad().clone());
      g.push_back(torch::rand({1}));
      return g;
    };
    auto plain = run(false), ckpt = run(true);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << i;
  }
}

// Shapes no caller should pass are refused, naming them, in both kernels.
TEST(Attention, HeadsThatDoNotGroupAndMoreQueriesThanKeysAreRefused) {
  for (auto kernel : {AttentionKernel::kSdpa, AttentionKernel::kMath}) {
    SCOPED_TRACE(examples::attention_name(kernel));
    auto q = torch::randn({1, 4, 6, 8});
    auto expect_error = [&](const torch::Tensor& k, const std::string& message) {
      try {
        attend(kernel, q, k, k);
        ADD_FAILURE() << "accepted: " << message;
      } catch (const c10::Error& e) {
        EXPECT_EQ(e.what_without_backtrace(), message);
      }
    };
    expect_error(torch::randn({1, 3, 6, 8}),
                 "causal_attention: 3 key/value heads do not divide 4 query heads");
    expect_error(torch::randn({1, 4, 5, 8}), "causal_attention: 5 key positions for 6 queries");
  }
}

TEST(Attention, AnUnknownKernelIsRefusedNamingTheValueAndTheChoices) {
  EXPECT_EQ(examples::parse_attention_kernel("sdpa"), AttentionKernel::kSdpa);
  EXPECT_EQ(examples::parse_attention_kernel("math"), AttentionKernel::kMath);
  try {
    examples::parse_attention_kernel("flash");
    FAIL() << "flash was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "--attention flash is not an attention kernel; use sdpa (the fused kernel, the "
                 "default) or math (the explicit softmax)");
  }
}

}  // namespace

}  // namespace test_attention_cases
