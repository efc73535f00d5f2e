// An MLP wrapped by hand: the model calls its blocks through wrap points.
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_mlp [--device cpu|cuda|cuda:N|auto]
#include <fsdp/fsdp.h>

#include "../common/cli.h"
#include "../common/device.h"

#include <cxxopts.hpp>

#include <iostream>

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 4; ++i) {
      blocks.emplace_back(torch::nn::Sequential(torch::nn::Linear(256, 256), torch::nn::GELU()));
      register_module("block" + std::to_string(i), blocks.back());
    }
    head = register_module("head", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);  // each block is gathered before and freed after
    return head(x);
  }
  std::vector<fsdp::FullyShardedModule<torch::nn::Sequential>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int run(int argc, char** argv) {
  cxxopts::Options o("train_mlp", "Train a small MLP, its blocks wrapped by hand.");
  o.add_options()("device", examples::kDeviceHelp,
                  cxxopts::value<std::string>()->default_value("auto"))("h,help", "show this help");
  const auto r = o.parse(argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << std::endl;
    return 0;
  }
  if (!r.unmatched().empty())
    throw examples::UsageError("unexpected argument '" + r.unmatched()[0] + "'; see --help");
  fsdp::ShardingOptions opts;
  opts.device = examples::parse_device_flag(r["device"].as<std::string>());
  opts.process_group = examples::init_process_group_for(opts.device);
  opts.auto_wrap_policy = fsdp::wrap::size_based_policy(10000);
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(Net(), opts);
  // Host shards step with its SIMD kernels, device shards with ATen's fused kernel.
  fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(1e-3));
  const int rank = opts.process_group.rank();
  auto gen = at::detail::createCPUGenerator(rank + 1);  // each rank its own data
  auto target = torch::randn({256, 10}, at::detail::createCPUGenerator(42)).to(opts.device);
  for (int step = 0; step < 100; ++step) {
    auto x = torch::randn({16, 256}, gen).to(opts.device);
    auto loss = torch::mse_loss(model(x), x.matmul(target) * 0.05);
    loss.backward();
    fsdp::clip_grad_norm_(model, 1.0);
    opt.step();
    opt.zero_grad();
    if (rank == 0 && step % 20 == 0)
      std::cout << "step " << step << " loss " << loss.item<double>() << std::endl;
  }
  fsdp::FullParamsOptions full;
  full.rank0_only = true;
  auto weights = fsdp::full_state_dict(model, full);  // FQN -> full fp32 tensor
  if (rank == 0)
    std::cout << "gathered " << weights.size() << " tensors, first: " << weights[0].first
              << std::endl;
  return 0;
}

int main(int argc, char** argv) {
  return examples::program_main("train_mlp", [&] { return run(argc, argv); });
}
