// Benchmark: FusedAdamW with its state in files (Note [NVMe optimizer state]) against
// the disk's own speed, measured in the same run with fio: a sequential O_DIRECT reader
// and a sequential writer at once, with the block size of the optimizer's chunks and as
// many transfers in flight (two each), as the step reads ahead and writes behind. The optimizer's
// effective state throughput is the bytes it reads and writes (exp_avg and exp_avg_sq: 16 per
// parameter) over the step's time. Without fio the ratio is skipped, with the reason.
//
//   bench_nvme [--dir DIR (default /tmp)] [--params N (default 32M)] [--buffer-mib M (64)]
#include <fsdp/fused_adamw.h>

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void metric(const char* name, double value, const char* unit, const char* baseline) {
  std::printf("{\"metric\": \"%s\", \"value\": %.4f, \"unit\": \"%s\", \"baseline\": \"%s\"}\n",
              name, value, unit, baseline);
}

std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) {
    *status = -1;
    return out;
  }
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) out.append(buf.data(), n);
  *status = pclose(f);
  return out;
}

// "bw_bytes" of fio's JSON section `dir` ("read" or "write") of its first job.
double fio_bw(const std::string& json, const char* dir) {
  const size_t at = json.find(std::string("\"") + dir + "\" : {");
  if (at == std::string::npos) return -1;
  const size_t bw = json.find("\"bw_bytes\" : ", at);
  if (bw == std::string::npos) return -1;
  return std::atof(json.c_str() + bw + 13);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  int64_t n = 32 << 20, buffer_mib = 64;
  const char* usage =
      "usage: bench_nvme [--dir DIR (default /tmp)] [--params N (default 32M)] "
      "[--buffer-mib M (default 64)]\n";
  for (int i = 1; i < argc; i += 2) {
    const bool known = !std::strcmp(argv[i], "--dir") || !std::strcmp(argv[i], "--params") ||
                       !std::strcmp(argv[i], "--buffer-mib");
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::cout << usage;
      return 0;
    }
    if (!known || i + 1 >= argc) {
      std::cerr << "bench_nvme: " << (known ? "a value is missing after " : "unknown argument ")
                << argv[i] << "\n"
                << usage;
      return 2;
    }
    if (!std::strcmp(argv[i], "--dir")) dir = argv[i + 1];
    if (!std::strcmp(argv[i], "--params")) n = static_cast<int64_t>(std::stod(argv[i + 1]));
    if (!std::strcmp(argv[i], "--buffer-mib")) buffer_mib = std::atoll(argv[i + 1]);
  }
  n = std::max<int64_t>(1024, n / 1024 * 1024);  // whole 4096-byte blocks: 16 bytes/param exactly
  torch::NoGradGuard no_grad;
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  auto p1 = torch::randn({n}), p2 = p1.clone();
  p1.mutable_grad() = torch::randn({n}) * 1e-2;
  p2.mutable_grad() = p1.grad().clone();
  const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  fsdp::FusedAdamW mem({p1}, o), nvme({p2}, o);
  fsdp::OffloadConfig cfg;
  cfg.device = fsdp::OffloadDevice::kNvme;
  cfg.nvme_path = dir;
  cfg.buffer_bytes = buffer_mib << 20;
  nvme.offload_state(cfg);
  const int64_t chunk = cfg.buffer_bytes / 24 / 1024 * 1024, block = 4 * chunk;
  std::printf("AdamW step on %lld fp32 parameters, state in %s (%s), %d threads\n",
              static_cast<long long>(n), dir.c_str(), nvme.state_offload_info().c_str(),
              at::get_num_threads());
  mem.step();  // first steps outside the timing (state allocated, file touched once)
  nvme.step();
  std::vector<double> t_mem, t_nvme;
  for (int r = 0; r < 5; ++r) {
    double t0 = now_s();
    mem.step();
    t_mem.push_back(now_s() - t0);
    t0 = now_s();
    nvme.step();
    t_nvme.push_back(now_s() - t0);
  }
  std::sort(t_mem.begin(), t_mem.end());
  std::sort(t_nvme.begin(), t_nvme.end());
  const double tm = t_mem[2], tn = t_nvme[2];
  if (!torch::equal(p1, p2)) {
    std::fprintf(stderr, "bench_nvme: NVMe state gave other parameters than in-memory state\n");
    return 1;
  }
  const double state_bytes = 16.0 * static_cast<double>(n);  // read m, v; write m, v
  const double ours = state_bytes / tn;
  std::printf("%-34s %10s %12s\n", "", "ms/step", "state GB/s");
  std::printf("%-34s %10.1f %12s\n", "FusedAdamW, state in memory", tm * 1e3, "-");
  std::printf("%-34s %10.1f %12.3f\n", "FusedAdamW, state in files", tn * 1e3, ours / 1e9);

  int status = 0;
  run("command -v fio >/dev/null 2>&1", &status);
  if (status != 0) {
    std::printf("skipped: the ratio to the disk's speed needs fio (apt-get install fio)\n");
    return 0;
  }
  const std::string file = dir + "/bench_nvme_fio." + std::to_string(::getpid());
  // Two jobs on one file of the state's size, as the step moves its state: a sequential
  // reader and a sequential writer at once, two transfers in flight each, timed for 4 s
  // after 1 s of ramp (fio lays the file out first, outside the timing).
  const std::string common =
      " --filename=" + file + " --direct=1 --ioengine=io_uring --bs=" + std::to_string(block) +
      " --size=" + std::to_string(8 * n) + " --iodepth=2 --time_based --runtime=4 --ramp_time=1";
  const std::string cmd = "fio --group_reporting --output-format=json --name=read --rw=read" +
                          common + " --name=write --rw=write" + common + " 2>&1";
  const std::string json = run(cmd, &status);
  std::remove(file.c_str());
  const double rd = fio_bw(json, "read"), wr = fio_bw(json, "write");
  if (status != 0 || rd <= 0 || wr <= 0) {
    std::printf("skipped: fio failed (status %d): %s\n", status, json.substr(0, 400).c_str());
    return 0;
  }
  const double disk = rd + wr;
  std::printf(
      "fio, O_DIRECT sequential reader + writer at once, bs %lld, iodepth 2 each: read "
      "%.3f + write %.3f = %.3f GB/s\n",
      static_cast<long long>(block), rd / 1e9, wr / 1e9, disk / 1e9);
  metric("nvme_state_io_fraction", ours / disk, "fraction (target >= 0.8)",
         "fio: a sequential O_DIRECT reader and writer at once, same block size, depth and "
         "directory, same run");
  return 0;
}
