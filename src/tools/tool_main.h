#pragma once
// The main() of every command-line tool (fsdp-consolidate, fsdp-inspect, fsdp-estimate,
// fsdp-run): errors are printed as "<tool>: error: <message>"; a command line that
// cannot run as given exits 2, any other failure 1. Needs no LibTorch.

#include <cxxopts.hpp>

#include <unistd.h>

#include <cerrno>
#include <exception>
#include <stdexcept>
#include <string>

namespace fsdp::tools {

/// Writes "<tool>: error: <message>\n" to stderr in one write(2): every rank of a job
/// shares the launcher's stderr, and a message written piecewise (as `std::cerr <<` does)
/// came out interleaved with another rank's ("train_gpttrain_gpt: error: : error: ...").
inline void print_error(const char* tool, const std::string& message) {
  const std::string line = std::string(tool) + ": error: " + message + "\n";
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

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
      print_error(tool, e.what());
      return 2;
    } catch (const cxxopts::exceptions::exception& e) {
      print_error(tool, std::string(e.what()) + "; see --help");
      return 2;
    } catch (const std::exception& e) {
      print_error(tool, without_backtrace(e.what()));
      return 1;
    }
  } catch (...) {  // printing failed, or something not derived from std::exception
    return 1;
  }
}

}  // namespace fsdp::tools
