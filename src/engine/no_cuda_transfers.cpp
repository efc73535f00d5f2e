// Stand-in for the CUDA offload streams (transfers_cuda.cpp) when LibTorch has no CUDA
// (see CMakeLists.txt).
#include "transfers.h"

#include <fsdp/stats.h>

#include <c10/util/Exception.h>

namespace fsdp::detail {
std::shared_ptr<Transfers> make_cuda_transfers(at::Device device) {
  TORCH_CHECK(
      false, "fsdp was built against a CPU-only LibTorch, so it cannot offload to ", device,
      "; rebuild against a CUDA LibTorch (cmake -DCMAKE_PREFIX_PATH=<libtorch with CUDA>).");
}
}  // namespace fsdp::detail

namespace fsdp {
stats::DeviceMemory stats::device_memory(const c10::Device& device) {
  TORCH_CHECK(false, "device_memory(", device,
              "): fsdp was built against a CPU-only LibTorch, which has no CUDA caching "
              "allocator; rebuild against a CUDA LibTorch");
}
void stats::reset_device_peak_memory(const c10::Device& device) {
  TORCH_CHECK(false, "reset_device_peak_memory(", device,
              "): fsdp was built against a CPU-only LibTorch, which has no CUDA caching "
              "allocator; rebuild against a CUDA LibTorch");
}
}  // namespace fsdp
