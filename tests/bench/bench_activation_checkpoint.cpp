// Benchmark: peak memory and step time of the GPT (8 layers, d_model 256, batch 8x128)
// with and without activation checkpointing of every block, on CPU, side by side.
// Each mode runs in its own process (this binary re-executes itself), and the peak is
// the process's peak RSS growth over one training step (VmHWM, reset through
// /proc/self/clear_refs), so the allocator's cache from the other mode cannot mix in.
#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

namespace {

int64_t rss_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size()));
  }
  return -1;
}

void reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

int run_mode(bool ckpt) {
  gpt::Config cfg;
  cfg.n_layer = 8;
  cfg.d_model = 256;
  cfg.n_head = 8;
  cfg.block_size = 128;
  torch::manual_seed(0);
  fsdp::ShardingOptions o;
  if (ckpt) o.checkpoint_policy = fsdp::wrap::module_type_policy<gpt::Block>();
  auto model = fsdp::fully_shard(gpt::GPT(cfg), o);
  torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
  auto rows = torch::randint(0, 256, {8, cfg.block_size + 1}, torch::kLong);
  std::vector<double> times;
  int64_t peak_growth = 0;
  for (int i = 0; i < 6; ++i) {
    opt.zero_grad();
    reset_peak();
    const int64_t before = rss_kb("VmRSS:");
    auto t0 = std::chrono::steady_clock::now();
    gpt::loss_on(model, rows).backward();
    opt.step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (i >= 1) peak_growth = std::max(peak_growth, rss_kb("VmHWM:") - before);
  }
  times.erase(times.begin());  // warm-up
  std::sort(times.begin(), times.end());
  std::printf("%lld %.6f\n", static_cast<long long>(peak_growth), times[times.size() / 2]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) return run_mode(std::string(argv[1]) == "all");
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return 1;
  exe[n] = '\0';
  auto measure = [&](const char* mode) {
    std::string cmd = std::string(exe) + " " + mode;
    FILE* p = popen(cmd.c_str(), "r");
    long long kb = 0;
    double secs = 0;
    if (p == nullptr || std::fscanf(p, "%lld %lf", &kb, &secs) != 2) std::exit(1);
    pclose(p);
    return std::make_pair(kb, secs);
  };
  auto [kb0, t0] = measure("none");
  auto [kb1, t1] = measure("all");
  std::printf("GPT 8 layers, d_model 256, batch 8x128, CPU, fsdp world 1; median of 5 steps\n");
  std::printf("%-26s %14s %14s\n", "", "no checkpoint", "checkpoint all");
  std::printf("%-26s %11.1f MB %11.1f MB\n", "peak RSS growth per step", kb0 / 1024.0,
              kb1 / 1024.0);
  std::printf("%-26s %11.1f ms %11.1f ms\n", "step time", t0 * 1e3, t1 * 1e3);
  std::printf(
      "{\"metric\": \"activation_ckpt_memory_ratio\", \"value\": %.3f, \"unit\": \"ratio\", "
      "\"baseline\": \"peak RSS growth per step without checkpointing\"}\n",
      static_cast<double>(kb1) / kb0);
  std::printf(
      "{\"metric\": \"activation_ckpt_step_time_ratio\", \"value\": %.3f, \"unit\": \"ratio\", "
      "\"baseline\": \"step time without checkpointing\"}\n",
      t1 / t0);
  return 0;
}
