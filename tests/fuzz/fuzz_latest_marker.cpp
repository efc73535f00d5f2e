// Resolving a checkpoint directory's `latest` marker (checkpoint/format/layout.cpp): the input
// is the marker's text; the directory also holds one real-looking checkpoint name.
#include "format/layout.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch() + "/ck";
    std::filesystem::create_directories(d + "/step_00000002");
    std::ofstream(d + "/step_00000002/rank_00000.h5") << "not hdf5";
    return d;
  }();
  fuzz::write_file(dir + "/latest", data, size);
  fuzz::NoFdLeak no_leak;
  fuzz::expect_error_or_success([&] { (void)fsdp::ckpt::resolve_checkpoint_dir(dir); });
  return 0;
}
