#pragma once
// Multi-rank tests in real processes over Gloo on localhost.
//
// A test calls run_ranks(N, body). In the test process it starts N rank processes with a
// torchrun environment on a free port, and fails if any rank fails (printing that rank's
// output). A rank is forked from the test process where that is safe (one thread, no
// `env` of its own), else it is this test binary started afresh and filtered to the
// current test (the Note in run_ranks). In each rank, run_ranks builds the process group
// from that environment and runs body on it. A rank's output lines that
// start with "[report] " (figures a test shows) are printed by the test process.

#include <fsdp/process_group.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp::testing {

/// True inside a rank process started by run_ranks.
bool is_rank_process();

/// Runs `body` on `world` ranks (see above). `timeout_s` bounds the whole run. `env`
/// ("NAME=value") is set in the ranks, over the defaults (e.g. "FSDP_TIMEOUT_S=3"; 60
/// otherwise).
void run_ranks(int world, const std::function<void(const ProcessGroup&)>& body, int timeout_s = 300,
               const std::vector<std::string>& env = {});

/// Called in a rank's body that left its process group unusable on purpose (a
/// collective timed out): the rank exits after the body without the closing barrier.
void skip_final_barrier();

/// A TCP port that was free a moment ago on 127.0.0.1.
int free_port();

/// Result of running a command.
struct CommandResult {
  int exit_code = -1;  ///< exit status, or 128+signal
  std::string output;  ///< stdout and stderr together
  bool timed_out = false;
};

/// Runs argv with extra environment entries ("K=V"), collecting its output.
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env = {}, int timeout_s = 120);

/// Path of this test binary's directory (build/bin).
std::string bin_dir();

}  // namespace fsdp::testing
