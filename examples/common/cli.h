#pragma once
// What the example programs share as command-line programs: errors are printed as
// "<program>: error: <message>"; a command line that cannot run as given exits 2, any
// other failure 1.

#include "attention.h"

#include <torch/torch.h>

#include <cxxopts.hpp>

#include <unistd.h>

#include <cerrno>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>

namespace examples {

/// Writes "<program>: error: <message>\n" to stderr in one write(2): the ranks of a job
/// share one stderr, and a message written piecewise (as `std::cerr <<` does) came out
/// interleaved with another rank's ("train_gpttrain_gpt: error: : error: ...").
inline void print_error(const char* program, const std::string& message) {
  const std::string line = std::string(program) + ": error: " + message + "\n";
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

/// A command line that cannot be run as given: the program exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A --prompt must give at least one token.
inline void check_prompt(bool empty) {
  if (empty) throw UsageError("--prompt is empty; give at least one byte of text to continue");
}

/// fn's result; the std::invalid_argument of a rule it broke (the options core's, whose
/// messages name the flags) as a UsageError.
template <class Fn>
auto usage_checked(Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

/// Parses argv with `options`. std::nullopt after printing --help; a UsageError for an
/// argument no flag takes, or for a `required` flag left out.
inline std::optional<cxxopts::ParseResult> parse_command_line(
    cxxopts::Options& options, int argc, char** argv, std::initializer_list<const char*> required) {
  auto r = options.parse(argc, argv);
  if (r.count("help")) {
    std::cout << options.help() << std::endl;
    return std::nullopt;
  }
  if (!r.unmatched().empty())
    throw UsageError("unexpected argument '" + r.unmatched()[0] + "'; see --help");
  for (const char* need : required) {
    if (!r.count(need)) throw UsageError(std::string("--") + need + " is required; see --help");
  }
  return r;
}

/// The kernel --attention names (examples/common/attention.h); a UsageError otherwise.
inline AttentionKernel parse_attention_flag(const std::string& value) {
  try {
    return parse_attention_kernel(value);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

/// Runs `run()` (which returns the exit status), turning what it throws into a message
/// and an exit status.
template <class Run>
int program_main(const char* program, Run&& run) {
  try {
    return run();
  } catch (const UsageError& e) {
    print_error(program, e.what());
    return 2;
  } catch (const cxxopts::exceptions::exception& e) {
    print_error(program, std::string(e.what()) + "; see --help");
    return 2;
  } catch (const c10::Error& e) {
    print_error(program, e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    print_error(program, e.what());
    return 1;
  }
}

}  // namespace examples
