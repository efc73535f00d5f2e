// Pipeline parallelism (Note [Pipeline schedules]): stages over real ranks (Gloo), GPipe
// and 1F1B, alone and with FULL_SHARD inside each stage, against the same model trained
// unpipelined in one process; 1F1B's bound on the micro-batches in flight; the partition
// methods; and every refusal's message.
#include <fsdp/full_params.h>
#include <fsdp/loss_scaler.h>
#include <fsdp/pipeline.h>

#include "support/counting_allocator.h"
#include "support/multirank.h"
#include "support/pipeline_layers.h"

#include "../src/comm/backend.h"            // the single process's backend refuses point to point
#include "../src/internal/sharded_model.h"  // flat_params
#include "../src/trace/trace.h"             // flush

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>

namespace fsdp {
// Test names read "GetParam() = gpipe" (Names.EveryParameterisedTestIsListedReadably).
void PrintTo(PipelineSchedule s, std::ostream* os) {
  *os << (s == PipelineSchedule::kGPipe ? "gpipe" : "1f1b");
}
}  // namespace fsdp

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_pipeline_cases {

namespace {

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

// Trains `steps` steps pipelined and, in this process, unpipelined on the same batches
// (each data-parallel replica's rows are its slice of the global batch); the losses and
// the parameters of this rank's layers must agree within `tol` (relative).
void parity(const ProcessGroup& pg, int stages, PipelineSchedule schedule, int micro,
            ShardingStrategy strategy, double tol, bool reduce_once = true) {
  constexpr int64_t kRows = 16;
  torch::manual_seed(0);
  auto reference = pipeline_layers();
  torch::manual_seed(0);
  PipelineOptions o;
  o.stages = stages;
  o.micro_batches = micro;
  o.schedule = schedule;
  o.sharding.process_group = pg;
  o.sharding.strategy = strategy;
  o.reduce_once = reduce_once;
  PipelinedModel pm = pipeline(pipeline_layers(), o);
  const auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-6);
  torch::optim::AdamW opt(pm.sharded_parameters(), adamw);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw);
  const int64_t dp = pm.data_parallel_size(), per = kRows / dp;
  for (int64_t step = 0; step < 4; ++step) {
    auto [x, y] = pipeline_batch(step, kRows);
    auto mx = x.narrow(0, pm.data_parallel_rank() * per, per);
    auto my = y.narrow(0, pm.data_parallel_rank() * per, per);
    const double loss = pm.train_step(mx, my, pipeline_mse).item<double>();
    // Clipped at a bound below the norm, so every step scales: the norm is the whole
    // model's, across the stages.
    const double norm = clip_grad_norm_(pm, 0.05);
    opt.step();
    opt.zero_grad();
    auto ref_loss = pipeline_mse(reference->forward(x), y);
    ref_loss.backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
    EXPECT_LT(rel(norm, ref_norm), tol)
        << "step " << step << ": norm " << norm << ", unpipelined " << ref_norm;
    EXPECT_GT(ref_norm, 0.05) << "step " << step;
    ref_opt.step();
    ref_opt.zero_grad();
    EXPECT_LT(rel(loss, ref_loss.item<double>()), tol)
        << "step " << step << ": pipelined " << loss << ", unpipelined " << ref_loss.item<double>();
  }
  // This stage's layers against the reference's, by their names in the whole model.
  auto ref_params = reference->named_parameters();
  int64_t compared = 0;
  for (const auto& [name, full] : full_state_dict(pm.stage_model())) {
    const auto* r = ref_params.find(name);
    ASSERT_NE(r, nullptr) << name;
    EXPECT_TRUE(torch::allclose(full, *r, 1e-5, 1e-6)) << name;
    ++compared;
  }
  const auto [first, last] = pm.layer_range();
  EXPECT_GT(last, first);
  EXPECT_GT(compared, 0);
}

}  // namespace

TEST(PipelinePartition, ByParametersUniformAndExplicitBoundaries) {
  // Layer sizes as pipeline_layers() has them.
  const std::vector<int64_t> params{
      12 * 32 + 32, 0, 32 * 24 + 24, 24 * 24 + 24, 0, 24 * 40 + 40, 40 * 16 + 16, 16 * 6 + 6};
  PipelineOptions o;
  o.stages = 2;
  o.partition = "uniform";
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 4, 8}));
  o.stages = 4;
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  o.partition = "parameters";
  // Cumulative: 416, 416, 1208, 1808, 1808, 2808, 3464, 3566; quarters of 3566 are near
  // 892, 1783, 2675.
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 3, 4, 6, 8}));
  o.stages = 2;
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 4, 8}));
  o.stages = 3;
  o.partition = "2,7";
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 2, 7, 8}));
  o.stages = 8;
  o.partition = "parameters";
  EXPECT_EQ(partition_layers(params, o), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST(PipelinePartition, RefusalsNameTheValueAndTheFix) {
  const std::vector<int64_t> params{10, 10, 10, 10};
  auto error = [&](const PipelineOptions& o) {
    try {
      partition_layers(params, o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("<no error>");
  };
  PipelineOptions o;
  o.stages = 5;
  EXPECT_EQ(error(o).rfind("PipelineOptions::stages=5 but the model has 4 layer(s), and each "
                           "stage needs at least one: use at most 4 stages",
                           0),
            0u)
      << error(o);
  o.stages = 3;
  o.partition = "2";
  EXPECT_NE(error(o).find("gives 1 boundaries, but stages=3 needs 2"), std::string::npos)
      << error(o);
  o.partition = "2,2";
  EXPECT_NE(error(o).find("boundaries must rise from 1 to 3"), std::string::npos) << error(o);
  o.partition = "balanced";
  EXPECT_NE(error(o).find("'balanced' is not a layer index; expected parameters, uniform"),
            std::string::npos)
      << error(o);
  EXPECT_THROW(parse_pipeline_schedule("interleaved", "--pipeline-schedule"), c10::Error);
  EXPECT_EQ(parse_pipeline_schedule("gpipe"), PipelineSchedule::kGPipe);
  EXPECT_EQ(parse_pipeline_schedule("1f1b"), PipelineSchedule::k1F1B);
}

TEST(Pipeline, RefusesStagesThatDoNotDivideTheWorldAndTooFewMicroBatches) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto error = [&](const PipelineOptions& o) {
      try {
        pipeline(pipeline_layers(), o);
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("<no error>");
    };
    PipelineOptions o;
    o.sharding.process_group = pg;
    o.stages = 3;
    EXPECT_NE(error(o).find("PipelineOptions::stages=3 does not divide the world size 2"),
              std::string::npos)
        << error(o);
    o.stages = 2;
    o.micro_batches = 1;
    EXPECT_NE(error(o).find("micro_batches=1 is fewer than stages=2 under the 1F1B schedule"),
              std::string::npos)
        << error(o);
  });
}

// fp16's loss scaler over a pipeline: an inf in one stage's gradients skips the step on
// every stage (the other stage's gradients are finite), and the scale comes down on both.
TEST(Pipeline, LossScalerSkipsTheStepOnEveryStageWhenOneOverflows) {
  run_ranks(2, [](const ProcessGroup& pg) {
    PipelineOptions o;
    o.sharding.process_group = pg;
    o.micro_batches = 2;
    PipelinedModel pm = pipeline(pipeline_layers(), o);
    LossScalerOptions so;
    so.hysteresis = 1;
    LossScaler scaler(pm, so);
    torch::optim::SGD opt(pm.sharded_parameters(), torch::optim::SGDOptions(0.1));
    auto [x, y] = pipeline_batch(0, 4);
    const double scale = scaler.state().scale;
    pm.train_step(x, y, [&](const torch::Tensor& out, const torch::Tensor& t) {
      return scaler.scale(pipeline_mse(out, t));
    });
    if (pm.stage() == 0) {  // only the first stage's gradients overflow
      for (auto& p : pm.sharded_parameters()) p.grad().fill_(INFINITY);
    }
    std::vector<torch::Tensor> before;
    for (const auto& p : pm.sharded_parameters()) before.push_back(p.detach().clone());
    EXPECT_FALSE(scaler.step(opt)) << "stage " << pm.stage() << " stepped";
    EXPECT_TRUE(scaler.overflowed());
    scaler.update();
    EXPECT_EQ(scaler.state().skipped_steps, 1);
    EXPECT_EQ(scaler.state().scale, scale / 2);
    const auto params = pm.sharded_parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
  });
}

// A layer whose output has more dimensions than a message's header holds, at a stage
// boundary: the sending stage fails, and so does the receiving one (the header tells it),
// instead of waiting for data that never comes.
struct NineDimsImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return x.reshape({x.size(0), 1, 1, 1, 1, 1, 1, 1, -1});
  }
};
TORCH_MODULE(NineDims);

TEST(Pipeline, AnOutputOfNineDimensionsFailsBothStages) {
  run_ranks(2, [](const ProcessGroup& pg) {
    PipelineOptions o;
    o.sharding.process_group = pg;
    o.micro_batches = 2;
    o.partition = "1";  // the boundary right after NineDims
    PipelinedModel pm = pipeline(torch::nn::Sequential(NineDims(), torch::nn::Flatten(),
                                                       torch::nn::Linear(kPipeIn, kPipeOut)),
                                 o);
    auto [x, y] = pipeline_batch(0, 4);
    std::string error = "<no error>";
    try {
      pm.train_step(x, y, pipeline_mse);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    const std::string why =
        "output has 9 dimensions; at most 8 travel between stages: flatten it in the layer that "
        "makes it and restore the shape in the next stage's first layer";
    EXPECT_EQ(error, (pg.rank() == 0 ? "pipeline: a stage's "
                                     : "pipeline: rank 0 could not send micro-batch 0: its "
                                       "stage's ") +
                         why);
  });
}

// One process, one stage: the batch checks, the empty model, and a group of one rank
// that has no peer to send to.
TEST(Pipeline, RefusesAnEmptyModelABatchThatDoesNotSplitAndPointToPointAlone) {
  auto error = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("<no error>");
  };
  PipelineOptions o;
  o.stages = 1;
  o.micro_batches = 4;
  EXPECT_EQ(error([&] { pipeline(torch::nn::Sequential(), o); }),
            "pipeline: the Sequential is empty; give it the model's layers in order");
  PipelinedModel pm = pipeline(pipeline_layers(), o);
  auto [x, y] = pipeline_batch(0, 6);
  EXPECT_EQ(error([&] { pm.train_step(x, pipeline_batch(0, 8).second, pipeline_mse); }),
            "PipelinedModel::train_step: the input's 6 rows do not split into micro_batches=4 "
            "equal parts: give a batch whose first dimension is a multiple of 4");
  EXPECT_EQ(error([&] { pm.train_step(pipeline_batch(0, 8).first, y, pipeline_mse); }),
            "PipelinedModel::train_step: the target's 6 rows do not split into micro_batches=4 "
            "equal parts: give a batch whose first dimension is a multiple of 4");
  EXPECT_EQ(error([&] { pm.forward(x); }),
            "PipelinedModel::forward: the input's 6 rows do not split into micro_batches=4 equal "
            "parts: give a batch whose first dimension is a multiple of 4");
  EXPECT_EQ(error([&] { PipelinedModel().forward(x); }),
            "PipelinedModel::forward: an empty model; build it with fsdp::pipeline");
  auto single = fsdp::detail::GroupAccess::backend(ProcessGroup());
  EXPECT_EQ(error([&] { single->send(x, 1, 0); }),
            "send to rank 1: point-to-point messages need a group of two or more ranks over gloo "
            "or nccl; this group is single with 1 rank(s)");
  EXPECT_EQ(error([&] { single->recv(x, 1, 0); }),
            "recv from rank 1: point-to-point messages need a group of two or more ranks over "
            "gloo or nccl; this group is single with 1 rank(s)");
}

class PipelineParity : public ::testing::TestWithParam<PipelineSchedule> {};

TEST_P(PipelineParity, TwoStagesTrainLikeOneProcess) {
  run_ranks(2, [](const ProcessGroup& pg) {
    parity(pg, 2, GetParam(), 4, ShardingStrategy::kFullShard, 1e-6);
  });
}

TEST_P(PipelineParity, FourStagesTrainLikeOneProcess) {
  run_ranks(4, [](const ProcessGroup& pg) {
    parity(pg, 4, GetParam(), 4, ShardingStrategy::kFullShard, 1e-6);
  });
}

TEST_P(PipelineParity, TwoStagesTimesFullShardTwoTrainLikeOneProcess) {
  run_ranks(4, [](const ProcessGroup& pg) {
    parity(pg, 2, GetParam(), 2, ShardingStrategy::kFullShard, 1e-6);
  });
}

TEST_P(PipelineParity, ReducingEveryMicroBatchTrainsLikeOneProcess) {
  run_ranks(4, [](const ProcessGroup& pg) {
    parity(pg, 2, GetParam(), 2, ShardingStrategy::kFullShard, 1e-6, /*reduce_once=*/false);
  });
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineParity,
                         ::testing::Values(PipelineSchedule::kGPipe, PipelineSchedule::k1F1B),
                         [](const auto& info) {
                           return info.param == PipelineSchedule::kGPipe ? "GPipe" : "OneFOneB";
                         });

// PipelineOptions::reduce_once: one reduce-scatter per unit a step, in the last
// micro-batch's backward, and each unit gathered once for all the backwards; false: each
// micro-batch's backward gathers and reduces.
TEST(Pipeline, ReduceOnceReducesEachUnitOnceAStep) {
  run_ranks(4, [](const ProcessGroup& pg) {
    std::map<bool, int64_t> gathers;
    int64_t units = 0;  // this stage's units with parameters: each gathers and reduces
    for (bool once : {true, false}) {
      PipelineOptions o;
      o.sharding.process_group = pg;
      o.micro_batches = 4;
      o.reduce_once = once;
      PipelinedModel pm = pipeline(pipeline_layers(), o);
      torch::optim::SGD opt(pm.sharded_parameters(), torch::optim::SGDOptions(0.1));
      units = 0;
      for (const auto& f : fsdp::detail::flat_params(pm.stage_model())) units += f.requires_grad;
      auto [x, y] = pipeline_batch(0, 16);
      const int64_t per = 16 / pm.data_parallel_size();
      const stats::CommStats before = pm.stage_model().comm_stats().total;
      pm.train_step(x.narrow(0, pm.data_parallel_rank() * per, per),
                    y.narrow(0, pm.data_parallel_rank() * per, per), pipeline_mse);
      const stats::CommStats after = pm.stage_model().comm_stats().total;
      EXPECT_EQ(after.reduce_scatter_calls - before.reduce_scatter_calls, once ? units : 4 * units)
          << "reduce_once " << once << ", stage " << pm.stage();
      gathers[once] = after.all_gather_calls - before.all_gather_calls;
      opt.step();
    }
    // FULL_SHARD frees a unit after each forward and each backward: 4 + 4 gathers a
    // unit; kept gathered from one backward to the next, fewer.
    EXPECT_GT(units, 0);
    EXPECT_EQ(gathers[false], 8 * units);
    EXPECT_LT(gathers[true], gathers[false]);
  });
}

// 1F1B holds at most stages - stage micro-batches' activations on each stage; GPipe all.
TEST(Pipeline, OneFOneBBoundsTheMicroBatchesInFlight) {
  run_ranks(4, [](const ProcessGroup& pg) {
    for (auto schedule : {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe}) {
      PipelineOptions o;
      o.stages = 4;
      o.micro_batches = 8;
      o.schedule = schedule;
      o.sharding.process_group = pg;
      torch::manual_seed(0);
      PipelinedModel pm = pipeline(pipeline_layers(), o);
      auto [x, y] = pipeline_batch(0, 16);
      pm.train_step(x, y, pipeline_mse);
      const int expected = schedule == PipelineSchedule::k1F1B ? 4 - pm.stage() : 8;
      EXPECT_EQ(pm.peak_micro_batches_in_flight(), expected) << "stage " << pm.stage();
    }
  });
}

namespace {

// Bytes of the CPU generator's state, as pipeline() saves it before each layer.
int64_t rng_state_bytes() {
  auto g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return static_cast<int64_t>(g.get_state().nbytes());
}

// A layer that takes `ms` milliseconds: the stage that holds it is the slow one.
struct SlowImpl : torch::nn::Module {
  explicit SlowImpl(int ms) : ms(ms) {}
  torch::Tensor forward(const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x;
  }
  int ms;
};
TORCH_MODULE(Slow);

}  // namespace

// A receive's wait is split in the trace (Note [Pipeline schedules]): the time until the
// sender posted is the bubble, the rest the link. Stage 0 takes 60 ms a forward, so stage
// 1 waits that long for each activation before the sender posts it: a bubble of about
// 60 ms, followed at once by the transfer's short "wait" span.
TEST(Pipeline, TheTraceSplitsAReceiveIntoBubbleAndTransfer) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("pipeline_trace_" + std::to_string(::getpid())))
          .string();
  std::filesystem::remove_all(dir);
  run_ranks(2, [&](const ProcessGroup& pg) {
    PipelineOptions o;
    o.stages = 2;
    o.micro_batches = 2;
    o.partition = "2";
    o.sharding.process_group = pg;
    o.sharding.trace = dir;
    torch::manual_seed(0);
    PipelinedModel pm = pipeline(torch::nn::Sequential(torch::nn::Linear(kPipeIn, 16), Slow(60),
                                                       torch::nn::Linear(16, kPipeOut)),
                                 o);
    auto [x, y] = pipeline_batch(0, 8);
    pm.train_step(x, y, pipeline_mse);
    fsdp::detail::trace::flush();
    if (pg.rank() != 1) return;
    std::ifstream f(std::filesystem::path(dir) / "trace_rank1.json");
    ASSERT_TRUE(f.good());
    const auto trace = nlohmann::json::parse(f);
    std::map<std::string, std::pair<double, double>> spans;  // name -> (begin, end) µs
    for (const auto& e : trace.at("traceEvents")) {
      if (e.value("ph", "") != "X") continue;
      const double ts = e.at("ts").get<double>();
      spans[e.at("name").get<std::string>() + "|" + e.at("cat").get<std::string>()] = {
          ts, ts + e.at("dur").get<double>()};
    }
    for (int mb = 0; mb < 2; ++mb) {
      const std::string name = "recv activation " + std::to_string(mb);
      ASSERT_TRUE(spans.count("bubble: " + name + "|bubble")) << name;
      ASSERT_TRUE(spans.count(name + "|wait")) << name;
      const auto bubble = spans["bubble: " + name + "|bubble"];
      const auto link = spans[name + "|wait"];
      EXPECT_GE(bubble.second - bubble.first, 40e3) << name << ": stage 0 took 60 ms";
      EXPECT_NEAR(link.first, bubble.second, 1.0) << name << ": the link's part follows";
      EXPECT_LT(link.second - link.first, bubble.second - bubble.first) << name;
    }
  });
  std::filesystem::remove_all(dir);
}

// Note [Building one stage]: from a layer factory, each rank keeps only its stage's
// layers (the others' modules are gone once pipeline() returns), which hold the whole
// model's weights from the same seed, and the CPU generator ends where building the whole
// model leaves it; by parameters (a counting pass) and uniform (one pass), at 2 stages
// x FULL_SHARD 2 and at 4 stages.
TEST(Pipeline, ALayerFactoryBuildsOnlyTheStageWithTheWholeModelsWeights) {
  run_ranks(4, [](const ProcessGroup& pg) {
    for (const auto& [stages, partition] : std::vector<std::pair<int, std::string>>{
             {2, "parameters"}, {4, "uniform"}, {4, "parameters"}}) {
      SCOPED_TRACE(std::to_string(stages) + " stages by " + partition);
      torch::manual_seed(21);
      auto whole = pipeline_layers();
      const auto after_whole = torch::rand({4});
      std::vector<std::weak_ptr<torch::nn::Module>> made(kPipeLayers);
      PipelineLayers layers;
      layers.count = kPipeLayers;
      layers.make = [&](int64_t i) {
        auto m = pipeline_layer(i);
        made[static_cast<size_t>(i)] = m.ptr();
        return std::make_pair(std::to_string(i), m);
      };
      PipelineOptions o;
      o.stages = stages;
      o.partition = partition;
      o.sharding.process_group = pg;
      torch::manual_seed(21);
      PipelinedModel pm = pipeline(layers, o);
      EXPECT_TRUE(torch::equal(torch::rand({4}), after_whole))
          << "the generator is where building the whole model leaves it";
      const auto [first, last] = pm.layer_range();
      for (int64_t i = 0; i < kPipeLayers; ++i) {
        EXPECT_EQ(made[static_cast<size_t>(i)].expired(), i < first || i >= last)
            << "layer " << i << " on stage " << pm.stage();
      }
      auto want = whole->named_parameters();
      int64_t n = 0;
      for (const auto& [name, full] : full_state_dict(pm.stage_model())) {
        ASSERT_NE(want.find(name), nullptr) << name;
        EXPECT_TRUE(torch::equal(full, want[name])) << name;
        ++n;
      }
      EXPECT_GT(n, 0);
      // The same boundaries as the Sequential's.
      torch::manual_seed(21);
      EXPECT_EQ(pipeline(pipeline_layers(), o).boundaries(), pm.boundaries());
    }
  });
}

// Host memory while a stage is built from a factory: each rank's peak is its stage's
// shards plus the one layer being built (and the generator's saved states), never its
// stage in full, let alone the model. Counted by the CPU allocator, byte for byte; eight
// layers of 256 x 256 at 2 stages x FULL_SHARD 2.
TEST(Pipeline, BuildingOneStageHoldsItsShardsAndOneLayer) {
  run_ranks(4, [](const ProcessGroup& pg) {
    auto& counter = CountingCpuAllocator::install();
    static constexpr int64_t kLayers = 8, kWidth = 256;
    const int64_t layer_bytes = 4 * (kWidth * kWidth + kWidth);
    PipelineLayers layers;
    layers.count = kLayers;
    layers.make = [](int64_t i) {
      return std::make_pair(std::to_string(i),
                            torch::nn::AnyModule(torch::nn::Linear(kWidth, kWidth)));
    };
    PipelineOptions o;
    o.stages = 2;
    o.sharding.process_group = pg;
    // Every rank draws the same weights; and a broadcast's buffers may outlive its wait on
    // Gloo's thread for a moment, which would blur the count.
    o.sharding.sync_module_states = false;
    torch::manual_seed(0);
    const int64_t base = counter.live();
    counter.reset_peak();
    PipelinedModel pm = pipeline(layers, o);
    const int64_t peak = counter.peak() - base;
    const int64_t shards = pm.stage_model().memory_stats().sharded_params.current;
    const int64_t states = (kLayers + 1) * rng_state_bytes();  // the counting pass's
    if (pg.rank() == 0) {
      std::printf(
          "[report] building stage %d of 2: peak %lld B <= shards %lld + one layer %lld + "
          "generator states %lld = %lld B; the stage in full %lld B, the model %lld B\n",
          pm.stage(), static_cast<long long>(peak), static_cast<long long>(shards),
          static_cast<long long>(layer_bytes), static_cast<long long>(states),
          static_cast<long long>(shards + layer_bytes + states),
          static_cast<long long>(kLayers / 2 * layer_bytes),
          static_cast<long long>(kLayers * layer_bytes));
      std::fflush(stdout);
    }
    EXPECT_EQ(shards, kLayers / 2 * layer_bytes / 2);
    EXPECT_LE(peak, shards + layer_bytes + states)
        << "peak " << peak << " B: shards " << shards << " + one layer " << layer_bytes
        << " + generator states " << states;
    EXPECT_LT(peak, kLayers / 2 * layer_bytes) << "never the stage in full";
  });
}

// A layer factory and a forward given what they cannot use: each refusal names the value.
TEST(Pipeline, ALayerFactoryAndForwardRefuseWhatTheyCannotUse) {
  auto error = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("<no error>");
  };
  PipelineOptions o;
  o.stages = 1;
  o.micro_batches = 1;
  PipelineLayers layers;
  EXPECT_NE(error([&] {
              pipeline(layers, o);
            }).find("PipelineLayers needs count >= 1 (got 0) and a factory `make`"),
            std::string::npos);
  layers.count = 2;
  layers.make = [](int64_t i) {
    return std::make_pair(std::to_string(i), i == 0 ? pipeline_layer(0) : torch::nn::AnyModule());
  };
  layers.params = {1};
  EXPECT_NE(
      error([&] { pipeline(layers, o); }).find("PipelineLayers::params has 1 entries for 2 layers"),
      std::string::npos);
  layers.params.clear();
  EXPECT_NE(error([&] {
              pipeline(layers, o);
            }).find("the layer factory made no module for layer 1 ('1')"),
            std::string::npos);
  PipelinedModel pm = pipeline(pipeline_layers(), o);
  EXPECT_NE(error([&] {
              pm.forward(torch::zeros({2, kPipeIn}), -1);
            }).find("micro_batches=-1 must be 0 (PipelineOptions::micro_batches) or positive"),
            std::string::npos);
}

}  // namespace test_pipeline_cases
