// Stand-ins for the CUDA-only code of src/cuda/ when LibTorch has no CUDA (see
// CMakeLists.txt).
#include "backend.h"
#include "transfers.h"

namespace fsdp::detail {
namespace {
constexpr const char* kRebuild =
    "rebuild against a CUDA LibTorch (cmake -DCMAKE_PREFIX_PATH=<libtorch with CUDA>).";
}  // namespace

bool nccl_available() { return false; }
std::shared_ptr<Backend> make_nccl_backend(const BackendInit&) {
  TORCH_CHECK(false,
              "fsdp was built against a CPU-only LibTorch, so the NCCL backend is unavailable. "
              "Use backend \"gloo\", or ", kRebuild);
}
std::shared_ptr<Transfers> make_cuda_transfers(at::Device device) {
  TORCH_CHECK(false, "fsdp was built against a CPU-only LibTorch, so it cannot offload to ", device,
              "; ", kRebuild);
}
}  // namespace fsdp::detail
