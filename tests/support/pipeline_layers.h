#pragma once
// The small model the pipeline tests split into stages (test_pipeline.cpp,
// test_checkpoint_pipeline.cpp): eight layers, uneven in size, one without parameters,
// its batches and its loss.

#include <torch/torch.h>

#include <string>
#include <utility>

namespace fsdp::testing {

constexpr int64_t kPipeIn = 12, kPipeOut = 6;

constexpr int64_t kPipeLayers = 8;

/// Layer i of pipeline_layers() alone: made in order, the same draws as the whole.
inline torch::nn::AnyModule pipeline_layer(int64_t i) {
  switch (i) {
    case 0:
      return torch::nn::AnyModule(torch::nn::Linear(kPipeIn, 32));
    case 2:
      return torch::nn::AnyModule(torch::nn::Linear(32, 24));
    case 3:
      return torch::nn::AnyModule(torch::nn::Linear(24, 24));
    case 5:
      return torch::nn::AnyModule(torch::nn::Linear(24, 40));
    case 6:
      return torch::nn::AnyModule(torch::nn::Linear(40, 16));
    case 7:
      return torch::nn::AnyModule(torch::nn::Linear(16, kPipeOut));
    default:  // 1 and 4
      return torch::nn::AnyModule(torch::nn::Tanh());
  }
}

inline torch::nn::Sequential pipeline_layers() {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < kPipeLayers; ++i) seq->push_back(std::to_string(i), pipeline_layer(i));
  return seq;
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
