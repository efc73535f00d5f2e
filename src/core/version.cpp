// The library's version (see fsdp/version.h); linked into every tool, needs no LibTorch.
#include <fsdp/checkpoint_format.h>
#include <fsdp/version.h>

namespace fsdp {

const char* version() { return FSDP_VERSION_STRING; }

std::string version_line(const std::string& tool) {
  return tool + " (fsdp-libtorch) " + version() + ", checkpoint format " +
         std::to_string(ckpt::kCheckpointFormatBaseVersion) + " (reads 1 to " +
         std::to_string(ckpt::kCheckpointFormatVersion) + ")";
}

}  // namespace fsdp
