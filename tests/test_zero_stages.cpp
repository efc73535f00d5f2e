// DeepSpeed's ZeRO stages by name (kZero1, kZero2, kFullShard = ZeRO-3): parity with
// unsharded training, what persists between steps (Note [Persistent parameters]), and
// the engine's counters against DeepSpeed's model-state formula, term by term.
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/fused_adamw.h>

#include <gtest/gtest.h>

#include "../src/internal/optim_key.h"
#include "../src/internal/sharded_model.h"  // flat-parameter sizes the assertions need

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_zero_stages_cases {

namespace {

struct Stage {
  ShardingStrategy strategy;
  const char* name;
};
void PrintTo(const Stage& s, std::ostream* os) { *os << s.name; }

// Ψ as the engine pads it: every flat parameter's padded elements, and this rank's share.
struct Sizes {
  int64_t padded = 0;  ///< Σ padded_numel (the full parameters, padded)
  int64_t shard = 0;   ///< Σ shard_numel (this rank's fp32 shards)
  int64_t largest = 0;
};
Sizes sizes_of(const ShardedModel& model) {
  Sizes s;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    s.padded += f.padded_numel;
    s.shard += f.shard_numel;
    s.largest = std::max(s.largest, f.padded_numel);
  }
  return s;
}

ShardingOptions options_for(const ProcessGroup& pg, ShardingStrategy strategy, bool bf16) {
  ShardingOptions o;
  o.process_group = pg;
  o.strategy = strategy;
  if (bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
    o.mixed_precision.output_dtype = torch::kFloat32;
  }
  return o;
}

// The GPT trained 6 AdamW steps sharded with `strategy` and unsharded: the same losses
// and parameters (fp32), at any world size.
void gpt_parity(const ProcessGroup& pg, ShardingStrategy strategy) {
  const auto cfg = small_gpt_config();
  torch::manual_seed(3);
  gpt::GPT reference(cfg);
  torch::manual_seed(3);
  auto model = fully_shard(gpt::GPT(cfg), options_for(pg, strategy, false));
  auto adamw = torch::optim::AdamWOptions(3e-3).eps(1e-6).weight_decay(0.1);
  torch::optim::AdamW opt(model.sharded_parameters(), adamw);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw);
  const int64_t rows = 12;
  for (int64_t step = 0; step < 6; ++step) {
    auto batch = gpt_batch(step, rows, cfg.block_size);
    auto loss = gpt::loss_on(model, my_rows(batch, pg));
    loss.backward();
    const double global = global_mean(loss, pg);
    auto ref = gpt::loss_on(reference, batch);
    ref.backward();
    EXPECT_NEAR(global, ref.item<double>(), 1e-5 * ref.item<double>()) << "step " << step;
    opt.step();
    opt.zero_grad();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  // The reference means the whole batch at once (not share by share, as test_parity's
  // does), so the rounding differs at 2 ranks too, and lr 3e-3 makes Adam's noise larger:
  // measured at 3 ranks 6.87e-5 with the explicit softmax and 1.92e-4 (wte.weight) with
  // the fused attention kernel, the default (Note [Adam and noise] in test_parity.cpp).
  expect_params_match(full_state_dict(model), *reference, 5e-4);
}

class StageAtWorld : public ::testing::TestWithParam<std::tuple<Stage, int>> {};

TEST_P(StageAtWorld, GptTrainsLikeUnshardedTraining) {
  const auto [stage, world] = GetParam();
  run_ranks(world, [stage = stage](const ProcessGroup& pg) { gpt_parity(pg, stage.strategy); });
}

INSTANTIATE_TEST_SUITE_P(
    Stages, StageAtWorld,
    ::testing::Combine(::testing::Values(Stage{ShardingStrategy::kZero1, "zero1"},
                                         Stage{ShardingStrategy::kZero2, "zero2"}),
                       ::testing::Values(1, 2, 3)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) + "_w" +
             std::to_string(std::get<1>(info.param));
    });

// Note [Persistent parameters]: under kZero2 the full parameters are gathered once after
// each optimizer step and then serve every forward and backward (gradient accumulation
// and eval included) until the next step changes the shards.
TEST(ZeroStages, Zero2GathersOncePerOptimizerStepNotPerForward) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    torch::manual_seed(5);
    auto model = fully_shard(gpt::GPT(cfg), options_for(pg, ShardingStrategy::kZero2, true));
    torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
    const Sizes s = sizes_of(model);
    const int64_t full_bf16 = 2 * s.padded;
    auto micro = [&](int64_t i) {
      gpt::loss_on(model, my_rows(gpt_batch(i, 4, cfg.block_size), pg)).backward();
      return model.comm_stats().step;
    };
    // First step: everything gathered once (bf16), gradients reduce-scattered once.
    auto c = micro(0);
    EXPECT_EQ(c.all_gather_bytes, full_bf16);
    EXPECT_EQ(c.reduce_scatter_bytes, full_bf16);
    EXPECT_EQ(model.memory_stats().gathered_params.current, full_bf16);
    // A second micro-batch before the step: nothing gathered again.
    c = micro(1);
    EXPECT_EQ(c.all_gather_bytes, 0);
    EXPECT_EQ(c.reduce_scatter_bytes, full_bf16);
    opt.step();
    opt.zero_grad();
    // The parameters stay in memory across the step...
    EXPECT_EQ(model.memory_stats().gathered_params.current, full_bf16);
    // ...and are gathered again, once, because the step changed every shard.
    c = micro(2);
    EXPECT_EQ(c.all_gather_bytes, full_bf16);
    EXPECT_EQ(c.all_gather_calls, static_cast<int64_t>(fsdp::detail::flat_params(model).size()));
    // An eval forward after the step gathers nothing more either.
    opt.step();
    opt.zero_grad();
    {
      torch::NoGradGuard no_grad;
      const auto before = model.comm_stats().total.all_gather_bytes;
      gpt::loss_on(model, my_rows(gpt_batch(3, 4, cfg.block_size), pg));
      EXPECT_EQ(model.comm_stats().total.all_gather_bytes - before, full_bf16);  // stale: once
      gpt::loss_on(model, my_rows(gpt_batch(4, 4, cfg.block_size), pg));
      EXPECT_EQ(model.comm_stats().total.all_gather_bytes - before, full_bf16);  // then none
    }
    EXPECT_EQ(model.memory_stats().gathered_params.current, full_bf16);
  });
}

// Whatever kernel steps the shards, the step marks them changed, so kZero1 and kZero2
// regather and train exactly like kFullShard with that kernel. at::_fused_adamw_ (the
// kernel of shards on a GPU; here asked for on the CPU) writes without bumping version
// counters: before FusedAdamW bumped them itself, zero1 and zero2 on an H200 trained on the
// first step's parameters for ever (loss 5.82 -> 5.83 in 8 steps, zero3 -> 2.97).
TEST(ZeroStages, EveryOptimizerKernelMarksTheShardsChangedSoPersistentStagesRegather) {
  std::vector<FusedAdamW::Kernel> kernels = {FusedAdamW::Kernel::kAuto};
  if (FusedAdamW::aten_kernel_available(torch::kCPU)) kernels.push_back(FusedAdamW::Kernel::kAten);
  run_ranks(2, [&](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    for (const auto kernel : kernels) {
      std::vector<float> losses[3];
      int i = 0;
      for (const auto strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kZero2, ShardingStrategy::kZero1}) {
        torch::manual_seed(5);
        auto model = fully_shard(gpt::GPT(cfg), options_for(pg, strategy, true));
        FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-2));
        opt.set_kernel(kernel);
        const int64_t full_bf16 = 2 * sizes_of(model).padded;
        for (int64_t step = 0; step < 4; ++step) {
          auto loss = gpt::loss_on(model, my_rows(gpt_batch(step, 4, cfg.block_size), pg));
          loss.backward();
          if (strategy != ShardingStrategy::kFullShard) {
            EXPECT_EQ(model.comm_stats().step.all_gather_bytes, full_bf16)
                << "step " << step << ": every shard changed, so everything is gathered once";
          }
          losses[i].push_back(loss.item<float>());
          opt.step();
          opt.zero_grad();
        }
        ++i;
      }
      EXPECT_EQ(losses[1], losses[0]) << "zero2, kernel " << static_cast<int>(kernel);
      EXPECT_EQ(losses[2], losses[0]) << "zero1, kernel " << static_cast<int>(kernel);
    }
  });
}

// Under kZero1 the gradients of a step are reduced after backward, every unit's at once
// (DeepSpeed's stage 1), so all unsharded gradients are held together: its 2Ψ gradient
// term. kZero2 reduces each unit's during backward. The embedding's gradient is computed
// last (it is used first); a hook on it sees which reductions were issued before.
TEST(ZeroStages, Zero1ReducesAfterBackwardAndHoldsTheFullGradients) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    for (const auto strategy : {ShardingStrategy::kZero1, ShardingStrategy::kZero2}) {
      torch::manual_seed(5);
      auto model = fully_shard(gpt::GPT(cfg), options_for(pg, strategy, true));
      const Sizes s = sizes_of(model);
      int64_t issued_before_last_grad = -1;
      model->module()->wte->weight.register_hook([&](const torch::Tensor&) {
        issued_before_last_grad = model.comm_stats().step.reduce_scatter_calls;
      });
      auto loss = gpt::loss_on(model, my_rows(gpt_batch(0, 4, cfg.block_size), pg));
      model.reset_peak_memory();
      loss.backward();
      const auto m = model.memory_stats();
      const auto flats = static_cast<int64_t>(fsdp::detail::flat_params(model).size());
      if (strategy == ShardingStrategy::kZero1) {
        EXPECT_EQ(issued_before_last_grad, 0) << "nothing reduced while backward runs";
        EXPECT_EQ(m.comm_buffers.peak, 2 * s.padded) << "every unit's bf16 gradient at once";
      } else {
        EXPECT_EQ(issued_before_last_grad, flats - 1) << "each block reduced in backward";
      }
      EXPECT_EQ(model.comm_stats().step.reduce_scatter_calls, flats);
      EXPECT_EQ(m.comm_buffers.current, 0);
    }
  });
}

// DeepSpeed's model-state memory per rank, with K = 12 bytes of fp32 master and Adam
// state per parameter (ZeRO paper, table 1; Ψ parameters, N ranks, 16-bit compute):
//   stage 1: 2Ψ (parameters) + 2Ψ (gradients) + KΨ/N
//   stage 2: 2Ψ + 2Ψ/N + KΨ/N
//   stage 3: 2Ψ/N + 2Ψ/N + KΨ/N
// The engine's counters, term by term, with Ψ as padded to the shard group:
//   16-bit parameters: gathered_params between steps (persistent for stages 1 and 2;
//     under stage 3 nothing is kept: each gather casts the fp32 shard, so the 2Ψ/N
//     16-bit shard copy does not exist here);
//   gradients: the unsharded 16-bit gradients at the end of backward (comm_buffers peak:
//     2Ψ for stage 1) and the gradient shards, which are fp32 here (4Ψ/N: accumulation
//     across micro-batches is fp32, where DeepSpeed's stage 2 and 3 keep 2Ψ/N in fp16);
//   K: the fp32 master shards (sharded_params, 4Ψ/N) and Adam's two moments (8Ψ/N).
class StageCounters : public ::testing::TestWithParam<Stage> {};

TEST_P(StageCounters, EqualDeepSpeedsModelStateFormulaTermByTerm) {
  const Stage stage = GetParam();
  run_ranks(2, [stage](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    torch::manual_seed(5);
    auto model = fully_shard(gpt::GPT(cfg), options_for(pg, stage.strategy, true));
    torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
    const Sizes s = sizes_of(model);
    const int64_t N = pg.size();
    ASSERT_EQ(s.shard * N, s.padded);
    for (int64_t step = 0; step < 2; ++step) {
      model.reset_peak_memory();
      gpt::loss_on(model, my_rows(gpt_batch(step, 4, cfg.block_size), pg)).backward();
      const auto m = model.memory_stats();
      // Gradients.
      EXPECT_EQ(m.grad_shards.current, 4 * s.padded / N) << "fp32 gradient shards";
      // Stage 1's 2Ψ 16-bit gradients: every unit's unsharded gradient held at once.
      // (Stages 2 and 3 hold each until its reduction completes; with Gloo's
      // asynchronous reductions on a model this small that can be all of them too, so
      // their peak is transient, not a term: Zero1ReducesAfterBackward... tells them apart.)
      if (stage.strategy == ShardingStrategy::kZero1) {
        EXPECT_EQ(m.comm_buffers.peak, 2 * s.padded) << "DeepSpeed stage 1: 2Ψ gradients";
      }
      opt.step();
      opt.zero_grad();
      const auto after = model.memory_stats();
      // K: master shards and Adam's moments.
      EXPECT_EQ(after.sharded_params.current, 4 * s.padded / N) << "K: fp32 master, 4Ψ/N";
      int64_t adam = 0;
      for (const auto& p : model.sharded_parameters()) {
        const auto& st = static_cast<const torch::optim::AdamWParamState&>(
            *opt.state().at(fsdp::detail::optim_state_key(opt.state(), p)));
        adam += static_cast<int64_t>(st.exp_avg().nbytes() + st.exp_avg_sq().nbytes());
      }
      EXPECT_EQ(adam, 8 * s.padded / N) << "K: Adam's moments, 8Ψ/N";
      // 16-bit parameters between steps.
      const bool persistent = stage.strategy != ShardingStrategy::kFullShard;
      EXPECT_EQ(after.gathered_params.current, persistent ? 2 * s.padded : 0)
          << "DeepSpeed stages 1 and 2: 2Ψ parameters; stage 3: none kept here";
      EXPECT_EQ(after.grad_shards.current, 0) << "zero_grad(set_to_none) frees them";
      if (pg.rank() == 0 && step == 1) {
        // The terms, as counted and as the formula gives them (bytes, rank 0).
        std::cout << "[report] " << stage.name << " N=" << N << " Psi=" << s.padded << ": "
                  << "16-bit parameters kept " << after.gathered_params.current << " (formula "
                  << (persistent ? 2 * s.padded : 0) << "); 16-bit gradients held at once "
                  << m.comm_buffers.peak << " (stage 1 formula " << 2 * s.padded
                  << "); fp32 gradient shards " << m.grad_shards.current << " (4Psi/N "
                  << 4 * s.padded / N << "); fp32 masters " << after.sharded_params.current
                  << " (4Psi/N " << 4 * s.padded / N << "); Adam moments " << adam << " (8Psi/N "
                  << 8 * s.padded / N << ")" << std::endl;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, StageCounters,
                         ::testing::Values(Stage{ShardingStrategy::kZero1, "zero1"},
                                           Stage{ShardingStrategy::kZero2, "zero2"},
                                           Stage{ShardingStrategy::kFullShard, "zero3"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace

namespace {

// Note [Offload granularity]: offload_optimizer alone keeps each shard's param_dtype copy
// on the device and copies it from the host once per optimizer step; offload_param too
// (cpu_offload) copies before every gather. Both train exactly like no offload.
TEST(OffloadGranularity, OptimizerOnlyKeepsDeviceShardsAndCopiesOncePerStep) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    std::vector<std::vector<double>> losses;
    std::vector<stats::CommStats> comm;
    std::vector<stats::MemoryStats> mem;
    for (int mode = 0; mode < 3; ++mode) {  // none, offload_optimizer, both
      auto o = options_for(pg, ShardingStrategy::kFullShard, true);
      if (mode >= 1) o.offload_optimizer.device = OffloadDevice::kCpu;
      if (mode == 2) o.offload_param.device = OffloadDevice::kCpu;
      torch::manual_seed(9);
      auto model = fully_shard(gpt::GPT(cfg), o);
      FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
      losses.emplace_back();
      for (int64_t step = 0; step < 3; ++step) {
        auto loss = gpt::loss_on(model, my_rows(gpt_batch(step, 4, cfg.block_size), pg));
        loss.backward();
        losses.back().push_back(global_mean(loss, pg));
        opt.step();
        opt.zero_grad();
      }
      comm.push_back(model.comm_stats().step);
      mem.push_back(model.memory_stats());
      if (mode == 0) continue;
      const Sizes s = sizes_of(model);
      int64_t non_root = 0;
      for (const auto& f : fsdp::detail::flat_params(model)) {
        if (!f.unit_fqn.empty()) non_root += f.shard_numel;
      }
      if (mode == 1) {
        // One bf16 copy of every shard in the last step, kept on the device.
        EXPECT_EQ(comm.back().offload_to_device_bytes, 2 * s.shard);
        EXPECT_EQ(mem.back().device_param_shards.current, 2 * s.shard);
      } else {
        // Every gather copies: forward for all units, backward again for the non-root ones.
        EXPECT_EQ(comm.back().offload_to_device_bytes, 2 * (s.shard + non_root));
        EXPECT_EQ(mem.back().device_param_shards.current, 0);
      }
      EXPECT_EQ(comm.back().offload_to_host_bytes, 4 * s.shard) << "fp32 gradient shards back";
    }
    EXPECT_EQ(losses[1], losses[0]) << "offload_optimizer trains exactly like no offload";
    EXPECT_EQ(losses[2], losses[0]) << "offload_optimizer + offload_param likewise";
    EXPECT_EQ(comm[1].all_gather_bytes, comm[0].all_gather_bytes);
  });
}

TEST(OffloadGranularity, OffloadParamAloneOrUnderAPersistentStrategyIsRefused) {
  ShardingOptions o;
  o.offload_param.device = OffloadDevice::kCpu;
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("ShardingOptions::offload_param.device=cpu needs "
                        "ShardingOptions::offload_optimizer.device too"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  // Parameters in files need a strategy that frees them (on the host, offload_param only
  // drops the device copy, under any strategy: DeprecatedCpuOffload.*).
  o.offload_optimizer.device = o.offload_param.device = OffloadDevice::kNvme;
  o.strategy = ShardingStrategy::kZero2;
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("needs a strategy that frees parameters after use "
                        "(ShardingOptions::strategy=kFullShard"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace

namespace {

// DeepSpeed's stage-3 knobs in elements: stage3_max_live_parameters (max_live_numel),
// stage3_prefetch_bucket_size (prefetch_bucket_numel) and
// stage3_param_persistence_threshold (persistence_threshold_numel). A GPT of 4 equal
// blocks of B padded elements; the count bound (max_gathered_units) is lifted so that only
// the element bounds act. Peaks are exact: gathers are issued in a fixed order.
struct PrefetchRun {
  int64_t root = 0, block = 0;  ///< padded elements (fp32: 4 bytes each)
  int64_t gathered_peak = 0;    ///< bytes
  stats::CommStats step;
};
PrefetchRun run_prefetch(const ProcessGroup& pg, int64_t max_live, int64_t bucket,
                         int64_t persistence, int steps = 1) {
  auto cfg = small_gpt_config();
  cfg.n_layer = 4;
  ShardingOptions o = options_for(pg, ShardingStrategy::kFullShard, false);
  o.max_gathered_units = 100;
  o.max_live_numel = max_live;
  o.prefetch_bucket_numel = bucket;
  o.persistence_threshold_numel = persistence;
  torch::manual_seed(2);
  auto model = fully_shard(gpt::GPT(cfg), o);
  torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  PrefetchRun r;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    (f.unit_fqn.empty() ? r.root : r.block) = f.padded_numel;  // the blocks are equal
  }
  for (int s = 0; s < steps; ++s) {
    // Two forwards first, so the second one prefetches in the recorded order.
    model.reset_peak_memory();
    gpt::loss_on(model, my_rows(gpt_batch(s, 4, cfg.block_size), pg)).backward();
    opt.step();
    opt.zero_grad();
  }
  r.gathered_peak = model.memory_stats().gathered_params.peak;
  r.step = model.comm_stats().step;
  return r;
}

TEST(PrefetchBounds, MaxLiveNumelBoundsTheGatheredElementsExactly) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto all = run_prefetch(pg, 0, 0, 0, 2);
    const int64_t B = all.block, R = all.root;
    EXPECT_EQ(all.gathered_peak, 4 * (R + 4 * B)) << "no bound: every block ahead";
    EXPECT_EQ(run_prefetch(pg, 2 * B, 0, 0, 2).gathered_peak, 4 * (R + 2 * B));
    EXPECT_EQ(run_prefetch(pg, 3 * B, 0, 0, 2).gathered_peak, 4 * (R + 3 * B));
    // Below two blocks nothing is prefetched: the computing block alone.
    EXPECT_EQ(run_prefetch(pg, 2 * B - 1, 0, 0, 2).gathered_peak, 4 * (R + B));
  });
}

TEST(PrefetchBounds, PrefetchBucketNumelBoundsTheGathersAhead) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const int64_t B = run_prefetch(pg, 0, 0, 0).block;
    const int64_t R = run_prefetch(pg, 0, 0, 0).root;
    // One block ahead of the computing one, then two.
    EXPECT_EQ(run_prefetch(pg, 0, B, 0, 2).gathered_peak, 4 * (R + 2 * B));
    EXPECT_EQ(run_prefetch(pg, 0, 2 * B, 0, 2).gathered_peak, 4 * (R + 3 * B));
    // The first prefetch always goes, even when one block exceeds the bucket.
    EXPECT_EQ(run_prefetch(pg, 0, B / 2, 0, 2).gathered_peak, 4 * (R + 2 * B));
  });
}

TEST(PrefetchBounds, UnitsBelowThePersistenceThresholdStayGatheredAcrossUses) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto base = run_prefetch(pg, 0, 0, 0, 2);
    const int64_t B = base.block, R = base.root;
    ASSERT_GT(R, B);
    // ZeRO-3: the blocks are gathered for forward and again for backward.
    EXPECT_EQ(base.step.all_gather_bytes, 4 * (R + 2 * 4 * B));
    // Blocks below the threshold (the root is not): gathered once per step.
    const auto kept = run_prefetch(pg, 0, 0, B + 1, 2);
    EXPECT_EQ(kept.step.all_gather_bytes, 4 * (R + 4 * B));
    EXPECT_EQ(kept.gathered_peak, 4 * (R + 4 * B));
  });
}

}  // namespace

// Note [Writes the version counter misses]: LibTorch's SGD steps through Tensor::data(),
// which the shards' version counters do not see. kZero1 and kZero2 (and a unit kept by
// persistence_threshold_numel) still regather after such a step, and train exactly like
// kFullShard. And when only one rank's shard changed, every rank regathers (they agree),
// so the ranks keep issuing the same collectives and compute with the same weights.
TEST(ZeroStages, StepsThroughDataAreSeenAndAgreedOn) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto losses = [&](ShardingOptions o) {
      torch::manual_seed(5);
      auto model = fully_shard(MlpNet(), o);
      torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.05));
      std::vector<float> out;
      for (int step = 0; step < 4; ++step) {
        auto [x, y] = mlp_batch(step, 8);
        auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
        loss.backward();
        opt.step();
        opt.zero_grad();
        out.push_back(loss.item<float>());
      }
      return out;
    };
    const auto full = losses(options_for(pg, ShardingStrategy::kFullShard, false));
    EXPECT_EQ(losses(options_for(pg, ShardingStrategy::kZero2, false)), full);
    EXPECT_EQ(losses(options_for(pg, ShardingStrategy::kZero1, false)), full);
    auto kept = options_for(pg, ShardingStrategy::kFullShard, false);
    kept.persistence_threshold_numel = 1 << 20;  // every unit kept gathered
    EXPECT_EQ(losses(kept), full);

    // Rank 0 alone changes its part of the first unit through .data().
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kZero2}) {
      torch::manual_seed(5);
      auto model = fully_shard(MlpNet(), options_for(pg, strategy, false));
      auto [x, y] = mlp_batch(0, 8);
      torch::NoGradGuard no_grad;
      model(my_rows(x, pg));
      if (pg.rank() == 0) model.sharded_parameters()[0].data().add_(0.5);
      const auto before = model.comm_stats().total.all_gather_calls;
      auto out = model(x);  // the whole batch: the same output on every rank
      EXPECT_GT(model.comm_stats().total.all_gather_calls, before);
      auto all = torch::empty({2 * out.numel()});
      pg.all_gather(all, out.reshape({-1}).contiguous());
      EXPECT_TRUE(
          torch::equal(all.narrow(0, 0, out.numel()), all.narrow(0, out.numel(), out.numel())))
          << "the ranks computed with different weights";
    }
  });
}

}  // namespace test_zero_stages_cases
