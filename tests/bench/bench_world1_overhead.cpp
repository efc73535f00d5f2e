// Benchmark: step time of a sharded GPT at world size 1 against plain LibTorch, same
// model (d_model 256, 8 layers), same data, same optimizer, measured alternately in one
// run so that machine noise hits both alike. Prints the ratio (target <= 1.05).
#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Model>
double step_seconds(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& rows) {
  auto t0 = std::chrono::steady_clock::now();
  gpt::loss_on(model, rows).backward();
  opt.step();
  opt.zero_grad();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  gpt::Config cfg;
  cfg.n_layer = 8;
  cfg.d_model = 256;
  cfg.n_head = 8;
  cfg.block_size = 64;
  torch::manual_seed(0);
  gpt::GPT plain(cfg);
  torch::manual_seed(0);
  auto sharded = fsdp::fully_shard(gpt::GPT(cfg));
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
  torch::optim::AdamW sharded_opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
  auto rows = torch::randint(0, 256, {8, cfg.block_size + 1}, torch::kLong);
  for (int i = 0; i < 2; ++i) {  // warm-up
    step_seconds(plain, plain_opt, rows);
    step_seconds(sharded, sharded_opt, rows);
  }
  std::vector<double> p, s;
  for (int i = 0; i < reps; ++i) {
    p.push_back(step_seconds(plain, plain_opt, rows));
    s.push_back(step_seconds(sharded, sharded_opt, rows));
  }
  const double ratio = median(s) / median(p);
  std::cout << "GPT d_model 256, 8 layers, batch 8x64, AdamW, CPU, " << reps
            << " alternating steps each\n"
            << "plain LibTorch step (median): " << median(p) * 1e3 << " ms\n"
            << "fsdp world 1 step (median):   " << median(s) * 1e3 << " ms\n"
            << "fsdp_world1_overhead: " << ratio << " (target <= 1.05)\n";
  std::cout << "{\"metric\": \"fsdp_world1_overhead\", \"value\": " << ratio
            << ", \"unit\": \"ratio\", \"baseline\": \"plain LibTorch step, same model and "
               "optimizer\"}\n";
  return 0;
}
