// The safetensors reader (checkpoint/safetensors.cpp): the input is a whole .safetensors
// file (8-byte header length, JSON header, data). Every tensor it accepts is read.
#include "format/safetensors/safetensors.h"
#include "fuzz_support.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch() + "/model.safetensors";
  fuzz::write_file(path, data, size);
  fuzz::NoFdLeak no_leak;
  fuzz::expect_error_or_success([&] {
    fsdp::st::Reader r(path);
    std::vector<char> buf;
    for (const auto& [name, e] : r.entries()) {
      const uint64_t n = std::min<uint64_t>(e.end - e.begin, 1 << 16);
      buf.resize(n);
      r.read(name, 0, n, buf.data());
    }
  });
  return 0;
}
