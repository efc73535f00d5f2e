// Benchmark: sharded checkpoint save and load throughput against a raw sequential
// write and read of the same bytes, in the same run and directory; and fsdp-consolidate's
// peak RSS against the largest parameter.
//
//   bench_checkpoint [--gb 1.0] [--dir DIR]
//
// Prints a table and JSON lines ({"metric": ..., "value": ...}).
#include <fsdp/checkpoint.h>
#include <fsdp/fsdp.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Raw baseline: the same bytes, one file, write() in 64 MB pieces, then fsync.
double raw_write(const std::string& path, const std::vector<torch::Tensor>& ts) {
  const double t0 = now_s();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (const auto& t : ts) {
    const char* p = static_cast<const char*>(t.data_ptr());
    size_t left = static_cast<size_t>(t.numel()) * 4;
    while (left > 0) {
      ssize_t n = ::write(fd, p, std::min<size_t>(left, 64u << 20));
      if (n <= 0) throw std::runtime_error("raw write failed");
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  ::fsync(fd);
  ::close(fd);
  return now_s() - t0;
}

double raw_read(const std::string& path, const std::vector<torch::Tensor>& ts) {
  const double t0 = now_s();
  int fd = ::open(path.c_str(), O_RDONLY);
  for (const auto& t : ts) {
    char* p = static_cast<char*>(t.data_ptr());
    size_t left = static_cast<size_t>(t.numel()) * 4;
    while (left > 0) {
      ssize_t n = ::read(fd, p, std::min<size_t>(left, 64u << 20));
      if (n <= 0) throw std::runtime_error("raw read failed");
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return now_s() - t0;
}

// Peak RSS (bytes) of a child command.
long peak_rss_of(const std::vector<std::string>& argv) {
  pid_t pid = fork();
  if (pid == 0) {
    int devnull = ::open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  wait4(pid, &status, 0, &ru);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("child " + argv[0] + " failed");
  return ru.ru_maxrss * 1024L;
}

void metric(const std::string& name, double value, const std::string& unit) {
  std::printf("{\"metric\": \"%s\", \"value\": %.4f, \"unit\": \"%s\"}\n", name.c_str(), value, unit.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  double gb = 1.0;
  std::string dir = "build/bench/ckpt";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--gb")) gb = std::stod(argv[i + 1]);
    if (!std::strcmp(argv[i], "--dir")) dir = argv[i + 1];
  }
  fs::remove_all(dir);
  fs::create_directories(dir);

  // Linear layers of 2048 x 8192 (64 MB each in fp32), each its own unit.
  const int64_t in = 2048, out = 8192;
  const int layers = std::max(1, static_cast<int>(gb * (1 << 30) / (in * out * 4.0) + 0.999));
  torch::NoGradGuard g;
  torch::nn::Sequential seq;
  for (int i = 0; i < layers; ++i) seq->push_back(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
  auto model = fsdp::shard_sequential(seq);
  auto shards = model->sharded_parameters();
  int64_t bytes = 0;
  for (auto& s : shards) bytes += s.numel() * 4;
  const double mb = static_cast<double>(bytes) / (1 << 20);
  std::cout << "checkpoint benchmark: " << layers << " units, " << mb << " MiB of fp32 parameters, dir " << dir
            << "\n";

  fsdp::TrainingState st;
  st.step = 1;
  // Warm-up (file system metadata, page cache state), then measure alternately.
  const std::string raw = dir + "/raw.bin";
  raw_write(raw, shards);
  double t_raw_w = 1e30, t_save = 1e30, t_raw_r = 1e30, t_load = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    t_raw_w = std::min(t_raw_w, raw_write(raw, shards));
    double t0 = now_s();
    fsdp::SaveOptions so;
    so.keep_last = 1;
    st.step = rep + 1;
    fsdp::save_sharded_checkpoint(dir + "/sharded", *model, nullptr, st, so);
    t_save = std::min(t_save, now_s() - t0);
    t_raw_r = std::min(t_raw_r, raw_read(raw, shards));
    t0 = now_s();
    fsdp::load_sharded_checkpoint(dir + "/sharded", *model, nullptr, nullptr);
    t_load = std::min(t_load, now_s() - t0);
  }
  std::printf("%-34s %10s %10s\n", "", "seconds", "MiB/s");
  std::printf("%-34s %10.3f %10.0f\n", "raw write (write + fsync)", t_raw_w, mb / t_raw_w);
  std::printf("%-34s %10.3f %10.0f\n", "sharded save (HDF5 + fletcher32)", t_save, mb / t_save);
  std::printf("%-34s %10.3f %10.0f\n", "raw read", t_raw_r, mb / t_raw_r);
  std::printf("%-34s %10.3f %10.0f\n", "sharded load (verify checksums)", t_load, mb / t_load);
  metric("ckpt_save_vs_raw_write", t_raw_w / t_save, "throughput ratio (target >= 0.8)");
  metric("ckpt_load_vs_raw_read", t_raw_r / t_load, "throughput ratio (target >= 0.8)");

  // Offline consolidation: peak RSS against the largest parameter.
  const std::string self = fs::canonical("/proc/self/exe").parent_path().string();
  const long base = peak_rss_of({self + "/fsdp-consolidate", "--help"});
  const long peak = peak_rss_of({self + "/fsdp-consolidate", dir + "/sharded", dir + "/full.h5", "-q"});
  const double largest = static_cast<double>(in * out * 4);
  std::printf("fsdp-consolidate: peak RSS %.1f MiB (process baseline %.1f MiB), largest parameter %.1f MiB\n",
              peak / 1048576.0, base / 1048576.0, largest / 1048576.0);
  metric("consolidate_peak_rss_minus_largest_param_mib", (peak - largest) / 1048576.0, "MiB (target <= 64)");
  metric("consolidate_peak_rss_above_baseline_minus_largest_param_mib", (peak - base - largest) / 1048576.0,
         "MiB");
  fs::remove_all(dir);
  return 0;
}
