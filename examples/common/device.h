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

/// The device `spec` (a --device value) names on this machine, for this rank.
inline torch::Device parse_device_flag(const std::string& spec) {
  try {
    return fsdp::choose_device(spec, "--device");
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

/// The job's process group, over the backend that suits `device`.
inline fsdp::ProcessGroup init_process_group_for(const torch::Device& device) {
  fsdp::ProcessGroupOptions o;
  o.backend = fsdp::backend_for(device);
  return fsdp::init_process_group(o);
}

}  // namespace examples
