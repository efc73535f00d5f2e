// GPU benchmark (CUDA builds only; scripts/bench.sh runs it when a GPU is present).
// One GPU, world size 1, the GPT example, each figure against plain LibTorch measured in
// the same run:
//   gpu_tokens_per_s_vs_plain_libtorch  fsdp tokens/s over plain tokens/s (fp32, AdamW,
//                                       steps alternating between the two)
//   gpu_peak_memory_vs_plain_libtorch   peak allocated GPU bytes of a step, fsdp / plain
//   gpu_peak_memory_offload_vs_plain_libtorch  the same with cpu_offload and bf16
//   gpu_mfu                             fsdp in bf16: model FLOPs/s over the GPU's dense
//                                       bf16 peak (6N + 12*L*d*T FLOPs per token)
//   offload_max_params                  the largest GPT (layers doubled) that trains a
//                                       step with cpu_offload, against the largest plain
//                                       LibTorch trains (fp32 AdamW on the GPU)
// Peak FLOPs come from a table of GPU names or FSDP_GPU_PEAK_TFLOPS; without either
// gpu_mfu is not printed.
#include <fsdp/fsdp.h>
#include <fsdp/fused_adamw.h>

#include "../../examples/gpt/gpt_model.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
using Clock = std::chrono::steady_clock;
// StatType::AGGREGATE, whose namespace moved between LibTorch versions (its value did not).
constexpr size_t kAggregate = 0;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int64_t peak_allocated() {
  const auto stats = alloc::getDeviceStats(c10::cuda::current_device());
  return stats.allocated_bytes[kAggregate].peak;
}

void reset_peak() {
  torch::cuda::synchronize();
  alloc::resetPeakStats(c10::cuda::current_device());
}

// Runs `steps` (which builds a model, trains and resets the peak where it wants) and
// returns its peak allocated bytes above what was allocated before it.
template <class Fn>
int64_t isolated_peak(Fn steps) {
  torch::cuda::synchronize();
  alloc::emptyCache();
  const auto stats = alloc::getDeviceStats(c10::cuda::current_device());
  const int64_t before = stats.allocated_bytes[kAggregate].current;
  reset_peak();
  steps();
  const int64_t peak = peak_allocated() - before;
  torch::cuda::synchronize();
  alloc::emptyCache();
  return peak;
}

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

template <class Model>
double step_seconds(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& rows) {
  torch::cuda::synchronize();
  const auto t0 = Clock::now();
  gpt::loss_on(model, rows).backward();
  opt.step();
  opt.zero_grad();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::optional<double> peak_bf16_flops() {
  if (const char* env = std::getenv("FSDP_GPU_PEAK_TFLOPS")) return std::atof(env) * 1e12;
  const std::string name = at::cuda::getCurrentDeviceProperties()->name;
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100") && has("PCIe")) return 756e12;
  if (has("H100") || has("H200") || has("H800") || has("GH200")) return 989e12;
  if (has("A100") || has("A800")) return 312e12;
  if (has("L40S")) return 362e12;
  return std::nullopt;
}

void json(const std::string& metric, double value, const std::string& unit,
          const std::string& baseline) {
  std::cout << "{\"metric\": \"" << metric << "\", \"value\": " << value << ", \"unit\": \"" << unit
            << "\", \"baseline\": \"" << baseline << "\"}\n";
}

fsdp::ShardingOptions gpu_options(bool offload, bool bf16) {
  fsdp::ShardingOptions o;
  o.device = torch::Device(torch::kCUDA, c10::cuda::current_device());
  o.cpu_offload = offload;
  if (bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  return o;
}

bool is_out_of_memory(const c10::Error& e) {
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos ||
         what.find("host RAM") != std::string::npos ||
         what.find("host memory") != std::string::npos;
}

// Trains one step of a GPT with `layers` blocks (plain on the GPU, or sharded with
// offload); false when the GPU (or, for offload, the host check) runs out of memory.
bool trains(gpt::Config cfg, int64_t layers, bool offload, int64_t& params) {
  cfg.n_layer = layers;
  auto rows =
      torch::randint(0, cfg.vocab_size, {4, cfg.block_size + 1}, torch::kLong).to(torch::kCUDA);
  bool ok = true;
  try {
    gpt::GPT model(cfg);
    params = count_params(*model);
    if (offload) {
      auto sharded = fsdp::fully_shard(std::move(model), gpu_options(true, true));
      fsdp::FusedAdamW opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
      step_seconds(sharded, opt, rows);
    } else {
      model->to(torch::kCUDA);
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
      step_seconds(model, opt, rows);
    }
  } catch (const c10::Error& e) {
    if (!is_out_of_memory(e)) throw;
    ok = false;
  }
  torch::cuda::synchronize();
  alloc::emptyCache();
  return ok;
}

// Doubles the layer count from `start` while a step trains and time is left; returns the
// parameter count of the largest model that trained.
int64_t max_params(const gpt::Config& cfg, bool offload, int64_t start, double seconds) {
  const auto t0 = Clock::now();
  int64_t best = 0;
  for (int64_t layers = start;; layers *= 2) {
    int64_t params = 0;
    if (!trains(cfg, layers, offload, params)) break;
    best = params;
    std::cout << "  " << (offload ? "offload" : "plain  ") << " " << layers << " layers, "
              << params / 1e6 << "M params: trains\n";
    if (std::chrono::duration<double>(Clock::now() - t0).count() > seconds) break;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "bench_gpu: no GPU; nothing measured\n";
    return 0;
  }
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const double search_seconds = argc > 2 ? std::atof(argv[2]) : 300;
  gpt::Config cfg;
  cfg.n_layer = 12;
  cfg.d_model = 1024;
  cfg.n_head = 16;
  cfg.block_size = 512;
  cfg.vocab_size = 256;
  const int64_t batch = 16;
  const int64_t tokens = batch * cfg.block_size;
  auto rows =
      torch::randint(0, cfg.vocab_size, {batch, cfg.block_size + 1}, torch::kLong).to(torch::kCUDA);
  std::cout << "GPU: " << at::cuda::getCurrentDeviceProperties()->name << "; GPT " << cfg.n_layer
            << " layers, d_model " << cfg.d_model << ", batch " << batch << "x" << cfg.block_size
            << "\n";

  // Throughput: fsdp (fp32, world 1) and plain LibTorch side by side, alternating steps.
  double tok_plain = 0, tok_sharded = 0, tok_bf16 = 0;
  int64_t n_params = 0;
  {
    torch::manual_seed(0);
    gpt::GPT plain(cfg);
    n_params = count_params(*plain);
    plain->to(torch::kCUDA);
    torch::manual_seed(0);
    auto sharded = fsdp::fully_shard(gpt::GPT(cfg), gpu_options(false, false));
    torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
    torch::optim::AdamW sharded_opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    auto bf16 = fsdp::fully_shard(gpt::GPT(cfg), gpu_options(false, true));
    torch::optim::AdamW bf16_opt(bf16.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    for (int i = 0; i < 3; ++i) {
      step_seconds(plain, plain_opt, rows);
      step_seconds(sharded, sharded_opt, rows);
      step_seconds(bf16, bf16_opt, rows);
    }
    std::vector<double> tp, ts, tb;
    for (int i = 0; i < reps; ++i) {
      tp.push_back(step_seconds(plain, plain_opt, rows));
      ts.push_back(step_seconds(sharded, sharded_opt, rows));
      tb.push_back(step_seconds(bf16, bf16_opt, rows));
    }
    tok_plain = tokens / median(tp);
    tok_sharded = tokens / median(ts);
    tok_bf16 = tokens / median(tb);
  }
  std::cout << "tokens/s: plain LibTorch " << tok_plain << ", fsdp world 1 " << tok_sharded
            << ", fsdp bf16 " << tok_bf16 << "\n";

  // Peak GPU memory of a training step, each model alone on the GPU.
  const int64_t peak_plain = isolated_peak([&] {
    gpt::GPT plain(cfg);
    plain->to(torch::kCUDA);
    torch::optim::AdamW opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
    step_seconds(plain, opt, rows);  // the optimizer state exists from here on
    reset_peak();
    for (int i = 0; i < 3; ++i) step_seconds(plain, opt, rows);
  });
  const int64_t peak_sharded = isolated_peak([&] {
    auto sharded = fsdp::fully_shard(gpt::GPT(cfg), gpu_options(false, false));
    torch::optim::AdamW opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    step_seconds(sharded, opt, rows);
    reset_peak();
    for (int i = 0; i < 3; ++i) step_seconds(sharded, opt, rows);
  });
  const int64_t peak_off = isolated_peak([&] {
    auto off = fsdp::fully_shard(gpt::GPT(cfg), gpu_options(true, true));
    fsdp::FusedAdamW opt(off, torch::optim::AdamWOptions(1e-4));
    step_seconds(off, opt, rows);
    reset_peak();
    for (int i = 0; i < 3; ++i) step_seconds(off, opt, rows);
  });
  std::cout << "peak GPU MiB per step: plain LibTorch " << peak_plain / 1048576.0
            << ", fsdp world 1 " << peak_sharded / 1048576.0 << ", fsdp bf16 + cpu_offload "
            << peak_off / 1048576.0 << "\n";

  // Absolute figures too, for the comparison with PyTorch FSDP2 (tests/interop/fsdp2_bench.py,
  // the same model, batch and optimizer), which scripts/gpu-check.sh sets beside them.
  json("gpu_tokens_per_s", tok_sharded, "tokens/s", "fsdp fp32, world 1");
  json("gpu_bf16_tokens_per_s", tok_bf16, "tokens/s", "fsdp bf16, world 1");
  json("gpu_peak_memory_bytes", static_cast<double>(peak_sharded), "bytes", "fsdp fp32 step");
  json("gpu_tokens_per_s_vs_plain_libtorch", tok_sharded / tok_plain, "ratio",
       "plain LibTorch tokens/s, same GPT, fp32 AdamW, one GPU");
  json("gpu_peak_memory_vs_plain_libtorch",
       static_cast<double>(peak_sharded) / static_cast<double>(peak_plain), "ratio",
       "plain LibTorch peak allocated GPU bytes per step");
  json("gpu_peak_memory_offload_vs_plain_libtorch",
       static_cast<double>(peak_off) / static_cast<double>(peak_plain), "ratio",
       "plain LibTorch (fp32) peak allocated GPU bytes; fsdp with cpu_offload and bf16");
  if (auto peak = peak_bf16_flops()) {
    const double flops_per_token =
        6.0 * static_cast<double>(n_params) + 12.0 * cfg.n_layer * cfg.d_model * cfg.block_size;
    json("gpu_mfu", tok_bf16 * flops_per_token / *peak, "fraction",
         "dense bf16 peak of " + std::to_string(*peak / 1e12) + " TFLOP/s");
  } else {
    std::cout << "gpu_mfu: unknown GPU peak; set FSDP_GPU_PEAK_TFLOPS\n";
  }

  // Largest trainable model with offload vs plain LibTorch (layers doubled from 12).
  gpt::Config big = cfg;
  big.d_model = 2048;
  big.n_head = 16;
  big.block_size = 256;
  std::cout << "largest GPT (d_model 2048) that trains one step, layers doubled, ~"
            << search_seconds << " s each:\n";
  const int64_t plain_max = max_params(big, false, 12, search_seconds);
  const int64_t offload_max = max_params(big, true, 12, search_seconds);
  json("offload_max_params", static_cast<double>(offload_max), "params",
       "plain LibTorch on the same GPU trains at most " + std::to_string(plain_max) + " params");
  return 0;
}
