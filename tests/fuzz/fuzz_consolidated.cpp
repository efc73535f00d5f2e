// The consolidated-file reader the tools use (checkpoint/offline/inspect.cpp: fsdp-inspect
// --verify reads every dataset and checks its checksums): the input is a consolidated
// .h5 file.
#include "format/layout.h"
#include "fuzz_support.h"
#include "offline/offline.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch() + "/model.h5";
  fuzz::write_file(path, data, size);
  fuzz::expect_error_or_success([&] { (void)fsdp::ckpt::inspect(path, /*verify=*/true); });
  return 0;
}
