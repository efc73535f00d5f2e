#pragma once
// Models, data and the unsharded reference used across tests.

#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {

/// MLP with a plain input layer, `layers` hidden wrap points and a plain output layer.
class MlpNetImpl : public torch::nn::Module {
 public:
  explicit MlpNetImpl(int64_t in = 16, int64_t hidden = 32, int64_t layers = 3, int64_t out = 8)
      : inp(register_module("inp", torch::nn::Linear(in, hidden))) {
    auto list = register_module("hidden", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      this->hidden.emplace_back(
          torch::nn::Sequential(torch::nn::Linear(hidden, hidden), torch::nn::Tanh()));
      list->push_back(this->hidden.back());
    }
    this->out = register_module("out", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(inp(x));
    for (auto& h : hidden) x = h(x);
    return out(x);
  }
  torch::nn::Linear inp;
  std::vector<fsdp::FullyShardedModule<torch::nn::Sequential>> hidden;
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(MlpNet);

inline gpt::Config small_gpt_config() {
  gpt::Config c;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.block_size = 16;
  return c;
}

/// Deterministic global batch for `step`: the same on every rank and world size.
inline torch::Tensor gpt_batch(int64_t step, int64_t rows, int64_t block) {
  auto gen = at::detail::createCPUGenerator(1234 + step);
  return torch::randint(0, 256, {rows, block + 1}, gen, torch::kLong);
}
inline std::pair<torch::Tensor, torch::Tensor> mlp_batch(int64_t step, int64_t rows) {
  auto gen = at::detail::createCPUGenerator(777 + step);
  return {torch::randn({rows, 16}, gen), torch::randn({rows, 8}, gen)};
}

/// Share `i` of `n` equal shares of a global batch.
inline torch::Tensor share_rows(const torch::Tensor& global, int64_t i, int64_t n) {
  const int64_t rows = global.size(0) / n;
  return global.narrow(0, i * rows, rows);
}

/// This rank's equal share of a global batch (rows split in rank order).
inline torch::Tensor my_rows(const torch::Tensor& global, const ProcessGroup& pg) {
  const int64_t n = global.size(0) / pg.size();
  return global.narrow(0, pg.rank() * n, n);
}

/// Mean of a per-rank scalar over ranks: the loss of the global batch when shares are equal.
inline double global_mean(const torch::Tensor& local, const ProcessGroup& pg) {
  auto t = local.detach().to(torch::kDouble).reshape({1}).clone();
  pg.all_reduce_sum(t);
  return t.item<double>() / pg.size();
}

/// max |a - b| / max(max |b|, floor). The floor keeps tensors that sit near zero
/// (biases, which start at 0) from turning sub-1e-6 absolute differences into large ratios.
inline double rel_diff(const torch::Tensor& a, const torch::Tensor& b, double floor = 0.1) {
  double scale = std::max(b.abs().max().item<double>(), floor);
  return (a - b).abs().max().item<double>() / scale;
}

/// Checks that every clean-FQN parameter of `reference` equals `full` within `tol`.
inline void expect_params_match(const std::vector<std::pair<std::string, torch::Tensor>>& full,
                                torch::nn::Module& reference, double tol) {
  auto ref = named_parameters_clean(reference);
  std::map<std::string, torch::Tensor> got(full.begin(), full.end());
  ASSERT_EQ(got.size(), ref.size());
  for (const auto& [name, value] : ref) {
    ASSERT_TRUE(got.count(name)) << "missing " << name;
    ASSERT_EQ(got[name].sizes(), value.sizes()) << name;
    EXPECT_LE(rel_diff(got[name], value.detach()), tol) << name;
  }
}

}  // namespace fsdp::testing
