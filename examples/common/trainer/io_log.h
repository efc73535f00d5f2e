#pragma once
// train_gpt --io-log FILE: rank 0 appends one JSON object per checkpoint save, load and
// consolidated export, {"event", "path", "seconds"}. Each is timed from a barrier to a
// barrier, so the figure is the slowest rank's (scripts/bench/compare-pytorch.sh compares it
// with DCP's).

#include <fsdp/fsdp.h>

#include <fstream>
#include <functional>
#include <string>

namespace lm {

class IoLog {
 public:
  /// `path` "": no log, and no barriers. Throws a UsageError if rank 0 cannot write it.
  /// `device`: where the ranks' figures are reduced (NCCL reduces device tensors only).
  IoLog(const std::string& path, fsdp::ProcessGroup pg, torch::Device device = torch::kCPU);

  /// Runs `op`, which returns the path it read or wrote, and logs it as `event`.
  void timed(const char* event, const std::function<std::string()>& op);
  /// Logs `seconds`, measured by each rank, as `event`: the slowest rank's (collective
  /// when the log is on).
  void record(const char* event, const std::string& path, double seconds);

 private:
  fsdp::ProcessGroup pg_;
  torch::Device device_;
  bool enabled_;        ///< --io-log given: every rank takes part in the barriers
  std::ofstream file_;  ///< open on rank 0 only
};

}  // namespace lm
