// fsdp-inspect: prints what a checkpoint holds and verifies it.
//
//   fsdp-inspect CHECKPOINT [--no-verify]
//
// CHECKPOINT is a sharded checkpoint directory (or a directory with a `latest` marker)
// or a consolidated .h5 file. Exits 0 when the checkpoint is complete and every
// checksum matches, 1 on any problem (named on stderr), 2 on bad usage.
#include <fsdp/version.h>
#include "checkpoint/offline/offline.h"

#include "tool_main.h"

#include <cxxopts.hpp>

#include <iostream>

namespace {

int run(int argc, char** argv) {
  cxxopts::Options opts("fsdp-inspect", "Describes and verifies an fsdp checkpoint");
  opts.positional_help("CHECKPOINT");
  opts.add_options()("no-verify", "describe only; do not read every dataset")(
      "h,help", "show this help")("version", "print the version")("path", "",
                                                                  cxxopts::value<std::string>());
  opts.parse_positional({"path"});
  auto r = opts.parse(argc, argv);
  if (r.count("help")) {
    std::cout << opts.help() << std::endl;
    return 0;
  }
  if (r.count("version")) {
    std::cout << fsdp::version_line("fsdp-inspect") << std::endl;
    return 0;
  }
  if (!r.count("path"))
    throw fsdp::tools::UsageError(
        "expected CHECKPOINT\nusage: fsdp-inspect CHECKPOINT [--no-verify]");
  std::cout << fsdp::ckpt::inspect(r["path"].as<std::string>(), r.count("no-verify") == 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-inspect", [&] { return run(argc, argv); });
}
