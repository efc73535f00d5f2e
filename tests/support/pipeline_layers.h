#pragma once
// The small model the pipeline tests split into stages (test_pipeline.cpp,
// test_checkpoint_pipeline.cpp): eight layers, uneven in size, one without parameters,
// its batches and its loss.

#include <torch/torch.h>

#include <utility>

namespace fsdp::testing {

constexpr int64_t kPipeIn = 12, kPipeOut = 6;

inline torch::nn::Sequential pipeline_layers() {
  return torch::nn::Sequential(torch::nn::Linear(kPipeIn, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 24), torch::nn::Linear(24, 24),
                               torch::nn::Tanh(), torch::nn::Linear(24, 40),
                               torch::nn::Linear(40, 16), torch::nn::Linear(16, kPipeOut));
}

/// Step `step`'s batch of `rows` (inputs, targets), the same in every process.
inline std::pair<torch::Tensor, torch::Tensor> pipeline_batch(int64_t step, int64_t rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({rows, kPipeIn}, g);
  auto y = torch::randn({rows, kPipeOut}, g);
  return {x, y};
}

inline torch::Tensor pipeline_mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

}  // namespace fsdp::testing
