// fsdp-consolidate: a sharded checkpoint -> one consolidated HDF5 file, or safetensors
// for inference tools, offline.
//
//   fsdp-consolidate SHARDED_DIR OUT.h5 [--dtype fp32|bf16|fp16] [--with-optimizer]
//   fsdp-consolidate SHARDED_DIR OUT_DIR --format safetensors [--dtype ...] [--max-shard-size
//   BYTES]
//
// No process group: it reads the rank files one parameter at a time, so its memory
// stays about one parameter plus a constant whatever the model size.
#include "checkpoint/offline/offline.h"

#include <fsdp/core/options.h>
#include <fsdp/version.h>

#include "tool_main.h"

#include <cxxopts.hpp>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>

namespace {
// Peak resident memory of this process (VmHWM), in MiB.
double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

cxxopts::Options make_options() {
  cxxopts::Options opts(
      "fsdp-consolidate",
      "Turns a sharded fsdp checkpoint into one consolidated HDF5 file, or into safetensors");
  opts.positional_help("SHARDED_DIR OUT.h5|OUT_DIR");
  opts.add_options()(
      "dtype", "dtype of the written parameters: fp32, bf16 or fp16",
      cxxopts::value<std::string>()->default_value(fsdp::to_string(fsdp::Precision::kFp32)))(
      "format",
      "hdf5 (one file) or safetensors (a directory: model.safetensors, or shards and an index)",
      cxxopts::value<std::string>()->default_value("hdf5"))(
      "max-shard-size", "safetensors: most bytes of tensor data per file",
      cxxopts::value<std::string>()->default_value("5000000000"))(
      "with-optimizer", "also write /optimizer/<FQN>/<state> (hdf5 only)")(
      "q,quiet", "no progress output")("h,help", "show this help")("version", "print the version")(
      "sharded", "", cxxopts::value<std::string>())("out", "", cxxopts::value<std::string>());
  opts.parse_positional({"sharded", "out"});
  return opts;
}

/// What the command line asks for.
struct Request {
  std::string in, out;            ///< SHARDED_DIR and OUT.h5 or OUT_DIR
  fsdp::ckpt::ExportDtype dtype;  ///< --dtype
  bool safetensors = false;       ///< --format safetensors
  bool with_optimizer = false;    ///< --with-optimizer
  uint64_t max_shard = 0;         ///< --max-shard-size, in bytes
  bool quiet = false;             ///< --quiet
};

fsdp::ckpt::ExportDtype parse_dtype(const std::string& d) {
  fsdp::Precision p = fsdp::Precision::kFp32;
  try {  // the options core's names (Note [Options core])
    p = fsdp::core::parse_precision(d, "--dtype", fsdp::core::Surface::kFlags);
  } catch (const std::invalid_argument& e) {
    throw fsdp::tools::UsageError(e.what());
  }
  return p == fsdp::Precision::kFp32   ? fsdp::ckpt::ExportDtype::kF32
         : p == fsdp::Precision::kBf16 ? fsdp::ckpt::ExportDtype::kBF16
                                       : fsdp::ckpt::ExportDtype::kF16;
}

uint64_t parse_max_shard(const std::string& m) {
  uint64_t max_shard = 0;
  size_t used = 0;
  try {
    max_shard = std::stoull(m, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != m.size() || m.empty() || m[0] == '-' || max_shard == 0) {
    throw fsdp::tools::UsageError("--max-shard-size " + m +
                                  " is not a positive number of bytes (e.g. 5000000000)");
  }
  return max_shard;
}

Request read_request(const cxxopts::ParseResult& r) {
  if (!r.count("sharded") || !r.count("out")) {
    throw fsdp::tools::UsageError(
        "expected SHARDED_DIR and OUT.h5 (or OUT_DIR with --format safetensors)\n"
        "usage: fsdp-consolidate SHARDED_DIR OUT.h5 [--dtype fp32|bf16|fp16] [--with-optimizer]\n"
        "       fsdp-consolidate SHARDED_DIR OUT_DIR --format safetensors [--dtype ...] "
        "[--max-shard-size BYTES]");
  }
  Request q;
  q.dtype = parse_dtype(r["dtype"].as<std::string>());
  q.with_optimizer = r.count("with-optimizer") > 0;
  const std::string format = r["format"].as<std::string>();
  if (format != "hdf5" && format != "safetensors") {
    throw fsdp::tools::UsageError("--format " + format + " is unknown; use hdf5 or safetensors");
  }
  q.safetensors = format == "safetensors";
  if (q.safetensors && q.with_optimizer) {
    throw fsdp::tools::UsageError(
        "--with-optimizer needs --format hdf5: safetensors holds weights only");
  }
  q.max_shard = parse_max_shard(r["max-shard-size"].as<std::string>());
  q.quiet = r.count("quiet") > 0;
  q.in = r["sharded"].as<std::string>();
  q.out = r["out"].as<std::string>();
  return q;
}

// Progress on stderr: on a terminal one line updates in place; in a log, a line per 10%.
class ProgressLine {
 public:
  explicit ProgressLine(bool quiet) : quiet_(quiet), tty_(::isatty(2) != 0) {}

  void operator()(size_t done, size_t total, const std::string& fqn) {
    const size_t pct = total ? done * 100 / total : 100;
    const size_t step = tty_ ? 1 : 10;
    if (quiet_ || (pct / step == last_pct_ / step && done != total)) return;
    last_pct_ = pct;
    std::cerr << (tty_ ? "\r" : "") << "[fsdp-consolidate] " << done << "/" << total
              << " parameters (" << pct << "%) " << fqn << (tty_ ? "\033[K" : "\n") << std::flush;
  }
  // Ends the line that updates in place (before an error or the summary).
  void end_line() const {
    if (tty_ && !quiet_) std::cerr << "\n";
  }

 private:
  bool quiet_, tty_;
  size_t last_pct_ = 101;
};

int run(int argc, char** argv) {
  auto opts = make_options();
  auto r = opts.parse(argc, argv);
  if (r.count("help")) {
    std::cout << opts.help() << std::endl;
    return 0;
  }
  if (r.count("version")) {
    std::cout << fsdp::version_line("fsdp-consolidate") << std::endl;
    return 0;
  }
  const Request q = read_request(r);
  const auto t0 = std::chrono::steady_clock::now();
  ProgressLine progress(q.quiet);
  const fsdp::ckpt::Progress report = std::ref(progress);
  try {
    if (q.safetensors) {
      fsdp::ckpt::consolidate_offline_safetensors(q.in, q.out, q.dtype, q.max_shard, report);
    } else {
      fsdp::ckpt::consolidate_offline(q.in, q.out, q.dtype, q.with_optimizer, report);
    }
  } catch (...) {
    progress.end_line();  // before the error
    throw;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  progress.end_line();
  std::cerr << "[fsdp-consolidate] wrote " << q.out << " in " << s << " s, peak RSS "
            << peak_rss_mib() << " MiB" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-consolidate", [&] { return run(argc, argv); });
}
