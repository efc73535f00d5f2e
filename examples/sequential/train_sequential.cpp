// A torch::nn::Sequential sharded with no change to its code.
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_sequential
#include <fsdp/fsdp.h>

#include "../common/cli.h"

#include <iostream>

int run() {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(64, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 1));
  fsdp::ShardingOptions opts;
  opts.process_group = fsdp::init_process_group();
  auto model = fsdp::shard_sequential(seq, opts);  // every entry becomes a wrap point
  torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto gen = at::detail::createCPUGenerator(opts.process_group.rank() + 1);
  for (int step = 0; step < 100; ++step) {
    auto x = torch::randn({32, 64}, gen);
    auto y = x.sum(1, true).sin();
    auto loss = torch::mse_loss(model(x), y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    if (opts.process_group.rank() == 0 && step % 20 == 0) {
      std::cout << "step " << step << " loss " << loss.item<double>() << std::endl;
    }
  }
  if (opts.process_group.rank() == 0) {
    for (const auto& p : model.param_table()) {
      std::cout << p.fqn << " in unit '" << p.unit_fqn << "' at offset " << p.offset << std::endl;
    }
  }
  return 0;
}

int main() { return examples::program_main("train_sequential", run); }
