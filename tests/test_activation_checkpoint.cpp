// Standalone activation checkpointing: gradients equal the plain ones bitwise (fp32, CPU),
// dropout included, and each input/output case of the utility behaves.
#include "support/models.h"

#include <fsdp/activation_checkpoint.h>

#include <gtest/gtest.h>

using namespace fsdp;
using namespace fsdp::testing;

namespace {

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << i;
    if (a[i].defined()) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
  }
}

TEST(ActivationCheckpoint, GptBlockWithDropoutGivesBitwiseEqualGradients) {
  auto cfg = small_gpt_config();
  cfg.dropout = 0.1;
  torch::manual_seed(71);
  gpt::Block block(cfg);
  auto x0 = torch::randn({2, cfg.block_size, cfg.d_model});

  auto run = [&](bool ckpt) {
    block->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(5);  // the same dropout masks in both runs
    auto y = ckpt ? checkpoint([&](const torch::Tensor& t) { return block(t); }, x) : block(x);
    y.pow(2).sum().backward();
    auto g = grads_of(*block);
    g.push_back(x.grad().clone());
    g.push_back(torch::rand({1}));  // the RNG stream after backward must match too
    return g;
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, MlpGivesBitwiseEqualGradients) {
  torch::manual_seed(72);
  MlpNet mlp;
  auto x = torch::randn({6, 16});
  auto run = [&](bool ckpt) {
    mlp->zero_grad();
    auto y = ckpt ? checkpoint([&](const torch::Tensor& t) { return mlp(t); }, x) : mlp(x);
    y.pow(2).mean().backward();
    return grads_of(*mlp);
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, SeveralInputsAndOutputsSomeWithoutGradAndCapturedNonTensors) {
  torch::manual_seed(73);
  torch::nn::Linear lin(4, 4);
  const double factor = 3.0;  // a non-tensor argument, captured
  auto a0 = torch::randn({3, 4}), b0 = torch::randn({3, 4});
  auto region = [&](const std::vector<torch::Tensor>& in) {
    auto h = lin(in[0]) * factor + in[1];
    return std::vector<torch::Tensor>{h.tanh(), h.sum(1), in[1].argmax(1)};  // last: no grad (integer)
  };
  auto run = [&](bool ckpt) {
    lin->zero_grad();
    auto a = a0.clone().requires_grad_(true);
    auto b = b0.clone();  // does not require grad
    auto out = ckpt ? checkpoint(region, {a, b}) : region({a, b});
    EXPECT_FALSE(out[2].requires_grad());
    (out[0].sum() + out[1].pow(2).sum()).backward();
    EXPECT_FALSE(b.grad().defined());
    auto g = grads_of(*lin);
    g.push_back(a.grad().clone());
    return g;
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, NestedRegionsGiveEqualGradients) {
  torch::manual_seed(74);
  torch::nn::Linear l1(4, 4), l2(4, 4);
  auto x0 = torch::randn({2, 4});
  auto run = [&](bool ckpt) {
    l1->zero_grad();
    l2->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    auto inner = [&](const torch::Tensor& t) { return torch::relu(l2(t)); };
    auto outer = [&](const torch::Tensor& t) { return ckpt ? checkpoint(inner, l1(t)) : inner(l1(t)); };
    auto y = ckpt ? checkpoint(outer, x) : outer(x);
    y.sum().backward();
    auto g = grads_of(*l1);
    for (auto& t : grads_of(*l2)) g.push_back(t);
    g.push_back(x.grad().clone());
    return g;
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, RetainGraphRecomputesForASecondBackward) {
  torch::manual_seed(75);
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4});
  auto plain = lin(x).tanh().sum();
  plain.backward({}, /*retain_graph=*/true);
  plain.backward();
  auto expected = lin->weight.grad().clone();
  lin->zero_grad();
  auto y = checkpoint([&](const torch::Tensor& t) { return lin(t).tanh(); }, x).sum();
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  EXPECT_TRUE(torch::equal(lin->weight.grad(), expected));
}

TEST(ActivationCheckpoint, DoubleBackwardIsAClearError) {
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = checkpoint([&](const torch::Tensor& t) { return lin(t).pow(2); }, x).sum();
  try {
    torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("checkpoint: double backward (create_graph=true) through a checkpointed region is "
                        "not supported, because its graph is rebuilt inside backward. Run that region "
                        "without fsdp::checkpoint, or take the gradient without create_graph."),
              std::string::npos) << what;
  }
}

}  // namespace
