#include "reshard_plan.h"

#include <algorithm>
#include <set>

namespace fsdp::ckpt {

std::vector<Piece> plan_shard_read(
    int64_t begin, int64_t length, const std::vector<TargetParam>& params,
    const std::function<std::optional<SourceParam>(const std::string&)>& find) {
  std::vector<Piece> pieces;
  std::set<int64_t> seen_offsets;
  for (const auto& p : params) {
    const std::optional<SourceParam> s = find(p.fqn);
    if (!s || !seen_offsets.insert(p.offset).second) continue;
    const int64_t lo = std::max(begin, p.offset), hi = std::min(begin + length, p.offset + p.numel);
    if (lo >= hi) continue;
    pieces.push_back(Piece{lo - begin, s->flat, s->offset + (lo - p.offset), hi - lo});
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.dst < b.dst; });
  std::vector<Piece> merged;
  for (const auto& p : pieces) {
    if (!merged.empty() && merged.back().src_flat == p.src_flat &&
        merged.back().dst + merged.back().n == p.dst &&
        merged.back().src + merged.back().n == p.src) {
      merged.back().n += p.n;
    } else {
      merged.push_back(p);
    }
  }
  return merged;
}

int64_t covered(const std::vector<Piece>& pieces) {
  int64_t n = 0;
  for (const auto& p : pieces) n += p.n;
  return n;
}

}  // namespace fsdp::ckpt
