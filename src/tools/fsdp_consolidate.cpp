// fsdp-consolidate: a sharded checkpoint -> one consolidated HDF5 file, or safetensors
// for inference tools, offline.
//
//   fsdp-consolidate SHARDED_DIR OUT.h5 [--dtype fp32|bf16|fp16] [--with-optimizer]
//   fsdp-consolidate SHARDED_DIR OUT_DIR --format safetensors [--dtype ...] [--max-shard-size
//   BYTES]
//
// No process group: it reads the rank files one parameter at a time, so its memory
// stays about one parameter plus a constant whatever the model size.
#include "internal/offline.h"

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

int run(int argc, char** argv) {
  cxxopts::Options opts(
      "fsdp-consolidate",
      "Turns a sharded fsdp checkpoint into one consolidated HDF5 file, or into safetensors");
  opts.positional_help("SHARDED_DIR OUT.h5|OUT_DIR");
  opts.add_options()("dtype", "dtype of the written parameters: fp32, bf16 or fp16",
                     cxxopts::value<std::string>()->default_value("fp32"))(
      "format",
      "hdf5 (one file) or safetensors (a directory: model.safetensors, or shards and an index)",
      cxxopts::value<std::string>()->default_value("hdf5"))(
      "max-shard-size", "safetensors: most bytes of tensor data per file",
      cxxopts::value<std::string>()->default_value("5000000000"))(
      "with-optimizer", "also write /optimizer/<FQN>/<state> (hdf5 only)")(
      "q,quiet", "no progress output")("h,help", "show this help")("version", "print the version")(
      "sharded", "", cxxopts::value<std::string>())("out", "", cxxopts::value<std::string>());
  opts.parse_positional({"sharded", "out"});
  {
    auto r = opts.parse(argc, argv);
    if (r.count("help")) {
      std::cout << opts.help() << std::endl;
      return 0;
    }
    if (r.count("version")) {
      std::cout << fsdp::version_line("fsdp-consolidate") << std::endl;
      return 0;
    }
    if (!r.count("sharded") || !r.count("out")) {
      throw fsdp::tools::UsageError(
          "expected SHARDED_DIR and OUT.h5 (or OUT_DIR with --format safetensors)\n"
          "usage: fsdp-consolidate SHARDED_DIR OUT.h5 [--dtype fp32|bf16|fp16] [--with-optimizer]\n"
          "       fsdp-consolidate SHARDED_DIR OUT_DIR --format safetensors [--dtype ...] "
          "[--max-shard-size BYTES]");
    }
    const std::string d = r["dtype"].as<std::string>();
    fsdp::ckpt::ExportDtype dtype;
    if (d == "fp32")
      dtype = fsdp::ckpt::ExportDtype::kF32;
    else if (d == "bf16")
      dtype = fsdp::ckpt::ExportDtype::kBF16;
    else if (d == "fp16")
      dtype = fsdp::ckpt::ExportDtype::kF16;
    else {
      throw fsdp::tools::UsageError("--dtype " + d + " is unknown; use fp32, bf16 or fp16");
    }
    const bool with_optimizer = r.count("with-optimizer") > 0;
    const std::string format = r["format"].as<std::string>();
    if (format != "hdf5" && format != "safetensors") {
      throw fsdp::tools::UsageError("--format " + format + " is unknown; use hdf5 or safetensors");
    }
    if (format == "safetensors" && with_optimizer) {
      throw fsdp::tools::UsageError(
          "--with-optimizer needs --format hdf5: safetensors holds weights only");
    }
    uint64_t max_shard = 0;
    {
      const std::string m = r["max-shard-size"].as<std::string>();
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
    }
    const bool quiet = r.count("quiet") > 0;
    const auto t0 = std::chrono::steady_clock::now();
    // On a terminal one line updates in place; in a log, a line per 10%.
    const bool tty = ::isatty(2) != 0;
    size_t last_pct = 101;
    auto progress = [&](size_t done, size_t total, const std::string& fqn) {
      const size_t pct = total ? done * 100 / total : 100;
      const size_t step = tty ? 1 : 10;
      if (quiet || (pct / step == last_pct / step && done != total)) return;
      last_pct = pct;
      if (tty) {
        std::cerr << "\r[fsdp-consolidate] " << done << "/" << total << " parameters (" << pct
                  << "%) " << fqn << "\033[K" << std::flush;
      } else {
        std::cerr << "[fsdp-consolidate] " << done << "/" << total << " parameters (" << pct
                  << "%) " << fqn << "\n";
      }
    };
    const std::string in = r["sharded"].as<std::string>(), out = r["out"].as<std::string>();
    try {
      if (format == "safetensors") {
        fsdp::ckpt::consolidate_offline_safetensors(in, out, dtype, max_shard, progress);
      } else {
        fsdp::ckpt::consolidate_offline(in, out, dtype, with_optimizer, progress);
      }
    } catch (...) {
      if (tty && !quiet) std::cerr << "\n";  // end the progress line before the error
      throw;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << (quiet || !tty ? "" : "\n") << "[fsdp-consolidate] wrote " << out << " in " << s
              << " s, peak RSS " << peak_rss_mib() << " MiB" << std::endl;
    return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-consolidate", [&] { return run(argc, argv); });
}
