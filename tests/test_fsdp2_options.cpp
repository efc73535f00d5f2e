// FSDP2's knobs, each against FULL_SHARD's results and the bytes it saves:
// reshard_after_forward as a group size (ShardingOptions::reshard_after_forward_group_size,
// ZeRO++ hpZ), explicit prefetch lists (ShardedModel::set_forward_prefetch and
// set_backward_prefetch) and ShardedModel::set_reshard_after_backward.
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>
#include "../src/comm/collective_ring.h"    // the order gathers were issued in
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_fsdp2_options_cases {

namespace {

constexpr int64_t kRows = 8;

/// Padded numels of the root's and of the other units' flat parameters.
struct Padded {
  int64_t all = 0;
  int64_t non_root = 0;
};

Padded padded_of(const ShardedModel& m) {
  Padded p;
  for (const auto& f : fsdp::detail::flat_params(m)) {
    p.all += f.padded_numel;
    if (!f.unit_fqn.empty()) p.non_root += f.padded_numel;
  }
  return p;
}

/// The gradient shards, cloned.
std::vector<torch::Tensor> grads_of(const ShardedModel& m) {
  std::vector<torch::Tensor> g;
  for (const auto& s : m.sharded_parameters()) g.push_back(s.grad().clone());
  return g;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " " << i;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

// --- reshard_after_forward as a group size (hpZ) ---------------------------------------

struct HpzCase {
  torch::Dtype param_dtype;
  const char* name;
};
void PrintTo(const HpzCase& c, std::ostream* os) { *os << c.name; }

class ReshardAfterForwardGroupAtWorld4 : public ::testing::TestWithParam<HpzCase> {};

// Five SGD steps with k = 2 and with plain FULL_SHARD: losses, gradient shards and
// parameters equal bit for bit (backward gathers the bits forward computed with); each
// step's gathers move the same bytes, of which the backward ones, 1/k of the shard group
// in memory between forward and backward, cross only the 2-rank group.
TEST_P(ReshardAfterForwardGroupAtWorld4, EqualsFullShardAndGathersBackwardWithinTheGroup) {
  const HpzCase c = GetParam();
  run_ranks(4, [c](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.mixed_precision.param_dtype = c.param_dtype;
    torch::manual_seed(5);
    auto full = fully_shard(MlpNet(), o);
    o.reshard_after_forward_group_size = 2;
    torch::manual_seed(5);
    auto hpz = fully_shard(MlpNet(), o);
    torch::optim::SGD opt_full(full.sharded_parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_hpz(hpz.sharded_parameters(), torch::optim::SGDOptions(0.1));
    const Padded p = padded_of(hpz);
    const int64_t es = c10::elementSize(c.param_dtype);
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = mlp_batch(step, kRows);
      x = my_rows(x, pg);
      y = my_rows(y, pg);
      auto loss_full = torch::mse_loss(full(x).to(torch::kFloat), y);
      auto loss_hpz = torch::mse_loss(hpz(x).to(torch::kFloat), y);
      EXPECT_EQ(loss_full.item<float>(), loss_hpz.item<float>()) << "step " << step;

      // Between forward and backward: the root gathered, every other unit a 1/2 slice.
      const stats::MemoryStats m = hpz.memory_stats();
      int64_t root_padded = p.all - p.non_root;
      EXPECT_EQ(m.gathered_params.current, es * root_padded);
      EXPECT_EQ(m.post_forward_params.current, es * p.non_root / 2);
      EXPECT_EQ(full.memory_stats().post_forward_params.current, 0);
      EXPECT_EQ(full.memory_stats().gathered_params.current, es * root_padded);

      loss_full.backward();
      loss_hpz.backward();
      EXPECT_EQ(hpz.memory_stats().post_forward_params.current, 0);
      EXPECT_EQ(hpz.memory_stats().gathered_params.current, 0);
      expect_equal(grads_of(full), grads_of(hpz), "gradient shard, step " + std::to_string(step));

      const stats::CommStats& cf = full.comm_stats().step;
      const stats::CommStats& ch = hpz.comm_stats().step;
      // Forward gathers every unit over the world; backward gathers the non-root units,
      // over the world under FULL_SHARD, over the 2-rank group with k = 2.
      EXPECT_EQ(cf.all_gather_bytes, es * (p.all + p.non_root));
      EXPECT_EQ(cf.reshard_group_all_gather_bytes, 0);
      EXPECT_EQ(ch.all_gather_bytes, es * (p.all + p.non_root));
      EXPECT_EQ(ch.reshard_group_all_gather_bytes, es * p.non_root);
      EXPECT_EQ(ch.all_gather_calls, cf.all_gather_calls);
      EXPECT_EQ(ch.reduce_scatter_bytes, cf.reduce_scatter_bytes);
      if (pg.rank() == 0 && step == 0) {
        std::cout << "[hpZ " << c.name << "] per step: all-gather bytes over the world "
                  << cf.all_gather_bytes << " (FULL_SHARD) vs "
                  << ch.all_gather_bytes - ch.reshard_group_all_gather_bytes << " (k=2), "
                  << ch.reshard_group_all_gather_bytes
                  << " within the 2-rank group; between forward and backward "
                  << m.post_forward_params.current << " bytes of slices" << std::endl;
      }
      opt_full.step();
      opt_hpz.step();
      opt_full.zero_grad();
      opt_hpz.zero_grad();
    }
    // The backward gathers ran on this rank's 2-rank group.
    const std::string group = pg.rank() < 2 ? "on ranks [0, 1]" : "on ranks [2, 3]";
    bool seen = false;
    for (const auto& line : fsdp::detail::recent_collectives()) {
      if (line.find(group) != std::string::npos && line.find("all_gather") != std::string::npos)
        seen = true;
    }
    EXPECT_TRUE(seen) << "no all_gather on the 2-rank group in the trace";
    expect_equal(full.sharded_parameters(), hpz.sharded_parameters(), "parameters");
  });
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReshardAfterForwardGroupAtWorld4,
                         ::testing::Values(HpzCase{torch::kFloat32, "fp32"},
                                           HpzCase{torch::kBFloat16, "bf16"}),
                         [](const auto& info) { return std::string(info.param.name); });

// A forward whose backward never comes leaves slices; the next forward drops them (an
// optimizer step may have come between) and gathers over the world again.
TEST(ReshardAfterForwardGroup, AForwardWithoutBackwardLeavesNoSliceForTheNext) {
  run_ranks(4, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.reshard_after_forward_group_size = 2;
    auto model = fully_shard(MlpNet(), o);
    const Padded p = padded_of(model);
    auto [x, y] = mlp_batch(0, kRows);
    model(my_rows(x, pg));
    EXPECT_EQ(model.memory_stats().post_forward_params.current, 4 * p.non_root / 2);
    auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
    EXPECT_EQ(model.memory_stats().post_forward_params.current, 4 * p.non_root / 2);
    EXPECT_EQ(model.memory_stats().post_forward_params.peak, 4 * p.non_root / 2);
    loss.backward();
    EXPECT_EQ(model.memory_stats().post_forward_params.current, 0);
    model(my_rows(x, pg));
    model.reshard();
    EXPECT_EQ(model.memory_stats().post_forward_params.current, 0);
  });
}

// Under HYBRID_SHARD (2 groups of 4 at world 8) the 2-rank groups lie inside each shard
// group: results equal plain HYBRID_SHARD's, and so do the replicas' all-reduces.
TEST(ReshardAfterForwardGroup, InsideHybridShardGroupsAtWorld8EqualsHybridShard) {
  run_ranks(8, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_group_size = 4;
    torch::manual_seed(7);
    auto hybrid = fully_shard(MlpNet(), o);
    o.reshard_after_forward_group_size = 2;
    torch::manual_seed(7);
    auto hpz = fully_shard(MlpNet(), o);
    torch::optim::SGD opt_hybrid(hybrid.sharded_parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_hpz(hpz.sharded_parameters(), torch::optim::SGDOptions(0.1));
    const Padded p = padded_of(hpz);
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = mlp_batch(step, 16);
      x = my_rows(x, pg);
      y = my_rows(y, pg);
      auto loss_hybrid = torch::mse_loss(hybrid(x), y);
      auto loss_hpz = torch::mse_loss(hpz(x), y);
      EXPECT_EQ(hpz.memory_stats().post_forward_params.current, 4 * p.non_root / 2);
      EXPECT_EQ(loss_hybrid.item<float>(), loss_hpz.item<float>());
      loss_hybrid.backward();
      loss_hpz.backward();
      expect_equal(grads_of(hybrid), grads_of(hpz), "gradient shard");
      const stats::CommStats& cf = hybrid.comm_stats().step;
      const stats::CommStats& ch = hpz.comm_stats().step;
      EXPECT_EQ(ch.all_gather_bytes, 4 * (p.all + p.non_root));
      EXPECT_EQ(ch.reshard_group_all_gather_bytes, 4 * p.non_root);
      EXPECT_EQ(cf.reshard_group_all_gather_bytes, 0);
      EXPECT_EQ(ch.all_gather_bytes, cf.all_gather_bytes);
      EXPECT_EQ(ch.all_reduce_bytes, cf.all_reduce_bytes);
      EXPECT_GT(ch.all_reduce_bytes, 0);
      opt_hybrid.step();
      opt_hpz.step();
      opt_hybrid.zero_grad();
      opt_hpz.zero_grad();
    }
    expect_equal(hybrid.sharded_parameters(), hpz.sharded_parameters(), "parameters");
  });
}

TEST(ReshardAfterForwardGroup, ABadGroupSizeIsNamedWithTheFix) {
  run_ranks(4, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    for (int k : {3, 4, 1, -2}) {
      o.reshard_after_forward_group_size = k;
      EXPECT_EQ(error_of([&] { fully_shard(MlpNet(), o); }),
                "ShardingOptions::reshard_after_forward_group_size=" + std::to_string(k) +
                    " must divide the shard group size 4 and lie strictly between 1 and 4 (e.g. "
                    "the number of ranks per node); 0 reshards to the whole shard group");
    }
    o.reshard_after_forward_group_size = 2;
    o.strategy = ShardingStrategy::kShardGradOp;
    EXPECT_EQ(error_of([&] { fully_shard(MlpNet(), o); }),
              "ShardingOptions::reshard_after_forward_group_size=2 needs a strategy that frees "
              "parameters after forward (ShardingOptions::strategy=kFullShard or kHybridShard); "
              "kShardGradOp keeps full parameters into backward. Set it to 0, or use kFullShard");
    // Within HYBRID_SHARD's groups of 2 there is no smaller group to reshard to.
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_group_size = 2;
    EXPECT_EQ(error_of([&] { fully_shard(MlpNet(), o); }),
              "ShardingOptions::reshard_after_forward_group_size=2 must divide the shard group "
              "size 2 and lie strictly between 1 and 2 (e.g. the number of ranks per node); 0 "
              "reshards to the whole shard group");
  });
}

// --- explicit prefetch ---------------------------------------------------------------

/// The units the last `n` all-gathers of this rank were for, oldest first.
std::vector<std::string> last_gathers(size_t n) {
  std::vector<std::string> units;
  for (const auto& line : fsdp::detail::recent_collectives()) {
    if (line.find(": all_gather for ") == std::string::npos) continue;
    const auto from = line.find(" for ") + 5;
    units.push_back(line.substr(from, line.find(", ", from) - from));
  }
  if (units.size() > n) units.erase(units.begin(), units.end() - static_cast<long>(n));
  return units;
}

// With recorded-order prefetch off, "hidden.0" names "hidden.2" for forward and
// "hidden.2" names "hidden.0" for backward: the gathers come in that order, and the
// losses and gradients equal those of the same model without the lists.
TEST(ExplicitPrefetch, ListedUnitsAreGatheredWhenTheUnitStartsAndResultsAreUnchanged) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.prefetch = false;
    torch::manual_seed(3);
    auto plain = fully_shard(MlpNet(), o);
    torch::manual_seed(3);
    auto listed = fully_shard(MlpNet(), o);
    listed.set_forward_prefetch("hidden.0", {"hidden.2"});
    listed.set_backward_prefetch("hidden.2", {"hidden.0"});
    const std::vector<std::string> forward_plain = {"the root unit", "unit 'hidden.0'",
                                                    "unit 'hidden.1'", "unit 'hidden.2'"};
    const std::vector<std::string> forward_listed = {"the root unit", "unit 'hidden.0'",
                                                     "unit 'hidden.2'", "unit 'hidden.1'"};
    const std::vector<std::string> backward_plain = {"unit 'hidden.2'", "unit 'hidden.1'",
                                                     "unit 'hidden.0'"};
    const std::vector<std::string> backward_listed = {"unit 'hidden.2'", "unit 'hidden.0'",
                                                      "unit 'hidden.1'"};
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = mlp_batch(step, kRows);
      auto loss_plain = torch::mse_loss(plain(my_rows(x, pg)), my_rows(y, pg));
      EXPECT_EQ(last_gathers(4), forward_plain);
      loss_plain.backward();
      EXPECT_EQ(last_gathers(3), backward_plain);
      auto loss_listed = torch::mse_loss(listed(my_rows(x, pg)), my_rows(y, pg));
      EXPECT_EQ(last_gathers(4), forward_listed) << "step " << step;
      loss_listed.backward();
      EXPECT_EQ(last_gathers(3), backward_listed) << "step " << step;
      EXPECT_EQ(loss_plain.item<float>(), loss_listed.item<float>());
      expect_equal(grads_of(plain), grads_of(listed), "gradient shard");
      EXPECT_EQ(plain.comm_stats().step.all_gather_bytes,
                listed.comm_stats().step.all_gather_bytes);
      for (auto* m : {&plain, &listed}) {
        for (auto& s : m->sharded_parameters()) s.mutable_grad() = torch::Tensor();
      }
    }
  });
}

// A list replaces the recorded order for its unit only: with prefetch on (bound 2), the
// root's list {"hidden.2"} gathers "hidden.2" first, and "hidden.0" and "hidden.1" then
// prefetch by the recorded order within the bound (without the list: 0, 1, 2).
TEST(ExplicitPrefetch, AListReplacesTheRecordedOrderForItsUnitOnly) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(MlpNet(), o);
    auto [x, y] = mlp_batch(0, kRows);
    torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg)).backward();  // records the order
    auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
    EXPECT_EQ(last_gathers(4), (std::vector<std::string>{"the root unit", "unit 'hidden.0'",
                                                         "unit 'hidden.1'", "unit 'hidden.2'"}));
    loss.backward();
    model.set_forward_prefetch("", {"hidden.2"});
    loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
    EXPECT_EQ(last_gathers(4), (std::vector<std::string>{"the root unit", "unit 'hidden.2'",
                                                         "unit 'hidden.0'", "unit 'hidden.1'"}));
    loss.backward();
  });
}

TEST(ExplicitPrefetch, AnUnknownUnitIsNamedWithTheUnitsFqns) {
  auto model = fully_shard(MlpNet());
  const std::string units =
      "; use one of the units' FQNs (clean names, '' for the root): '', "
      "'hidden.0', 'hidden.1', 'hidden.2'";
  EXPECT_EQ(error_of([&] { model.set_forward_prefetch("hidden.3", {"hidden.1"}); }),
            "set_forward_prefetch: no unit is named 'hidden.3'" + units);
  EXPECT_EQ(error_of([&] {
              model.set_backward_prefetch("hidden.1", {"hidden.0", "out"});
            }),
            "set_backward_prefetch: no unit is named 'out'" + units);
  // The module path with the wrap point's "module" segment is not a clean FQN.
  EXPECT_EQ(error_of([&] { model.set_forward_prefetch("hidden.0.module", {}); }),
            "set_forward_prefetch: no unit is named 'hidden.0.module'" + units);
}

// --- set_reshard_after_backward --------------------------------------------------------

// Two micro-batches of gradient accumulation: with reshard_after_backward off for the
// first, every unit stays gathered after its backward and the second forward gathers
// nothing: exactly the padded model (fp32) fewer all-gather bytes. Turned on for the
// second, its backward frees everything. Gradients and the step equal the default's.
TEST(ReshardAfterBackward, OffKeepsUnitsGatheredSoTheNextForwardGathersNothing) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(9);
    auto plain = fully_shard(MlpNet(), o);
    torch::manual_seed(9);
    auto kept = fully_shard(MlpNet(), o);
    const Padded p = padded_of(kept);
    torch::optim::SGD opt_plain(plain.sharded_parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_kept(kept.sharded_parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      int64_t gathered[2] = {0, 0};  // all-gather bytes of the second micro-batch
      for (int micro = 0; micro < 2; ++micro) {
        kept.set_reshard_after_backward(micro == 1);
        auto [x, y] = mlp_batch(10 * step + micro, kRows);
        torch::mse_loss(plain(my_rows(x, pg)), my_rows(y, pg)).backward();
        torch::mse_loss(kept(my_rows(x, pg)), my_rows(y, pg)).backward();
        EXPECT_EQ(plain.memory_stats().gathered_params.current, 0);
        EXPECT_EQ(kept.memory_stats().gathered_params.current, micro == 0 ? 4 * p.all : 0);
        gathered[0] = plain.comm_stats().step.all_gather_bytes;
        gathered[1] = kept.comm_stats().step.all_gather_bytes;
      }
      EXPECT_EQ(gathered[0], 4 * (p.all + p.non_root));
      EXPECT_EQ(gathered[1], 4 * p.non_root);
      if (pg.rank() == 0 && step == 0) {
        std::cout << "[reshard_after_backward] second micro-batch all-gather bytes: " << gathered[0]
                  << " (default) vs " << gathered[1]
                  << " (off for the first): " << gathered[0] - gathered[1] << " saved" << std::endl;
      }
      expect_equal(grads_of(plain), grads_of(kept), "accumulated gradient shard");
      opt_plain.step();
      opt_kept.step();
      opt_plain.zero_grad();
      opt_kept.zero_grad();
    }
    expect_equal(plain.sharded_parameters(), kept.sharded_parameters(), "parameters");
  });
}

// Off, reshard() frees what backward kept.
TEST(ReshardAfterBackward, ReshardFreesWhatBackwardKept) {
  auto model = fully_shard(MlpNet());
  model.set_reshard_after_backward(false);
  auto [x, y] = mlp_batch(0, kRows);
  torch::mse_loss(model(x), y).backward();
  // World size 1 in fp32 aliases the shards (Note [Group of one]): nothing to free.
  EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
  ShardingOptions o;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  auto bf16 = fully_shard(MlpNet(), o);
  bf16.set_reshard_after_backward(false);
  torch::mse_loss(bf16(x).to(torch::kFloat), y).backward();
  const int64_t all = padded_of(bf16).all;
  EXPECT_EQ(bf16.memory_stats().gathered_params.current, 2 * all);
  bf16.reshard();
  EXPECT_EQ(bf16.memory_stats().gathered_params.current, 0);
}

}  // namespace

}  // namespace test_fsdp2_options_cases
