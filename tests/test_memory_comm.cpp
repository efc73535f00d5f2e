// Accounting: the engine's byte counters against docs/design.md, "Memory model", and communication
// bytes per step against the theory for FULL_SHARD.
#include "support/counting_allocator.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_memory_comm_cases {

namespace {

struct Sizes {
  int64_t root = 0;    ///< root unit's padded numel
  int64_t block = 0;   ///< one block unit's padded numel (all blocks are equal)
  int64_t blocks = 0;  ///< number of block units
  int64_t shards = 0;  ///< sum of shard numels
  int64_t numel = 0;   ///< sum of unpadded numels
  int64_t padded = 0;  ///< sum of padded numels
};

Sizes sizes_of(const ShardedModel& root) {
  Sizes s;
  for (const auto& f : fsdp::detail::flat_params(root)) {
    if (f.unit_fqn.empty()) {
      s.root = f.padded_numel;
    } else {
      s.block = f.padded_numel;
      ++s.blocks;
    }
    s.shards += f.shard_numel;
    s.numel += f.numel;
    s.padded += f.padded_numel;
  }
  return s;
}

void train_steps(gpt::GPT& reference_cfg_holder, Sharded<gpt::GPT>& model, const ProcessGroup& pg,
                 int steps) {
  auto cfg = reference_cfg_holder->config;
  torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < steps; ++step) {
    gpt::loss_on(model, my_rows(gpt_batch(step, 4 * pg.size(), cfg.block_size), pg)).backward();
    opt.step();
    opt.zero_grad();
  }
}

class AccountingAtWorld : public ::testing::TestWithParam<int> {};

TEST_P(AccountingAtWorld, ShardedStateIsOneNthOfTheModelPlusPaddingExactly) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    gpt::GPT plain(cfg);
    int64_t model_numel = 0;
    for (const auto& p : plain->parameters()) model_numel += p.numel();
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    Sizes s = sizes_of(model);
    const int64_t n = pg.size();
    EXPECT_EQ(s.numel, model_numel);
    for (const auto& f : fsdp::detail::flat_params(model)) {
      EXPECT_EQ(f.padded_numel % n, 0) << f.unit_fqn;
      EXPECT_LT(f.padded_numel - f.numel, n)
          << f.unit_fqn;  // padding is under one element per rank
      EXPECT_EQ(f.shard_numel * n, f.padded_numel) << f.unit_fqn;
    }
    auto mem = model.memory_stats();
    // fp32 shards: exactly (model + padding) / N elements of 4 bytes.
    EXPECT_EQ(mem.sharded_params.current, 4 * s.padded / n);
    EXPECT_EQ(mem.gathered_params.current, 0);
    EXPECT_EQ(mem.grad_shards.current, 0);
    gpt::loss_on(model, gpt_batch(0, 2, cfg.block_size)).backward();
    mem = model.memory_stats();
    // fp32 gradient shards: the same size as the parameter shards (all trainable).
    EXPECT_EQ(mem.grad_shards.current, 4 * s.padded / n);
    EXPECT_EQ(mem.gathered_params.current, 0);  // nothing left gathered after backward
    EXPECT_EQ(mem.comm_buffers.current, 0);     // flat gradient buffers freed
  });
}

// A unit's reduce-scatter runs while backward computes the next unit (Note [Overlapped
// reduction]): at the peak, the root's flat gradient (held all backward), the computing
// unit's and the one whose reduction is in flight are alive; none after backward.
TEST(OverlappedReduction, OneReductionInFlightWhileTheNextUnitComputes) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    cfg.n_layer = 4;
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    Sizes s = sizes_of(model);
    gpt::loss_on(model, my_rows(gpt_batch(0, 4, cfg.block_size), pg)).backward();
    const auto mem = model.memory_stats();
    EXPECT_EQ(mem.comm_buffers.peak, 4 * (s.root + 2 * s.block));
    EXPECT_EQ(mem.comm_buffers.current, 0);
    EXPECT_EQ(model.comm_stats().step.reduce_scatter_calls, 1 + s.blocks);
  });
}

TEST_P(AccountingAtWorld, FullShardStepMovesTheTheoreticalBytes) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    gpt::GPT holder(cfg);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    train_steps(holder, model, pg, 3);
    Sizes s = sizes_of(model);
    const auto& step = model.comm_stats().step;
    if (pg.size() == 1) {
      // A group of one moves nothing: gathers and reductions are local copies.
      EXPECT_EQ(step.total_bytes(), 0);
      return;
    }
    // Forward: every unit gathered once. Backward: every non-root unit gathered again
    // (the root stays gathered). Reduce-scatter: every unit's flat gradient. fp32 = 4 bytes.
    EXPECT_EQ(step.all_gather_bytes, 4 * (s.padded + s.blocks * s.block));
    EXPECT_EQ(step.all_gather_calls, 1 + 2 * s.blocks);
    EXPECT_EQ(step.reduce_scatter_bytes, 4 * s.padded);
    EXPECT_EQ(step.reduce_scatter_calls, 1 + s.blocks);
    EXPECT_EQ(step.all_reduce_bytes, 0);
    EXPECT_EQ(model.comm_stats().total.all_gather_bytes, 3 * step.all_gather_bytes);
  });
}

// The counters against the real allocator: the bytes LibTorch's CPU allocator holds
// beyond the sharded state move by exactly what the counters say, for the full
// parameters (fp32 aliased, bf16 with a staged cast, fp32 offloaded with a staged copy)
// and the gradient shards, and go back to nothing. In one process: with c10d's Gloo the
// worker thread that ran a collective lets go of its tensors a moment after wait()
// returns (measured: a bf16 staging buffer of 12704 bytes still held after unshard()
// at world 2, now and then), so the allocator cannot be read exactly there.
TEST(Accounting, CountersAgreeWithTheBytesTheAllocatorHolds) {
  auto& counter = CountingCpuAllocator::install();
  struct Case {
    torch::ScalarType dtype;
    bool offload;
    int64_t gathered_per_element;  ///< bytes the gathered parameters take per padded element
  };
  for (const Case c : {Case{torch::kFloat, false, 0}, Case{torch::kBFloat16, false, 2},
                       Case{torch::kFloat, true, 4}}) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + (c.offload ? " offload" : ""));
    auto cfg = small_gpt_config();
    ShardingOptions o;
    o.mixed_precision.param_dtype = c.dtype;
    o.offload_optimizer.device = o.offload_param.device =
        c.offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
    auto model = fully_shard(gpt::GPT(cfg), o);
    const Sizes s = sizes_of(model);
    const int64_t base = counter.live();
    counter.reset_peak();
    model.unshard();
    EXPECT_EQ(counter.live() - base, c.gathered_per_element * s.padded);
    // Without offload nothing else was allocated on the way, not even for a moment: the
    // bf16 cast writes the gathered buffer itself (Note [Gather in place]).
    if (!c.offload) EXPECT_EQ(counter.peak() - base, c.gathered_per_element * s.padded);
    EXPECT_EQ(model.memory_stats().gathered_params.current, counter.live() - base);
    EXPECT_EQ(model.memory_stats().comm_buffers.current, 0);
    EXPECT_EQ(model.memory_stats().offload_buffers.current, 0);
    model.reshard();
    EXPECT_EQ(counter.live(), base);
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);

    gpt::loss_on(model, gpt_batch(0, 2, cfg.block_size)).backward();
    EXPECT_EQ(counter.live() - base, 4 * s.shards);  // fp32 gradient shards, nothing else
    EXPECT_EQ(model.memory_stats().grad_shards.current, counter.live() - base);
    EXPECT_EQ(model.memory_stats().comm_buffers.current, 0);
    EXPECT_EQ(model.memory_stats().offload_buffers.current, 0);
    for (auto& p : model.sharded_parameters())
      p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none)
    EXPECT_EQ(counter.live(), base) << "gradient bytes outlived the gradient shards";
    EXPECT_EQ(model.memory_stats().grad_shards.current, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(World, AccountingAtWorld, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

class PrefetchBound : public ::testing::TestWithParam<int> {};

gpt::Config four_block_config() {
  auto cfg = small_gpt_config();
  cfg.n_layer = 4;
  return cfg;
}

// A four-block GPT sharded over `pg` with prefetch bound `bound`, after one training
// step (the first step records the forward order).
Sharded<gpt::GPT> trained_once(const ProcessGroup& pg, int bound) {
  auto cfg = four_block_config();
  gpt::GPT holder(cfg);
  ShardingOptions o;
  o.process_group = pg;
  o.max_gathered_units = bound;
  auto model = fully_shard(gpt::GPT(cfg), o);
  train_steps(holder, model, pg, 1);
  return model;
}

TEST_P(PrefetchBound, GatheredPeakIsRootPlusBoundTimesLargestUnit) {
  const int bound = GetParam();
  run_ranks(2, [bound](const ProcessGroup& pg) {
    auto cfg = four_block_config();
    auto model = trained_once(pg, bound);
    model.reset_peak_memory();
    gpt::GPT holder(cfg);
    train_steps(holder, model, pg, 2);
    Sizes s = sizes_of(model);
    // The root stays gathered through forward and backward (Note [Prefetch bound]);
    // prefetching adds blocks up to the bound, and all blocks are the same size, so the
    // peak is reached exactly.
    EXPECT_EQ(model.memory_stats().gathered_params.peak, 4 * (s.root + bound * s.block));
  });
}

// Backward starts in the root (the output layers), which comes first in forward order:
// its pre-backward prefetches the last units in forward order, up to the bound, so that
// their gathers overlap with the root's backward.
TEST_P(PrefetchBound, RootBackwardPrefetchesTheLastUnits) {
  const int bound = GetParam();
  run_ranks(2, [bound](const ProcessGroup& pg) {
    auto cfg = four_block_config();
    auto model = trained_once(pg, bound);
    Sizes s = sizes_of(model);
    auto rows = my_rows(gpt_batch(7, 4 * pg.size(), cfg.block_size), pg);
    auto logits = model->forward(rows.narrow(1, 0, rows.size(1) - 1));
    EXPECT_EQ(model.memory_stats().gathered_params.current, 4 * s.root)
        << "after forward: the root only";
    int64_t at_root_backward = -1;
    // Runs after the engine's own pre-backward hook on the same output (registered first).
    logits.register_hook([&](const torch::Tensor&) {
      at_root_backward = model.memory_stats().gathered_params.current;
    });
    auto y = rows.narrow(1, 1, rows.size(1) - 1);
    torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}))
        .backward();
    EXPECT_EQ(at_root_backward, 4 * (s.root + bound * s.block));
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
  });
}

// Hands out every CPU allocation full of 0xFF bytes (NaN as floats) while it lives, so
// that memory a test reads before anything wrote it cannot pass as zeros.
class JunkFillingCpuAllocator : public at::Allocator {
 public:
  JunkFillingCpuAllocator() : base_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(this, /*priority=*/200);
  }
  ~JunkFillingCpuAllocator() override { c10::SetCPUAllocator(base_, /*priority=*/201); }
  at::DataPtr allocate(size_t n) override {
    at::DataPtr p = base_->allocate(n);
    if (n > 0) std::memset(p.get(), 0xFF, n);
    return p;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  at::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }

 private:
  at::Allocator* base_;
};

/// A root unit with a layer its forward never calls: its slot gets no gradient.
class PartlyUsedImpl : public torch::nn::Module {
 public:
  PartlyUsedImpl()
      : used(register_module("used", torch::nn::Linear(16, 24))),
        spare(register_module("spare", torch::nn::Linear(24, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(used(x)); }
  torch::nn::Linear used, spare;
};
TORCH_MODULE(PartlyUsed);

// Note [Gradients in the shard]: at world size 1 with bf16 compute each parameter's
// gradient is cast into the fp32 gradient shard as it arrives. Against the flat path
// (offload takes it: a bf16 flat gradient, cast into the shard afterwards), bit for bit,
// over two backwards that accumulate, with a parameter that gets no gradient and every
// allocation handed out as NaN bytes; and no flat gradient is ever allocated.
TEST(GradientsInTheShard, EqualTheFlatPathBitForBitAndHoldNoFlatGradient) {
  JunkFillingCpuAllocator junk;
  struct Run {
    std::vector<torch::Tensor> grads;
    int64_t comm_peak = 0;
  };
  auto run = [](bool offload) {
    torch::manual_seed(0);
    ShardingOptions o;
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
    o.offload_optimizer.device = o.offload_param.device =
        offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
    auto model = fully_shard(PartlyUsed(), o);
    for (int64_t step = 0; step < 2; ++step) {
      auto gen = at::detail::createCPUGenerator(77 + step);
      model->forward(torch::randn({4, 16}, gen)).square().sum().backward();
    }
    Run r;
    for (const auto& p : model.sharded_parameters()) r.grads.push_back(p.grad().clone());
    r.comm_peak = model.memory_stats().comm_buffers.peak;
    return r;
  };
  const Run in_shard = run(false), flat = run(true);
  ASSERT_EQ(in_shard.grads.size(), flat.grads.size());
  for (size_t i = 0; i < flat.grads.size(); ++i) {
    EXPECT_FALSE(in_shard.grads[i].isnan().any().item<bool>()) << "unwritten bytes left";
    EXPECT_TRUE(torch::equal(in_shard.grads[i], flat.grads[i])) << "gradient shard " << i;
  }
  EXPECT_EQ(in_shard.comm_peak, 0) << "a flat gradient was allocated";
  EXPECT_GT(flat.comm_peak, 0) << "the reference no longer takes the flat path";
}

INSTANTIATE_TEST_SUITE_P(Units, PrefetchBound, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "max" + std::to_string(info.param); });

}  // namespace

}  // namespace test_memory_comm_cases
