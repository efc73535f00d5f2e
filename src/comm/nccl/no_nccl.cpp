// Stand-in for the NCCL backend (backend_nccl.cpp) when LibTorch has no CUDA (see
// CMakeLists.txt).
#include "comm/backend.h"

namespace fsdp::detail {
bool nccl_available() { return false; }
std::shared_ptr<Backend> make_nccl_backend(const BackendInit&) {
  TORCH_CHECK(false,
              "fsdp was built against a CPU-only LibTorch, so the NCCL backend is unavailable. "
              "Use backend \"gloo\", or rebuild against a CUDA LibTorch (cmake "
              "-DCMAKE_PREFIX_PATH=<libtorch "
              "with CUDA>).");
}
}  // namespace fsdp::detail
