#pragma once
// What train_gpt and generate share as command-line programs: errors are printed as
// "<program>: error: <message>"; a command line that cannot run as given exits 2, any
// other failure 1.

#include <torch/torch.h>

#include <cxxopts.hpp>

#include <iostream>
#include <stdexcept>

namespace gpt {

/// A command line that cannot be run as given: the program exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Runs `run()` (which returns the exit status), turning what it throws into a message
/// and an exit status.
template <class Run>
int program_main(const char* program, Run&& run) {
  try {
    return run();
  } catch (const UsageError& e) {
    std::cerr << program << ": error: " << e.what() << std::endl;
    return 2;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << program << ": error: " << e.what() << "; see --help" << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << program << ": error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << program << ": error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace gpt
