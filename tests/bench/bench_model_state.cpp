// Benchmark (run under fsdp-run --nproc N): the engine's byte counters after a training
// step against the per-rank model-state formula of docs/design.md, "Memory model": 16
// bytes per parameter over N (fp32 shard, fp32 gradient shard, Adam m and v), and the
// gathered-parameter peak against its bound.
#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"

#include <cstdio>
#include "../../src/internal/sharded_model.h"  // flat-parameter internals

int main() {
  auto pg = fsdp::init_process_group();
  gpt::Config cfg;
  cfg.n_layer = 4;
  cfg.n_head = 4;
  cfg.d_model = 256;
  cfg.block_size = 64;
  fsdp::ShardingOptions o;
  o.process_group = pg;
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::GPT(cfg), o);
  fsdp::FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  auto rows = torch::randint(0, 256, {4, cfg.block_size + 1}, torch::kLong);
  gpt::loss_on(model, rows).backward();
  opt.step();

  int64_t psi = 0, largest_unit = 0, root = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    psi += f.numel;
    if (f.unit_fqn.empty())
      root += f.padded_numel * 4;
    else
      largest_unit = std::max(largest_unit, f.padded_numel * 4);
  }
  const auto mem = model.memory_stats();
  int64_t optim = 0;
  for (auto& kv : opt.state()) {  // the optimizer's real state tensors
    auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
    optim += (st.exp_avg().numel() + st.exp_avg_sq().numel()) * 4;
  }
  const double measured =
      static_cast<double>(mem.sharded_params.current + mem.grad_shards.current + optim);
  const double formula = 16.0 * static_cast<double>(psi) / pg.size();
  const double bound = static_cast<double>(root + o.max_gathered_units * largest_unit);
  if (pg.rank() == 0) {
    std::printf(
        "world %d: %lld parameters; shards %lld B, grads %lld B, Adam %lld B; formula 16*psi/N = "
        "%.0f B; "
        "gathered peak %lld B (bound root + %d x largest unit = %.0f B)\n",
        pg.size(), static_cast<long long>(psi), static_cast<long long>(mem.sharded_params.current),
        static_cast<long long>(mem.grad_shards.current), static_cast<long long>(optim), formula,
        static_cast<long long>(mem.gathered_params.peak), o.max_gathered_units, bound);
    std::printf(
        "{\"metric\": \"model_state_bytes_vs_formula_w%d\", \"value\": %.4f, \"unit\": \"ratio "
        "(target 1.00 "
        "plus padding)\", \"baseline\": \"docs/design.md, Memory model: 16 bytes x parameters / "
        "N\"}\n",
        pg.size(), measured / formula);
    std::printf(
        "{\"metric\": \"gathered_params_peak_vs_bound_w%d\", \"value\": %.4f, \"unit\": \"ratio "
        "(at most 1)\", "
        "\"baseline\": \"root unit + max_gathered_units x largest unit, fp32\"}\n",
        pg.size(), static_cast<double>(mem.gathered_params.peak) / bound);
  }
  return 0;
}
