#pragma once
// Resharding, as a plan (docs/design.md, "Checkpoints"): which ranges of a checkpoint's
// flat parameters fill this rank's shard of a flat parameter of the model being loaded,
// whatever the world size, wrap policy or strategy either side had. Pure: no HDF5, no
// LibTorch; tests/test_reshard_plan.cpp checks it on its own.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::ckpt {

/// `n` elements that go to position `dst` of the shard, from position `src` of the
/// checkpoint's flat parameter `src_flat`.
struct Piece {
  int64_t dst = 0;
  size_t src_flat = 0;
  int64_t src = 0;
  int64_t n = 0;
};

/// One original parameter of the flat parameter being filled, where it sits in it.
struct TargetParam {
  std::string fqn;
  int64_t offset = 0;  ///< elements from the start of the (unpadded) flat parameter
  int64_t numel = 0;
};

/// Where the checkpoint holds a parameter: its flat parameter and offset there.
struct SourceParam {
  size_t flat = 0;
  int64_t offset = 0;
};

/// The pieces of elements [begin, begin + length) of a flat parameter laid out as
/// `params`, in shard order, merged where both sides are contiguous (an unchanged layout
/// becomes one piece per source flat). `find` gives where the checkpoint holds a
/// parameter, or nothing: its range is left out of the plan (the caller zero-fills or
/// reports it). A second parameter at an offset already planned (an alias of a tied
/// tensor) is skipped. Elements past the last parameter (padding) are in no piece.
std::vector<Piece> plan_shard_read(
    int64_t begin, int64_t length, const std::vector<TargetParam>& params,
    const std::function<std::optional<SourceParam>(const std::string&)>& find);

/// Elements the pieces cover.
int64_t covered(const std::vector<Piece>& pieces);

}  // namespace fsdp::ckpt
