#pragma once
// The --device flag every example takes: cpu, cuda (the GPU of LOCAL_RANK), cuda:N or
// auto (the default: cuda when each rank of this machine has a GPU, else cpu), and the process
// group that goes with it (NCCL on a GPU, Gloo on the CPU). A value that cannot work is a
// UsageError (exit 2) naming the value and the fix (fsdp::choose_device's message).

#include <fsdp/fsdp.h>

#include "cli.h"

#include <string>

namespace examples {

/// The --device flag's help text.
inline constexpr const char* kDeviceHelp =
    "cpu|cuda|cuda:N|auto (cuda: the GPU of LOCAL_RANK, i.e. cuda:LOCAL_RANK % device count; "
    "auto: cuda when a GPU is visible for each rank on this machine, else cpu)";

/// The --backend flag's help text (the trainer's).
inline constexpr const char* kBackendHelp =
    "auto|gloo|nccl: the collectives' backend (auto: nccl on a GPU, gloo on the CPU); gloo with "
    "--device cuda stages the tensors through pinned host memory, so that several ranks may "
    "share one GPU (for tests: everything but NCCL itself runs)";

/// The device `spec` (a --device value) names on this machine, for this rank, under the
/// process group's `backend` (a --backend value: gloo lets ranks share a GPU).
inline torch::Device parse_device_flag(const std::string& spec,
                                       const std::string& backend = "auto") {
  try {
    return fsdp::choose_device(spec, "--device", backend);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

/// The backend a --backend value names for `device`; a UsageError for a value that
/// cannot work there.
inline std::string parse_backend_flag(const torch::Device& device, const std::string& choice) {
  try {
    return fsdp::backend_for(device, choice, "--backend");
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

/// The job's process group, over `backend` (default: the one that suits `device`).
inline fsdp::ProcessGroup init_process_group_for(const torch::Device& device,
                                                 const std::string& backend = "auto") {
  fsdp::ProcessGroupOptions o;
  o.backend = parse_backend_flag(device, backend);
  return fsdp::init_process_group(o);
}

}  // namespace examples
