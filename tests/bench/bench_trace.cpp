// Benchmark: what the per-unit trace (Note [Per-unit trace]) costs. One sharded GPT
// (d_model 256, 8 layers, batch 8x64 per rank, FusedAdamW, clipping), trained with the
// trace recording on alternate steps and off on the others, so machine noise hits both
// alike; "off" is the production path (the relaxed flag load at each span site). Run
// under fsdp-run (world 2 in scripts/bench/bench.sh). Prints the median step times and
// trace_overhead = on / off (target <= 1.02); rank 0 prints the JSON line.
#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"
#include "../../src/trace/trace.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  auto pg = fsdp::init_process_group();
  gpt::Config cfg;
  cfg.n_layer = 8;
  cfg.d_model = 256;
  cfg.n_head = 8;
  cfg.block_size = 64;
  const char* port = std::getenv("MASTER_PORT");
  const auto dir = std::filesystem::temp_directory_path() /
                   ("fsdp_bench_trace_" + std::string(port != nullptr ? port : "0"));
  fsdp::ShardingOptions o;
  o.process_group = pg;
  o.trace = dir.string();
  torch::manual_seed(0);
  {
    auto model = fsdp::fully_shard(gpt::GPT(cfg), o);
    fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(1e-4));
    auto rows = torch::randint(0, 256, {8, cfg.block_size + 1}, torch::kLong);
    auto step = [&](bool traced) {
      fsdp::detail::trace::enabled_flag().store(traced);
      pg.barrier();
      auto t0 = std::chrono::steady_clock::now();
      gpt::loss_on(model, rows).backward();
      fsdp::clip_grad_norm_(model, 1.0);
      opt.step();
      opt.zero_grad();
      pg.barrier();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    for (int i = 0; i < 3; ++i) step(i % 2 == 0);  // warm-up
    std::vector<double> on, off;
    for (int i = 0; i < reps; ++i) {
      off.push_back(step(false));
      on.push_back(step(true));
    }
    const double ratio = median(on) / median(off);
    if (pg.rank() == 0) {
      std::cout << "GPT d_model 256, 8 layers, batch 8x64 per rank, world " << pg.size()
                << ", FusedAdamW, CPU, " << reps << " alternating steps each\n"
                << "trace off step (median): " << median(off) * 1e3 << " ms\n"
                << "trace on step (median):  " << median(on) * 1e3 << " ms\n"
                << "trace_overhead: " << ratio << " (target <= 1.02)\n"
                << "{\"metric\": \"trace_overhead\", \"value\": " << ratio
                << ", \"unit\": \"ratio\", \"baseline\": \"the same steps with the trace off, "
                   "alternating, world "
                << pg.size() << "\"}\n";
    }
    fsdp::detail::trace::enabled_flag().store(true);
  }                                                  // the model goes: its trace is written
  fsdp::detail::trace::enabled_flag().store(false);  // nothing more to write at exit
  pg.barrier();
  if (pg.rank() == 0) std::filesystem::remove_all(dir);
  return 0;
}
