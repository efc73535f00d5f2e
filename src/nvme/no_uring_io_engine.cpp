// Stand-in for uring_io_engine.cpp in builds without liburing: the thread pool serves.
#include "io_engine.h"

namespace fsdp::detail::nvme {

std::unique_ptr<IoEngine> make_uring_engine(unsigned, std::string* why) {
  if (why) *why = "this build has no liburing (install liburing-dev and reconfigure)";
  return nullptr;
}

}  // namespace fsdp::detail::nvme
