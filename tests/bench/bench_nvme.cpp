// Benchmark: FusedAdamW with its state in files (Note [NVMe optimizer state]) against
// the disk's own speed, measured in the same run with fio: a sequential O_DIRECT reader
// and a sequential writer at once, with the block size of the optimizer's chunks and as
// many transfers in flight (two each), as the step reads ahead and writes behind. The optimizer's
// effective state throughput is the bytes it reads and writes (exp_avg and exp_avg_sq: 16 per
// parameter) over the step's time. Without fio the ratio is skipped, with the reason.
//
// Then the parameters in files too (Note [NVMe parameters]): a GPT of about --params
// parameters (width 512, bf16, one rank) with offload_optimizer and offload_param on NVMe
// trains 3 steps; per step, the bytes the process read from and wrote to the disk
// (/proc/self/io: what reached the block layer) in forward + backward (the gathers' reads,
// the gradients' writes) and in the optimizer step (masters, gradients, moments, copies),
// and the optimizer step's disk rate against the same fio figure.
//
// A shared or virtual disk changes speed from one second to the next, so fio runs between
// the measured steps (3 s each): each step is compared with the mean of the fio runs just
// before and after it, and the fraction reported is the median of those per-step ratios.
//
// --buffer-mib is each offload section's buffer_bytes (the optimizer's, and the parameters'
// with them in files).
//
//   bench_nvme [--dir DIR (default /tmp)] [--params N (default 32M)] [--buffer-mib M (64)]
#include <fsdp/fsdp.h>
#include <fsdp/fused_adamw.h>

#include "../../examples/gpt/gpt_model.h"

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
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

// fio's sequential O_DIRECT reader and writer at once on one file of `size` bytes in
// `dir`, `block`-byte transfers, two in flight each, 3 s after 0.5 s of ramp (fio lays the
// file out first, outside the timing): read + write bytes per second, or -1 with `error`.
double fio_rate(const std::string& dir, int64_t block, int64_t size, std::string* error) {
  const std::string file = dir + "/bench_nvme_fio." + std::to_string(::getpid());
  const std::string common =
      " --filename=" + file + " --direct=1 --ioengine=io_uring --bs=" + std::to_string(block) +
      " --size=" + std::to_string(size) + " --iodepth=2 --time_based --runtime=3 --ramp_time=0.5";
  const std::string cmd = "fio --group_reporting --output-format=json --name=read --rw=read" +
                          common + " --name=write --rw=write" + common + " 2>&1";
  int status = 0;
  const std::string json = run(cmd, &status);
  std::remove(file.c_str());
  const double rd = fio_bw(json, "read"), wr = fio_bw(json, "write");
  if (status != 0 || rd <= 0 || wr <= 0) {
    *error = "fio failed (status " + std::to_string(status) + "): " + json.substr(0, 400);
    return -1;
  }
  return rd + wr;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? -1 : v[v.size() / 2];
}

// Each measured rate against the mean of the fio rates before and after it (fio has one
// more entry than rates): the ratios, and their median.
std::vector<double> ratios(const std::vector<double>& rates, const std::vector<double>& fio) {
  std::vector<double> out;
  for (size_t i = 0; i < rates.size() && i + 1 < fio.size(); ++i)
    out.push_back(rates[i] / ((fio[i] + fio[i + 1]) / 2));
  return out;
}

std::string list(const std::vector<double>& v, double scale) {
  std::string out;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, "%s%.3f", out.empty() ? "" : ", ", x * scale);
    out += buf;
  }
  return out;
}

// This process's bytes read from and written to storage (/proc/self/io), or -1s.
std::pair<double, double> disk_io() {
  std::FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return {-1, -1};
  char key[64];
  long long v = 0;
  double rd = -1, wr = -1;
  while (std::fscanf(f, "%63s %lld", key, &v) == 2) {
    if (!std::strcmp(key, "read_bytes:")) rd = static_cast<double>(v);
    if (!std::strcmp(key, "write_bytes:")) wr = static_cast<double>(v);
  }
  std::fclose(f);
  return {rd, wr};
}

struct ParamRun {
  double params = 0, fb_s = 0, opt_s = 0;
  std::pair<double, double> fb_io, opt_io;  // bytes read, written per step
  std::vector<double> opt_rates;            // each step's optimizer disk bytes per second
  std::string info;
};

// Note [NVMe parameters]: a GPT with everything in files (or, without `files`, in
// memory), 3 steps after one untimed.
ParamRun param_run(const std::string& dir, int64_t params, int64_t buffer_bytes, bool files,
                   const std::function<void(const std::string&)>& between = {}) {
  gpt::Config c;
  c.d_model = 512;
  c.n_head = 8;
  c.block_size = 128;
  c.n_layer = std::max<int64_t>(1, params / (12 * 512 * 512));
  fsdp::ShardingOptions o;
  o.auto_wrap_policy = fsdp::wrap::module_type_policy<gpt::Block>();
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.reduce_dtype = torch::kBFloat16;
  if (files) {
    o.offload_optimizer.device = o.offload_param.device = fsdp::OffloadDevice::kNvme;
    o.offload_optimizer.nvme_path = o.offload_param.nvme_path = dir;
    o.offload_optimizer.buffer_bytes = o.offload_param.buffer_bytes = buffer_bytes;
  }
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::GPT(c), o);
  fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(1e-4));
  ParamRun r;
  for (const auto& p : model.sharded_parameters()) r.params += static_cast<double>(p.numel());
  r.info = opt.state_offload_info();
  auto batch = torch::randint(0, 256, {4, c.block_size + 1});
  const int steps = 3;
  for (int s = 0; s <= steps; ++s) {
    auto io0 = disk_io();
    double t0 = now_s();
    {
      torch::AutoGradMode grad(true);
      gpt::loss_on(model, batch).backward();
    }
    auto io1 = disk_io();
    double t1 = now_s();
    opt.step();
    opt.zero_grad();
    auto io2 = disk_io();
    double t2 = now_s();
    if (between) between(r.info);  // fio, between the steps (the first one's too: it comes before)
    if (s == 0) continue;          // the first step writes the copies and the state the first time
    r.opt_rates.push_back((io2.first - io1.first + io2.second - io1.second) / (t2 - t1));
    r.fb_s += (t1 - t0) / steps;
    r.opt_s += (t2 - t1) / steps;
    r.fb_io.first += (io1.first - io0.first) / steps;
    r.fb_io.second += (io1.second - io0.second) / steps;
    r.opt_io.first += (io2.first - io1.first) / steps;
    r.opt_io.second += (io2.second - io1.second) / steps;
  }
  return r;
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
  int status = 0;
  run("command -v fio >/dev/null 2>&1", &status);
  std::string fio_error =
      status != 0 ? "the ratio to the disk's speed needs fio (apt-get install fio)" : "";
  // fio between the measured steps; it stops at its first failure.
  const auto fio_between = [&](int64_t bs, std::vector<double>* out) {
    if (!fio_error.empty()) return;
    const double r = fio_rate(dir, bs, 8 * n, &fio_error);
    if (r > 0) out->push_back(r);
  };
  mem.step();  // first steps outside the timing (state allocated, file touched once)
  nvme.step();
  std::vector<double> t_mem, t_nvme, state_fio;
  fio_between(block, &state_fio);
  for (int r = 0; r < 5; ++r) {
    double t0 = now_s();
    mem.step();
    t_mem.push_back(now_s() - t0);
    t0 = now_s();
    nvme.step();
    t_nvme.push_back(now_s() - t0);
    fio_between(block, &state_fio);
  }
  if (!torch::equal(p1, p2)) {
    std::fprintf(stderr, "bench_nvme: NVMe state gave other parameters than in-memory state\n");
    return 1;
  }
  const double state_bytes = 16.0 * static_cast<double>(n);  // read m, v; write m, v
  std::vector<double> state_rates;
  for (double t : t_nvme) state_rates.push_back(state_bytes / t);
  const double tm = median(t_mem), tn = median(t_nvme);
  std::printf("%-34s %10s %12s\n", "", "ms/step", "state GB/s");
  std::printf("%-34s %10.1f %12s\n", "FusedAdamW, state in memory", tm * 1e3, "-");
  std::printf("%-34s %10.1f %12.3f  (steps: %s)\n", "FusedAdamW, state in files", tn * 1e3,
              state_bytes / tn / 1e9, list(state_rates, 1e-9).c_str());

  std::vector<double> param_fio;
  // fio's block is the step's largest transfer: an fp32 chunk of the optimizer's, whose
  // slots hold 18 bytes per element with the parameters streamed (its buffer is both
  // sections' buffer_bytes). It is known once the optimizer is built: fio runs from then.
  int64_t param_block = 0;
  const ParamRun pr = param_run(dir, n, cfg.buffer_bytes, true, [&](const std::string& info) {
    if (param_block == 0) {
      const size_t at = info.find("chunks of ");
      param_block = at == std::string::npos ? block : 4 * std::atoll(info.c_str() + at + 10);
    }
    fio_between(param_block, &param_fio);
  });
  const ParamRun in_memory = param_run(dir, n, cfg.buffer_bytes, false);
  std::printf(
      "\nparameters in files too: GPT of %.1fM parameters (width 512, bf16, one rank; %s)\n"
      "%-34s %10s %12s %12s %12s\n",
      pr.params / 1e6, pr.info.c_str(), "per step", "s", "disk read MB", "written MB", "disk GB/s");
  const double fb_bytes = pr.fb_io.first + pr.fb_io.second;
  const double opt_rate = (pr.opt_io.first + pr.opt_io.second) / pr.opt_s;
  std::printf("%-34s %10.3f %12.1f %12.1f %12.3f\n", "forward + backward (gathers, grads)", pr.fb_s,
              pr.fb_io.first / 1e6, pr.fb_io.second / 1e6, fb_bytes / pr.fb_s / 1e9);
  std::printf("%-34s %10.3f %12.1f %12.1f %12.3f  (steps: %s)\n",
              "optimizer step (all five streams)", pr.opt_s, pr.opt_io.first / 1e6,
              pr.opt_io.second / 1e6, opt_rate / 1e9, list(pr.opt_rates, 1e-9).c_str());
  std::printf("%-34s %10.3f\n%-34s %10.3f\n", "forward + backward, in memory", in_memory.fb_s,
              "optimizer step, in memory", in_memory.opt_s);
  std::printf("bytes per parameter and step: forward + backward %.2f, optimizer %.2f\n",
              fb_bytes / pr.params, (pr.opt_io.first + pr.opt_io.second) / pr.params);
  if (!fio_error.empty()) {
    std::printf("skipped: %s\n", fio_error.c_str());
    return 0;
  }
  std::printf(
      "fio, O_DIRECT sequential reader + writer at once, iodepth 2 each, 3 s, between the "
      "steps: state bench (bs %lld) %s GB/s; parameter bench (bs %lld) %s GB/s\n",
      static_cast<long long>(block), list(state_fio, 1e-9).c_str(),
      static_cast<long long>(param_block), list(param_fio, 1e-9).c_str());
  const std::vector<double> state_ratio = ratios(state_rates, state_fio);
  // param_fio[0] ran after the untimed first step, before the first timed one.
  const std::vector<double> param_ratio = ratios(pr.opt_rates, param_fio);
  std::printf("per-step ratios to the fio runs around them: state %s; optimizer step %s\n",
              list(state_ratio, 1).c_str(), list(param_ratio, 1).c_str());
  // Forward and backward are bound by compute or by the disk, whichever is longer: the
  // in-memory time, or their bytes at fio's rate. Their fraction is that bound over the time.
  const double fio_mean = [&]() {
    double sum = 0;
    for (double x : param_fio) sum += x;
    return sum / static_cast<double>(param_fio.size());
  }();
  const double fb_bound = std::max(in_memory.fb_s, fb_bytes / fio_mean);
  std::printf(
      "forward + backward: %.3f s against max(in memory %.3f s, its bytes at fio's %.3f GB/s "
      "%.3f s) = %.3f s\n",
      pr.fb_s, in_memory.fb_s, fio_mean / 1e9, fb_bytes / fio_mean, fb_bound);
  metric("nvme_state_io_fraction", median(state_ratio), "fraction (target >= 0.8)",
         "fio: a sequential O_DIRECT reader and writer at once, same block size, depth and "
         "directory, run between the steps; the median of the steps' ratios");
  metric("nvme_param_step_io_fraction", median(param_ratio), "fraction (target >= 0.8)",
         "the optimizer step with the parameters in files: disk bytes (/proc/self/io) over its "
         "time, against the fio runs around each step; the median");
  metric("nvme_param_forward_backward_fraction", fb_bound / pr.fb_s, "fraction",
         "forward + backward with the parameters in files: the larger of the in-memory time and "
         "its disk bytes at fio's rate, over its time");
  return 0;
}
