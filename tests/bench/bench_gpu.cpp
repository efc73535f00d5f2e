// GPU benchmark (CUDA builds only): one GPU, world size 1, the GPT example with fused
// attention (at::scaled_dot_product_attention), each figure against plain LibTorch
// measured in the same run. scripts/gpu/gpu-check.sh runs it; --device cpu runs the same code
// on the CPU at a small size, so that the check can be rehearsed where no GPU is.
//
//   bench_gpu [--device cuda|cpu] [--model small|large|both] [--reps N] [--order ours|plain]
//             [--search-seconds S] [--attention sdpa|math]
//             [--small-layers L --small-d-model D --small-heads H --small-block-size T
//              --small-batch B] [--large-layers ... --large-batch B]
//
// --model small: the 152M GPT of the earlier runs (12 x 1024, T 512, batch 16), kept for
// continuity: fp32 and bf16 against plain LibTorch (fp32, steps alternating), peak memory,
// the offload peak, and (--search-seconds > 0) the largest GPT that trains with offload.
//   gpu_tokens_per_s, gpu_bf16_tokens_per_s, gpu_peak_memory_bytes,
//   gpu_tokens_per_s_vs_plain_libtorch, gpu_peak_memory_vs_plain_libtorch,
//   gpu_peak_memory_offload_vs_plain_libtorch, gpu_mfu_152m, offload_max_params
// --model large: a GPT of 1.3B parameters (26 x 2048, 16 heads, T 1024, batch 8) in bf16
// on one GPU, this library (bf16 mixed precision: fp32 shards, bf16 compute) and plain
// LibTorch (autocast bf16 over fp32 parameters), each built alone on the device, warmed
// up, then timed over --reps steps (median; min and max beside it), both with
// fsdp::FusedAdamW (ATen's fused AdamW kernel). --order says which runs first.
//   gpu_large_bf16_tokens_per_s, gpu_large_plain_bf16_tokens_per_s,
//   gpu_large_vs_plain_libtorch (ours / plain tokens/s), gpu_mfu (ours),
//   gpu_large_plain_mfu, gpu_large_peak_memory_bytes, gpu_large_plain_peak_memory_bytes
// MFU: model FLOPs per token 6N + 12 L d T (N every parameter; the second term is
// attention's QK^T and AV, forward and backward, counted in full as PaLM and llm.c count
// it) times tokens/s, over the dense bf16 peak (a table of GPU names, or
// FSDP_GPU_PEAK_TFLOPS; on the CPU only the latter).
#include <fsdp/fsdp.h>
#include <fsdp/fused_adamw.h>

#include "../../examples/gpt/gpt_model.h"

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  torch::Device device = torch::kCUDA;
  std::string model = "both";
  int reps = 10;
  std::string order = "ours";
  double search_seconds = 0;
  examples::AttentionKernel attention = examples::AttentionKernel::kSdpa;
  gpt::Config small, large;
  int64_t small_batch = 16, large_batch = 8;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "bench_gpu: " << why
            << "\nusage: bench_gpu [--device cuda|cpu] [--model small|large|both] [--reps N] "
               "[--order ours|plain] [--search-seconds S] [--attention sdpa|math] "
               "[--{small,large}-{layers,d-model,heads,block-size,batch} N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  a.small.n_layer = 12;
  a.small.d_model = 1024;
  a.small.n_head = 16;
  a.small.block_size = 512;
  a.large.n_layer = 26;
  a.large.d_model = 2048;
  a.large.n_head = 16;
  a.large.block_size = 1024;
  std::map<std::string, int64_t*> sizes = {
      {"--small-layers", &a.small.n_layer},        {"--small-d-model", &a.small.d_model},
      {"--small-heads", &a.small.n_head},          {"--small-block-size", &a.small.block_size},
      {"--small-batch", &a.small_batch},           {"--large-layers", &a.large.n_layer},
      {"--large-d-model", &a.large.d_model},       {"--large-heads", &a.large.n_head},
      {"--large-block-size", &a.large.block_size}, {"--large-batch", &a.large_batch}};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage("the GPT example on one device against plain LibTorch");
    if (i + 1 >= argc) usage(k + " needs a value");
    const std::string v = argv[++i];
    try {
      if (k == "--device") {
        if (v != "cuda" && v != "cpu") usage("--device " + v + ": use cuda or cpu");
        a.device = v == "cuda" ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
      } else if (k == "--model") {
        if (v != "small" && v != "large" && v != "both")
          usage("--model " + v + ": use small, large or both");
        a.model = v;
      } else if (k == "--reps") {
        a.reps = std::stoi(v);
        if (a.reps < 1) usage("--reps " + v + " must be at least 1");
      } else if (k == "--order") {
        if (v != "ours" && v != "plain")
          usage("--order " + v + ": use ours or plain (which runs first)");
        a.order = v;
      } else if (k == "--search-seconds") {
        a.search_seconds = std::stod(v);
      } else if (k == "--attention") {
        a.attention = examples::parse_attention_kernel(v);
      } else if (sizes.count(k)) {
        *sizes[k] = std::stoll(v);
        if (*sizes[k] < 1) usage(k + " " + v + " must be positive");
      } else {
        usage("unknown argument " + k);
      }
    } catch (const std::invalid_argument& e) {
      usage(k + " " + v + ": " + e.what());
    }
  }
  for (auto* c : {&a.small, &a.large}) {
    c->vocab_size = 256;
    c->attention = a.attention;
    if (c->d_model % c->n_head != 0) usage("each --*-d-model must be divisible by its --*-heads");
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

void empty_cache(const torch::Device& d) {
  if (!d.is_cuda()) return;
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
}

int64_t allocated(const torch::Device& d) {
  return d.is_cuda() ? fsdp::stats::device_memory(d).allocated : 0;
}
int64_t peak_allocated(const torch::Device& d) {
  return d.is_cuda() ? fsdp::stats::device_memory(d).peak_allocated : 0;
}
void reset_peak(const torch::Device& d) {
  if (!d.is_cuda()) return;
  torch::cuda::synchronize();
  fsdp::stats::reset_device_peak_memory(d);
}

// Runs `steps` (which builds a model, trains and resets the peak where it wants) and
// returns its peak allocated bytes above what was allocated before it (0 on the CPU).
template <class Fn>
int64_t isolated_peak(const torch::Device& d, Fn steps) {
  empty_cache(d);
  const int64_t before = allocated(d);
  reset_peak(d);
  steps();
  const int64_t peak = peak_allocated(d) - before;
  empty_cache(d);
  return peak;
}

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

/// One training step; `autocast`: forward and loss under bf16 autocast (plain LibTorch's
/// mixed precision), backward after it, as torch.autocast is used.
template <class Model>
double step_seconds(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& rows,
                    bool autocast = false) {
  const auto d = rows.device();
  sync(d);
  const auto t0 = Clock::now();
  torch::Tensor loss;
  if (autocast) {
    at::autocast::set_autocast_dtype(d.type(), torch::kBFloat16);
    at::autocast::set_autocast_enabled(d.type(), true);
    loss = gpt::loss_on(model, rows);
    at::autocast::set_autocast_enabled(d.type(), false);
    at::autocast::clear_cache();
  } else {
    loss = gpt::loss_on(model, rows);
  }
  loss.backward();
  opt.step();
  opt.zero_grad();
  sync(d);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::optional<double> peak_bf16_flops(const torch::Device& d) {
  if (const char* env = std::getenv("FSDP_GPU_PEAK_TFLOPS")) return std::atof(env) * 1e12;
  if (!d.is_cuda()) return std::nullopt;
  const std::string name = at::cuda::getCurrentDeviceProperties()->name;
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100") && has("PCIe")) return 756e12;
  if (has("H100") || has("H200") || has("H800") || has("GH200")) return 989e12;
  if (has("A100") || has("A800")) return 312e12;
  if (has("L40S")) return 362e12;
  return std::nullopt;
}

/// Model FLOPs per token: 6N + 12 L d T.
double flops_per_token(const gpt::Config& c, int64_t n_params) {
  return 6.0 * static_cast<double>(n_params) +
         12.0 * static_cast<double>(c.n_layer * c.d_model * c.block_size);
}

std::string shape(const gpt::Config& c, int64_t batch) {
  std::ostringstream s;
  s << "GPT " << c.n_layer << "x" << c.d_model << ", " << c.n_head << " heads, batch " << batch
    << "x" << c.block_size << ", attention " << examples::attention_name(c.attention);
  return s.str();
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

void json(const std::string& metric, double value, const std::string& unit,
          const std::string& baseline, const std::string& extra = "") {
  std::cout << "{\"metric\": \"" << metric << "\", \"value\": " << value << ", \"unit\": \"" << unit
            << "\", \"baseline\": \"" << escape(baseline) << "\"" << extra << "}" << std::endl;
}

fsdp::ShardingOptions options(const torch::Device& d, bool offload, bool bf16) {
  fsdp::ShardingOptions o;
  o.device = d;
  o.offload_optimizer.device = o.offload_param.device =
      offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
  if (bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  return o;
}

torch::Tensor batch_rows(const gpt::Config& c, int64_t batch, const torch::Device& d) {
  return torch::randint(0, c.vocab_size, {batch, c.block_size + 1}, torch::kLong).to(d);
}

bool is_out_of_memory(const c10::Error& e) {
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos ||
         what.find("host RAM") != std::string::npos ||
         what.find("host memory") != std::string::npos;
}

// Trains one step of a GPT with `layers` blocks (plain on the device, or sharded with
// offload); false when the device (or, for offload, the host check) runs out of memory.
bool trains(const torch::Device& d, gpt::Config cfg, int64_t layers, bool offload,
            int64_t& params) {
  cfg.n_layer = layers;
  auto rows = batch_rows(cfg, 4, d);
  bool ok = true;
  try {
    gpt::GPT model(cfg);
    params = count_params(*model);
    if (offload) {
      auto sharded = fsdp::fully_shard(std::move(model), options(d, true, true));
      fsdp::FusedAdamW opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
      step_seconds(sharded, opt, rows);
    } else {
      model->to(d);
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
      step_seconds(model, opt, rows);
    }
  } catch (const c10::Error& e) {
    if (!is_out_of_memory(e)) throw;
    ok = false;
  }
  empty_cache(d);
  return ok;
}

// Doubles the layer count from `start` while a step trains and time is left; returns the
// parameter count of the largest model that trained.
int64_t max_params(const torch::Device& d, const gpt::Config& cfg, bool offload, int64_t start,
                   double seconds) {
  const auto t0 = Clock::now();
  int64_t best = 0;
  for (int64_t layers = start;; layers *= 2) {
    int64_t params = 0;
    if (!trains(d, cfg, layers, offload, params)) break;
    best = params;
    std::cout << "  " << (offload ? "offload" : "plain  ") << " " << layers << " layers, "
              << params / 1e6 << "M params: trains\n";
    if (std::chrono::duration<double>(Clock::now() - t0).count() > seconds) break;
  }
  return best;
}

// ---- the 152M GPT of the earlier runs --------------------------------------------------

void small_model(const Args& a) {
  const auto& d = a.device;
  const gpt::Config& cfg = a.small;
  const int64_t tokens = a.small_batch * cfg.block_size;
  auto rows = batch_rows(cfg, a.small_batch, d);
  std::cout << "small: " << shape(cfg, a.small_batch) << "\n";

  // Throughput: fsdp (fp32 and bf16, world 1) and plain LibTorch (fp32) side by side,
  // alternating steps.
  double tok_plain = 0, tok_sharded = 0, tok_bf16 = 0;
  int64_t n_params = 0;
  {
    torch::manual_seed(0);
    gpt::GPT plain(cfg);
    n_params = count_params(*plain);
    plain->to(d);
    torch::manual_seed(0);
    auto sharded = fsdp::fully_shard(gpt::GPT(cfg), options(d, false, false));
    torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
    torch::optim::AdamW sharded_opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    auto bf16 = fsdp::fully_shard(gpt::GPT(cfg), options(d, false, true));
    torch::optim::AdamW bf16_opt(bf16.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    for (int i = 0; i < 3; ++i) {
      step_seconds(plain, plain_opt, rows);
      step_seconds(sharded, sharded_opt, rows);
      step_seconds(bf16, bf16_opt, rows);
    }
    std::vector<double> tp, ts, tb;
    for (int i = 0; i < a.reps; ++i) {
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

  // Peak device memory of a training step, each model alone on the device.
  const int64_t peak_plain = isolated_peak(d, [&] {
    gpt::GPT plain(cfg);
    plain->to(d);
    torch::optim::AdamW opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
    step_seconds(plain, opt, rows);  // the optimizer state exists from here on
    reset_peak(d);
    for (int i = 0; i < 3; ++i) step_seconds(plain, opt, rows);
  });
  const int64_t peak_sharded = isolated_peak(d, [&] {
    auto sharded = fsdp::fully_shard(gpt::GPT(cfg), options(d, false, false));
    torch::optim::AdamW opt(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-4));
    step_seconds(sharded, opt, rows);
    reset_peak(d);
    for (int i = 0; i < 3; ++i) step_seconds(sharded, opt, rows);
  });
  const int64_t peak_off = isolated_peak(d, [&] {
    auto off = fsdp::fully_shard(gpt::GPT(cfg), options(d, true, true));
    fsdp::FusedAdamW opt(off, torch::optim::AdamWOptions(1e-4));
    step_seconds(off, opt, rows);
    reset_peak(d);
    for (int i = 0; i < 3; ++i) step_seconds(off, opt, rows);
  });
  if (d.is_cuda()) {
    std::cout << "peak GPU MiB per step: plain LibTorch " << peak_plain / 1048576.0
              << ", fsdp world 1 " << peak_sharded / 1048576.0 << ", fsdp bf16 + cpu_offload "
              << peak_off / 1048576.0 << "\n";
  }

  // Absolute figures too, for the comparison with PyTorch FSDP2 (tests/interop/fsdp2_bench.py,
  // the same model, batch and optimizer), which scripts/gpu/gpu-check.sh sets beside them.
  const std::string where = shape(cfg, a.small_batch);
  json("gpu_tokens_per_s", tok_sharded, "tokens/s", "fsdp fp32, world 1, " + where);
  json("gpu_bf16_tokens_per_s", tok_bf16, "tokens/s", "fsdp bf16, world 1, " + where);
  json("gpu_tokens_per_s_vs_plain_libtorch", tok_sharded / tok_plain, "ratio",
       "plain LibTorch tokens/s, same GPT, fp32 AdamW, one device");
  if (d.is_cuda()) {
    json("gpu_peak_memory_bytes", static_cast<double>(peak_sharded), "bytes", "fsdp fp32 step");
    json("gpu_peak_memory_vs_plain_libtorch",
         static_cast<double>(peak_sharded) / static_cast<double>(peak_plain), "ratio",
         "plain LibTorch peak allocated GPU bytes per step");
    json("gpu_peak_memory_offload_vs_plain_libtorch",
         static_cast<double>(peak_off) / static_cast<double>(peak_plain), "ratio",
         "plain LibTorch (fp32) peak allocated GPU bytes; fsdp with cpu_offload and bf16");
  }
  if (auto peak = peak_bf16_flops(d)) {
    json("gpu_mfu_152m", tok_bf16 * flops_per_token(cfg, n_params) / *peak, "fraction",
         "dense bf16 peak of " + std::to_string(*peak / 1e12) + " TFLOP/s, " + where);
  }

  if (a.search_seconds > 0) {
    // Largest trainable model with offload vs plain LibTorch (layers doubled from 12).
    gpt::Config big = cfg;
    big.d_model = 2048;
    big.n_head = 16;
    big.block_size = 256;
    std::cout << "largest GPT (d_model 2048) that trains one step, layers doubled, ~"
              << a.search_seconds << " s each:\n";
    const int64_t plain_max = max_params(d, big, false, 12, a.search_seconds);
    const int64_t offload_max = max_params(d, big, true, 12, a.search_seconds);
    json("offload_max_params", static_cast<double>(offload_max), "params",
         "plain LibTorch on the same device trains at most " + std::to_string(plain_max) +
             " params");
  }
}

// ---- the 1.3B GPT in bf16 ---------------------------------------------------------------

struct Timed {
  double tokens_per_s = 0, min_tps = 0, max_tps = 0;
  int64_t peak = 0;
  int64_t params = 0;
};

// Builds one model alone on the device (`ours`: sharded at world 1 in bf16 mixed
// precision; else plain LibTorch under bf16 autocast), warms it up, times `reps` steps.
Timed time_large(const Args& a, bool ours) {
  const auto& d = a.device;
  const gpt::Config& cfg = a.large;
  auto rows = batch_rows(cfg, a.large_batch, d);
  const double tokens = static_cast<double>(a.large_batch * cfg.block_size);
  Timed t;
  std::vector<double> secs;
  const auto t0 = Clock::now();
  t.peak = isolated_peak(d, [&] {
    torch::manual_seed(0);
    auto train = [&](auto& model, torch::optim::Optimizer& opt, bool autocast) {
      std::cout << (ours ? "  ours" : "  plain") << ": built and placed in "
                << std::chrono::duration<double>(Clock::now() - t0).count() << " s" << std::endl;
      step_seconds(model, opt, rows, autocast);  // the optimizer state exists from here on
      reset_peak(d);
      for (int i = 0; i < 2; ++i) step_seconds(model, opt, rows, autocast);
      for (int i = 0; i < a.reps; ++i) secs.push_back(step_seconds(model, opt, rows, autocast));
    };
    if (ours) {
      auto model = fsdp::make_sharded<gpt::GPT>(options(d, false, true), cfg);
      t.params = 0;
      for (const auto& p : model.param_table()) t.params += p.numel;
      fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(1e-4));
      train(model, opt, false);
    } else {
      gpt::GPT model(cfg);
      t.params = count_params(*model);
      model->to(d);
      fsdp::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
      train(model, opt, true);
    }
  });
  t.tokens_per_s = tokens / median(secs);
  t.min_tps = tokens / *std::max_element(secs.begin(), secs.end());
  t.max_tps = tokens / *std::min_element(secs.begin(), secs.end());
  std::cout << (ours ? "  ours" : "  plain") << ": " << t.tokens_per_s << " tokens/s (median of "
            << a.reps << " steps; " << t.min_tps << " to " << t.max_tps << "), peak "
            << t.peak / 1048576.0 << " MiB" << std::endl;
  return t;
}

void large_model(const Args& a) {
  const auto& d = a.device;
  const std::string where = shape(a.large, a.large_batch);
  std::cout << "large: " << where << ", bf16, " << a.order << " first" << std::endl;
  std::optional<Timed> ours, plain;
  for (bool first_ours : {a.order == "ours", a.order != "ours"}) {
    (first_ours ? ours : plain) = time_large(a, first_ours);
  }
  const std::string extra = ", \"params\": " + std::to_string(ours->params) + ", \"model\": \"" +
                            escape(where) + "\", \"reps\": " + std::to_string(a.reps);
  auto spread = [](const Timed& t) {
    return ", \"min\": " + std::to_string(t.min_tps) + ", \"max\": " + std::to_string(t.max_tps);
  };
  json("gpu_large_bf16_tokens_per_s", ours->tokens_per_s, "tokens/s",
       "fsdp bf16 (fp32 shards), world 1, FusedAdamW", extra + spread(*ours));
  json("gpu_large_plain_bf16_tokens_per_s", plain->tokens_per_s, "tokens/s",
       "plain LibTorch, autocast bf16 over fp32 parameters, FusedAdamW", extra + spread(*plain));
  json("gpu_large_vs_plain_libtorch", ours->tokens_per_s / plain->tokens_per_s, "ratio",
       "plain LibTorch tokens/s in the same process", extra);
  if (d.is_cuda()) {
    json("gpu_large_peak_memory_bytes", static_cast<double>(ours->peak), "bytes",
         "fsdp bf16 step, the model alone on the GPU", extra);
    json("gpu_large_plain_peak_memory_bytes", static_cast<double>(plain->peak), "bytes",
         "plain LibTorch autocast step, the model alone on the GPU", extra);
  }
  if (auto peak = peak_bf16_flops(d)) {
    const double fpt = flops_per_token(a.large, ours->params);
    const std::string formula =
        ", \"flops_per_token\": " + std::to_string(fpt) +
        ", \"formula\": \"6N + 12 L d T\", \"peak_flops\": " + std::to_string(*peak);
    json("gpu_mfu", ours->tokens_per_s * fpt / *peak, "fraction",
         "fsdp bf16 model FLOPs/s over the dense bf16 peak", extra + formula);
    json("gpu_large_plain_mfu", plain->tokens_per_s * fpt / *peak, "fraction",
         "plain LibTorch autocast bf16, the same formula", extra + formula);
  } else {
    std::cout << "gpu_mfu: unknown peak FLOP/s; set FSDP_GPU_PEAK_TFLOPS" << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.device.is_cuda() && !torch::cuda::is_available()) {
    std::cout << "bench_gpu: no GPU; nothing measured (--device cpu runs it on the CPU)\n";
    return 0;
  }
  std::cout << "bench_gpu on "
            << (a.device.is_cuda() ? std::string(at::cuda::getCurrentDeviceProperties()->name)
                                   : std::string("the CPU"))
            << std::endl;
  try {
    if (a.model == "large" || a.model == "both") large_model(a);
    if (a.model == "small" || a.model == "both") small_model(a);
  } catch (const c10::Error& e) {
    std::cerr << "bench_gpu: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
