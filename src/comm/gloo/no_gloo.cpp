// Stand-in when LibTorch was found without Gloo headers (see CMakeLists.txt).
#include "comm/backend.h"

namespace fsdp::detail {
std::shared_ptr<Backend> make_gloo_backend(const BackendInit&) {
  TORCH_CHECK(false,
              "fsdp was built without Gloo, so multi-process CPU training is unavailable. "
              "Rebuild with Gloo's headers: -DGLOO_INCLUDE_DIR=DIR (Debian's libgloo-dev, or the "
              "ones scripts/setup.sh unpacks into .venv/fsdp/gloo/include), "
              "or use backend \"nccl\" on GPUs.");
}
}  // namespace fsdp::detail
