#pragma once
// The main() of every command-line tool (fsdp-consolidate, fsdp-inspect, fsdp-estimate,
// fsdp-run): errors are printed as "<tool>: error: <message>"; a command line that
// cannot run as given exits 2, any other failure 1. Needs no LibTorch.

#include <cxxopts.hpp>

#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

namespace fsdp::tools {

/// A command line that cannot be run as given: the tool exits 2.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// `what` without the backtrace LibTorch's c10::Error appends in some builds.
inline std::string without_backtrace(const std::string& what) {
  const size_t at = what.find("\nException raised from ");
  return at == std::string::npos ? what : what.substr(0, at);
}

/// Runs `run()` (which returns the exit status) and turns what it throws into a message
/// and an exit status: UsageError and cxxopts' parse errors 2, everything else 1.
template <class Run>
int tool_main(const char* tool, Run&& run) noexcept {
  try {
    try {
      return run();
    } catch (const UsageError& e) {
      std::cerr << tool << ": error: " << e.what() << std::endl;
      return 2;
    } catch (const cxxopts::exceptions::exception& e) {
      std::cerr << tool << ": error: " << e.what() << "; see --help" << std::endl;
      return 2;
    } catch (const std::exception& e) {
      std::cerr << tool << ": error: " << without_backtrace(e.what()) << std::endl;
      return 1;
    }
  } catch (...) {  // printing failed, or something not derived from std::exception
    return 1;
  }
}

}  // namespace fsdp::tools
