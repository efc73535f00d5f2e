// Benchmark: the Gloo backend's reduce-scatter (Note [Gloo reduce-scatter]): bytes each
// rank writes (its sockets: /proc/self/io's wchar, read around the call) and the time of
// one call, median over the repetitions and the slowest rank's, for flat fp32 and bf16
// gradients of the given sizes, at the world fsdp-run starts.
//
//   fsdp-run --nproc 4 -- bench_reduce_scatter [MiB ...]        (default: 1 16 64)
//   FSDP_GLOO_REDUCE_SCATTER=allreduce ...                       the former all-reduce path
#include <fsdp/process_group.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

int64_t bytes_written() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> mib;
  for (int i = 1; i < argc; ++i) mib.push_back(std::atof(argv[i]));
  if (mib.empty()) mib = {1, 16, 64};
  fsdp::ProcessGroup pg = fsdp::init_process_group();
  const int n = pg.size();
  const char* algo = std::getenv("FSDP_GLOO_REDUCE_SCATTER");
  const std::string name = algo != nullptr && *algo != '\0' ? algo : "direct";
  constexpr int kReps = 7;
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (double m : mib) {
      // numel of an fp32 gradient of m MiB, a multiple of the world (bf16: half the bytes)
      const int64_t numel = std::max<int64_t>(1, static_cast<int64_t>(m * (1 << 20) / 4 / n)) * n;
      auto base = torch::arange(numel, torch::kLong).remainder(7).add(pg.rank()).to(dtype);
      std::vector<double> ts;
      std::vector<double> sent;
      for (int rep = 0; rep <= kReps; ++rep) {
        auto full = base.clone();
        auto mine = torch::empty({numel / n}, dtype);
        pg.barrier();
        const int64_t w0 = bytes_written();
        const auto t0 = std::chrono::steady_clock::now();
        pg.reduce_scatter_sum(full, mine);
        const auto t1 = std::chrono::steady_clock::now();
        const int64_t w1 = bytes_written();
        if (rep == 0) continue;  // warm-up
        ts.push_back(std::chrono::duration<double>(t1 - t0).count());
        sent.push_back(static_cast<double>(w1 - w0));
      }
      auto mine = torch::tensor({median(ts), median(sent)}, torch::kDouble);
      auto all = torch::empty({2 * n}, torch::kDouble);
      pg.all_gather(all, mine);
      if (pg.rank() == 0) {
        auto a = all.view({n, 2});
        const double flat =
            static_cast<double>(numel) * static_cast<double>(c10::elementSize(dtype));
        const double slowest = a.select(1, 0).max().item<double>();
        const double bytes = a.select(1, 1).mean().item<double>();
        std::printf(
            "world %d  %-9s  %-8s  %7.2f MiB  %8.2f ms  sent/rank %9.3f MiB = %.3f x flat "
            "((N-1)/N = %.3f)\n",
            n, name.c_str(), dtype == torch::kFloat ? "fp32" : "bf16", flat / (1 << 20),
            slowest * 1e3, bytes / (1 << 20), bytes / flat, (n - 1.0) / n);
        std::fflush(stdout);
      }
    }
  }
  pg.barrier();
  return 0;
}
