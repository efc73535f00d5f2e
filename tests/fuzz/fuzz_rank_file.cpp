// The sharded rank-file loader (checkpoint/format/layout.cpp, ShardedReader): the input is
// rank 0's file of a one-rank checkpoint. Whatever index it yields is read in full, as
// the offline consolidation and the resharding loader do, and the checksums verified
// (fsdp-inspect --verify's path).
#include "format/layout.h"
#include "fuzz_support.h"
#include "offline/offline.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch() + "/step_00000001";
    std::filesystem::create_directories(d);
    return d;
  }();
  fuzz::write_file(dir + "/rank_00000.h5", data, size);
  fuzz::expect_error_or_success([&] {
    fsdp::ckpt::ShardedReader r(dir);
    std::vector<float> buf;
    for (size_t k = 0; k < r.flats().size(); ++k) {
      const auto& f = r.flats()[k];
      const int64_t n = std::min<int64_t>(f.numel, 1 << 16);
      if (n <= 0) continue;
      buf.resize(static_cast<size_t>(n));
      r.read(k, "param", 0, n, buf.data());
      for (const auto& s : f.optim_states) r.read(k, "optim/" + s, 0, n, buf.data());
    }
  });
  fuzz::expect_error_or_success([&] { (void)fsdp::ckpt::inspect(dir, /*verify=*/true); });
  return 0;
}
