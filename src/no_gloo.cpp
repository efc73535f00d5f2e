// Stand-in when LibTorch was found without Gloo headers (see CMakeLists.txt).
#include "backend.h"

namespace fsdp::detail {
std::shared_ptr<Backend> make_gloo_backend(const BackendInit&) {
  TORCH_CHECK(false,
              "fsdp was built without Gloo, so multi-process CPU training is unavailable. "
              "Install the Gloo headers (Debian: apt-get install libgloo-dev) and rebuild, "
              "or use backend \"nccl\" on GPUs.");
}
}  // namespace fsdp::detail
