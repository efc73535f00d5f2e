// Benchmark: FusedAdamW against torch::optim::AdamW on 100M parameters, and the fused
// step's memory traffic against this machine's memory bandwidth, measured in this binary
// with a STREAM triad on every core (the limit a streaming kernel can reach). Then pure
// bf16 (Note [Pure bf16 rounding]): FusedAdamW's stochastic rounding on bf16 parameters
// against torch::optim::AdamW on the same bf16 parameters and against the ATen op chain
// FusedAdamW::step_bf16 was before its fused kernel.
//
//   bench_adamw [--params N]
#include <fsdp/fused_adamw.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double best_s(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    f();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

template <class F>
double median_s(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    f();
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The ATen op chain step_bf16 was (stochastic rounding), for the comparison: fp32 copies,
// one op each, random bits from a CPU generator.
struct ChainBf16 {
  torch::Tensor m, v;
  int64_t step = 0;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);

  void operator()(torch::Tensor& p, const torch::optim::AdamWOptions& o) {
    if (!m.defined()) {
      m = torch::zeros_like(p);
      v = torch::zeros_like(p);
    }
    ++step;
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
    at::Tensor w = p.to(torch::kFloat);
    const at::Tensor g = p.grad().to(torch::kFloat);
    at::Tensor mf = m.to(torch::kFloat), vf = v.to(torch::kFloat);
    if (o.weight_decay() != 0) w.mul_(1 - o.lr() * o.weight_decay());
    mf.lerp_(g, 1 - beta1);
    vf.mul_(beta2).addcmul_(g, g, 1 - beta2);
    const at::Tensor denom = (vf.sqrt() / std::sqrt(bc2)).add_(o.eps());
    w.addcdiv_(mf, denom, -o.lr() / bc1);
    m.copy_(mf);
    v.copy_(vf);
    at::Tensor bits = w.view(torch::kInt);
    bits.add_(at::randint(0, 1 << 16, w.sizes(), gen, w.options().dtype(torch::kInt)));
    bits.bitwise_and_(static_cast<int64_t>(-65536));
    p.copy_(w);
  }
};

void metric(const char* name, double value, const char* unit, const char* baseline) {
  std::printf("{\"metric\": \"%s\", \"value\": %.4f, \"unit\": \"%s\", \"baseline\": \"%s\"}\n",
              name, value, unit, baseline);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 100'000'000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--params")) n = static_cast<int64_t>(std::stod(argv[i + 1]));
  }
  torch::NoGradGuard no_grad;
  // Every core for both optimizers, as for the limit below (LibTorch may default to one
  // thread: Debian 12's does here).
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  std::printf("AdamW step on %lld fp32 parameters, %d threads, fused kernel: %s\n",
              static_cast<long long>(n), at::get_num_threads(),
              fsdp::FusedAdamW::isa_name(fsdp::FusedAdamW::active_isa()));
  auto p1 = torch::randn({n}), p2 = p1.clone();
  p1.mutable_grad() = torch::randn({n}) * 1e-2;
  p2.mutable_grad() = p1.grad().clone();
  torch::optim::AdamW ref({p1}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  fsdp::FusedAdamW fused({p2}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  ref.step();  // allocate state outside the timing
  fused.step();
  const double t_ref = median_s(5, [&] { ref.step(); });
  const double t_fused = median_s(5, [&] { fused.step(); });

  // The limit, on every core (std::thread::hardware_concurrency threads, each touching
  // its own pages first, as STREAM does), over arrays as large as the step's:
  // - STREAM's triad a = b + s * c, counted as STREAM counts (12 bytes per element). Its
  //   store to a fresh destination also reads that line first (write-allocate), which
  //   STREAM does not count, so it understates what an in-place kernel can move;
  // - the AdamW step's own traffic with no arithmetic: three arrays updated in place from
  //   a fourth (reads 4, writes 3: 28 bytes per element, as the step).
  // The fraction is taken against the higher of the two: a limit the kernel cannot beat.
  const int64_t m = n;
  std::vector<float> a(static_cast<size_t>(m)), b(static_cast<size_t>(m)),
      c(static_cast<size_t>(m)), d(static_cast<size_t>(m));
  auto on_all_cores = [&](const std::function<void(int64_t, int64_t)>& body) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back(body, m * t / threads, m * (t + 1) / threads);
    for (auto& th : pool) th.join();
  };
  on_all_cores([&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
      d[i] = 0.5f;
    }
  });
  const float scalar = 3.0f;
  // Best of 7: the limit is the most the machine moved.
  const double t_triad = best_s(7, [&] {
    on_all_cores([&](int64_t lo, int64_t hi) {
      float* __restrict__ pa = a.data();
      const float* __restrict__ pb = b.data();
      const float* __restrict__ pc = c.data();
      for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + scalar * pc[i];
    });
  });
  const double t_same = best_s(7, [&] {
    on_all_cores([&](int64_t lo, int64_t hi) {
      float* __restrict__ pa = a.data();
      float* __restrict__ pb = b.data();
      float* __restrict__ pc = c.data();
      const float* __restrict__ pd = d.data();
      for (int64_t i = lo; i < hi; ++i) {
        pa[i] += pd[i];
        pb[i] += pd[i];
        pc[i] += pd[i];
      }
    });
  });
  if (a[static_cast<size_t>(m / 2)] !=
      7.0f + 0.5f * 7) {  // the triad's 7, then 7 passes adding 0.5
    std::fprintf(stderr, "bench_adamw: the bandwidth kernels computed %f, not 10.5\n",
                 a[static_cast<size_t>(m / 2)]);
    return 1;
  }
  const double triad_bw = 12.0 * static_cast<double>(m) / t_triad;
  const double same_bw = 28.0 * static_cast<double>(m) / t_same;
  const double limit_bw = std::max(triad_bw, same_bw);
  // The fused step reads p, g, m, v and writes p, m, v: 28 bytes per parameter.
  const double fused_bw = 28.0 * static_cast<double>(n) / t_fused;

  std::printf("%-36s %10s %14s\n", "", "ms/step", "M params/s");
  std::printf("%-36s %10.1f %14.0f\n", "torch::optim::AdamW", t_ref * 1e3, n / t_ref / 1e6);
  std::printf("%-36s %10.1f %14.0f\n", "fsdp::FusedAdamW", t_fused * 1e3, n / t_fused / 1e6);
  std::printf(
      "limit on %d threads: STREAM triad %.1f GB/s, the step's traffic without arithmetic %.1f "
      "GB/s\n",
      threads, triad_bw / 1e9, same_bw / 1e9);
  std::printf("fused step traffic (%d LibTorch threads): %.1f GB/s\n", at::get_num_threads(),
              fused_bw / 1e9);
  metric("fused_adamw_speedup", t_ref / t_fused, "x (target >= 4)",
         "torch::optim::AdamW, same parameters, same run");
  metric("fused_adamw_bandwidth_fraction", fused_bw / limit_bw, "fraction (target >= 0.8)",
         "all cores: the higher of a STREAM triad and the step's 4-read 3-write traffic without "
         "arithmetic, same run");

  // Pure bf16, stochastic rounding. FusedAdamW reads p, g, m, v and writes p, m, v in
  // bf16: 14 bytes per parameter.
  for (auto* x : {&a, &b, &c, &d}) std::vector<float>().swap(*x);
  ref.state().clear();
  fused.state().clear();
  auto q1 = torch::randn({n}).to(torch::kBFloat16), q2 = q1.clone(), q3 = q1.clone();
  q1.mutable_grad() = (torch::randn({n}) * 1e-2).to(torch::kBFloat16);
  q2.mutable_grad() = q1.grad().clone();
  q3.mutable_grad() = q1.grad().clone();
  const auto bf16_opts = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  torch::optim::AdamW ref_bf16({q1}, bf16_opts);
  fsdp::FusedAdamW fused_bf16({q2}, bf16_opts);
  fused_bf16.set_bf16_rounding(fsdp::FusedAdamW::Bf16Rounding::kStochastic, 1);
  ChainBf16 chain;
  ref_bf16.step();
  fused_bf16.step();
  chain(q3, bf16_opts);
  const double t_ref_bf16 = median_s(5, [&] { ref_bf16.step(); });
  const double t_fused_bf16 = median_s(5, [&] { fused_bf16.step(); });
  const double t_chain = median_s(3, [&] { chain(q3, bf16_opts); });
  std::printf("\npure bf16 (%lld bf16 parameters, state in bf16):\n", static_cast<long long>(n));
  std::printf("%-36s %10s %14s\n", "", "ms/step", "M params/s");
  std::printf("%-36s %10.1f %14.0f\n", "torch::optim::AdamW (nearest)", t_ref_bf16 * 1e3,
              n / t_ref_bf16 / 1e6);
  std::printf("%-36s %10.1f %14.0f\n", "ATen op chain (stochastic, before)", t_chain * 1e3,
              n / t_chain / 1e6);
  std::printf("%-36s %10.1f %14.0f\n", "fsdp::FusedAdamW (stochastic)", t_fused_bf16 * 1e3,
              n / t_fused_bf16 / 1e6);
  std::printf("fused bf16 step traffic: %.1f GB/s (%.2f of the limit above)\n",
              14.0 * static_cast<double>(n) / t_fused_bf16 / 1e9,
              14.0 * static_cast<double>(n) / t_fused_bf16 / limit_bw);
  metric("pure_bf16_fused_adamw_speedup", t_ref_bf16 / t_fused_bf16, "x",
         "torch::optim::AdamW on the same bf16 parameters, same run");
  metric("pure_bf16_fused_adamw_vs_aten_chain", t_chain / t_fused_bf16, "x",
         "the ATen op chain step_bf16 was before its fused kernel, same run");
  return 0;
}
