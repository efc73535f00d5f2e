// The reshard planner (checkpoint/format/reshard_plan.h) on its own: no files, no LibTorch.
#include "../checkpoint/format/reshard_plan.h"

#include <gtest/gtest.h>

#include <map>
#include <ostream>

namespace fsdp::ckpt {

// Found by argument-dependent lookup (so not in the anonymous namespace below).
bool operator==(const Piece& a, const Piece& b) {
  return a.dst == b.dst && a.src_flat == b.src_flat && a.src == b.src && a.n == b.n;
}

std::ostream& operator<<(std::ostream& os, const Piece& p) {
  return os << "{dst " << p.dst << ", flat " << p.src_flat << ", src " << p.src << ", n " << p.n
            << "}";
}

namespace {

using Source = std::map<std::string, SourceParam>;

std::function<std::optional<SourceParam>(const std::string&)> in(const Source& s) {
  return [&s](const std::string& fqn) -> std::optional<SourceParam> {
    auto it = s.find(fqn);
    if (it == s.end()) return std::nullopt;
    return it->second;
  };
}

// Three parameters of 10, 6 and 4 elements (20 in all), as one flat parameter.
const std::vector<TargetParam> kParams = {{"a", 0, 10}, {"b", 10, 6}, {"c", 16, 4}};

TEST(ReshardPlan, AnUnchangedLayoutIsOneReadPerShard) {
  const Source same = {{"a", {0, 0}}, {"b", {0, 10}}, {"c", {0, 16}}};
  // World 2 both sides: shards of 10.
  EXPECT_EQ(plan_shard_read(0, 10, kParams, in(same)), (std::vector<Piece>{{0, 0, 0, 10}}));
  EXPECT_EQ(plan_shard_read(10, 10, kParams, in(same)), (std::vector<Piece>{{0, 0, 10, 10}}));
}

TEST(ReshardPlan, ShardBoundariesCutThroughParametersAtAnotherWorldSize) {
  const Source same = {{"a", {0, 0}}, {"b", {0, 10}}, {"c", {0, 16}}};
  // World 3: 20 elements padded to 21, shards of 7.
  EXPECT_EQ(plan_shard_read(0, 7, kParams, in(same)), (std::vector<Piece>{{0, 0, 0, 7}}));
  EXPECT_EQ(plan_shard_read(7, 7, kParams, in(same)), (std::vector<Piece>{{0, 0, 7, 7}}));
  // The last shard holds 6 elements and one of padding, which no piece covers.
  const auto last = plan_shard_read(14, 7, kParams, in(same));
  EXPECT_EQ(last, (std::vector<Piece>{{0, 0, 14, 6}}));
  EXPECT_EQ(covered(last), 6);
}

TEST(ReshardPlan, ParametersFromDifferentSourceFlatsAreSeparatePieces) {
  // Saved under another wrap policy: b in its own unit, c before a in another.
  const Source other = {{"a", {1, 4}}, {"b", {2, 0}}, {"c", {1, 0}}};
  EXPECT_EQ(plan_shard_read(0, 20, kParams, in(other)),
            (std::vector<Piece>{{0, 1, 4, 10}, {10, 2, 0, 6}, {16, 1, 0, 4}}));
  // Contiguous on both sides across a parameter boundary: merged.
  const Source packed = {{"a", {3, 0}}, {"b", {3, 10}}, {"c", {4, 0}}};
  EXPECT_EQ(plan_shard_read(5, 15, kParams, in(packed)),
            (std::vector<Piece>{{0, 3, 5, 11}, {11, 4, 0, 4}}));
}

TEST(ReshardPlan, AMissingParameterLeavesAGapAndATiedAliasIsReadOnce) {
  const Source no_b = {{"a", {0, 0}}, {"c", {0, 16}}};
  const auto p = plan_shard_read(0, 20, kParams, in(no_b));
  EXPECT_EQ(p, (std::vector<Piece>{{0, 0, 0, 10}, {16, 0, 16, 4}}));
  EXPECT_EQ(covered(p), 14);
  // "a2" is a second name of the tensor at offset 0 (tied): not planned twice.
  std::vector<TargetParam> tied = kParams;
  tied.push_back({"a2", 0, 10});
  const Source with_alias = {{"a", {0, 0}}, {"a2", {5, 0}}, {"b", {0, 10}}, {"c", {0, 16}}};
  EXPECT_EQ(plan_shard_read(0, 20, tied, in(with_alias)), (std::vector<Piece>{{0, 0, 0, 20}}));
}

TEST(ReshardPlan, AShardPastEveryParameterIsAllPadding) {
  const Source same = {{"a", {0, 0}}, {"b", {0, 10}}, {"c", {0, 16}}};
  EXPECT_TRUE(plan_shard_read(20, 4, kParams, in(same)).empty());
  EXPECT_TRUE(plan_shard_read(0, 0, kParams, in(same)).empty());
}

}  // namespace
}  // namespace fsdp::ckpt
