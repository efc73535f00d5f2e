// The example GPT's two attention kernels on this machine's CPU, in the same run: the
// fused kernel (at::scaled_dot_product_attention, train_gpt's default) against the explicit
// softmax over the T x T matrix (--attention math), at T = 256 and T = 1024. Two models
// from the same seed, sharded at world 1 as train_gpt runs them, train on the same batches,
// their steps alternating; tokens/s is the median of the timed steps, and the losses of
// the two are compared step by step (no dropout: they must agree to fp32 rounding).
//
//   bench_attention [--steps N] [--layers L] [--d-model D] [--heads H] [--batch B]
//                   [--lengths 256,1024]
//
// Prints a table and JSON lines: attention_sdpa_over_math_tokens_per_s_T<T> (ratio),
// attention_sdpa_tokens_per_s_T<T> and attention_math_tokens_per_s_T<T>, and
// attention_max_loss_rel_diff_T<T> (max over steps of |sdpa - math| / math).
#include <fsdp/fsdp.h>

#include "../../examples/gpt/gpt_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "bench_attention: " << why
            << "\nusage: bench_attention [--steps N] [--layers L] [--d-model D] [--heads H] "
               "[--batch B] [--lengths 256,1024]\n";
  std::exit(2);
}

struct Run {
  std::vector<double> seconds, losses;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 8, layers = 4, d_model = 256, heads = 4, batch = 4;
  std::vector<int64_t> lengths{256, 1024};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage("fused against explicit attention on the CPU");
    if (i + 1 >= argc) usage(k + " needs a value");
    const std::string v = argv[++i];
    try {
      if (k == "--steps") {
        steps = std::stoll(v);
      } else if (k == "--layers") {
        layers = std::stoll(v);
      } else if (k == "--d-model") {
        d_model = std::stoll(v);
      } else if (k == "--heads") {
        heads = std::stoll(v);
      } else if (k == "--batch") {
        batch = std::stoll(v);
      } else if (k == "--lengths") {
        lengths.clear();
        std::stringstream in(v);
        std::string item;
        while (std::getline(in, item, ',')) lengths.push_back(std::stoll(item));
      } else {
        usage("unknown argument " + k);
      }
    } catch (const std::logic_error&) {
      usage(k + " " + v + " is not a number");
    }
  }
  if (steps < 3 || layers < 1 || d_model < 1 || heads < 1 || batch < 1 || lengths.empty() ||
      d_model % heads != 0)
    usage("--steps must be at least 3 (2 warm-up), the sizes positive, --heads dividing --d-model");
  std::cout << "bench_attention: GPT " << layers << "x" << d_model << ", " << heads
            << " heads, batch " << batch << ", " << steps << " steps (2 warm-up), "
            << at::get_num_threads() << " threads\n";
  std::cout << "| T | sdpa tokens/s | math tokens/s | sdpa / math | max loss difference "
               "(relative) | loss, first → last |\n|---|---|---|---|---|---|\n";
  std::vector<std::string> lines;
  for (const int64_t T : lengths) {
    gpt::Config cfg;
    cfg.n_layer = layers;
    cfg.d_model = d_model;
    cfg.n_head = heads;
    cfg.block_size = T;
    std::vector<Run> runs(2);
    std::vector<fsdp::Sharded<gpt::GPT>> models;
    std::vector<std::unique_ptr<torch::optim::AdamW>> opts;
    for (auto kernel : {examples::AttentionKernel::kSdpa, examples::AttentionKernel::kMath}) {
      cfg.attention = kernel;
      torch::manual_seed(0);
      models.push_back(fsdp::fully_shard(gpt::GPT(cfg)));
      opts.push_back(std::make_unique<torch::optim::AdamW>(models.back().sharded_parameters(),
                                                           torch::optim::AdamWOptions(1e-3)));
    }
    for (int64_t s = 0; s < steps; ++s) {
      auto gen = at::detail::createCPUGenerator(100 + s);
      auto rows = torch::randint(0, 256, {batch, T + 1}, gen, torch::kLong);
      for (size_t m = 0; m < 2; ++m) {
        const size_t k = (s % 2 == 0) ? m : 1 - m;  // alternate which runs first
        const auto t0 = Clock::now();
        auto loss = gpt::loss_on(models[k], rows);
        loss.backward();
        opts[k]->step();
        opts[k]->zero_grad();
        const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
        if (s >= 2) runs[k].seconds.push_back(sec);
        runs[k].losses.push_back(loss.item<double>());
      }
    }
    const double tokens = static_cast<double>(batch * T);
    const double sdpa = tokens / median(runs[0].seconds), math = tokens / median(runs[1].seconds);
    double diff = 0;
    for (size_t i = 0; i < runs[0].losses.size(); ++i)
      diff = std::max(diff, std::abs(runs[0].losses[i] - runs[1].losses[i]) / runs[1].losses[i]);
    char row[256];
    std::snprintf(row, sizeof(row), "| %lld | %.0f | %.0f | %.3f | %.2e | %.4f → %.4f |\n",
                  static_cast<long long>(T), sdpa, math, sdpa / math, diff, runs[0].losses.front(),
                  runs[0].losses.back());
    std::cout << row << std::flush;
    const std::string t = "_T" + std::to_string(T);
    auto json = [&](const std::string& metric, double value, const std::string& unit) {
      std::ostringstream o;
      o << "{\"metric\": \"" << metric << t << "\", \"value\": " << value << ", \"unit\": \""
        << unit
        << "\", \"baseline\": \"the explicit softmax (--attention math) in the same run, GPT "
        << layers << "x" << d_model << ", batch " << batch << "x" << T << "\"}";
      lines.push_back(o.str());
    };
    json("attention_sdpa_over_math_tokens_per_s", sdpa / math, "ratio");
    json("attention_sdpa_tokens_per_s", sdpa, "tokens/s");
    json("attention_math_tokens_per_s", math, "tokens/s");
    json("attention_max_loss_rel_diff", diff, "fraction");
  }
  for (const auto& l : lines) std::cout << l << "\n";
  return 0;
}
