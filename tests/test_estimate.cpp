// fsdp-estimate against the engine's own counters: the model-state terms must equal the
// bytes the engine and the optimizer hold in a training step, exactly, and the
// gathered-unit and buffer terms must bound the counters' peaks. Then the CLI: its
// table, its JSON (equal to the library's figures) and its bad-input errors.
#include <fsdp/checkpoint_format.h>
#include <fsdp/estimate.h>
#include <fsdp/version.h>

#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read
#include "../src/tools/gpt_units.h"         // the GPT example's units, as fsdp-estimate counts them

using namespace fsdp;
using namespace fsdp::testing;
using fsdp::tools::gpt_unit_params;

namespace {

// Three blocks and max_gathered_units = 2: the prefetch bound (root + 2 blocks) differs
// from "every unit gathered" (SHARD_GRAD_OP, NO_SHARD), so the test tells them apart.
gpt::Config test_gpt() {
  auto cfg = small_gpt_config();
  cfg.n_layer = 3;
  return cfg;
}

/// One run to compare: the strategy and precision names are the estimator's.
struct Scenario {
  std::string strategy = "full";
  std::string precision = "fp32";
  bool offload = false;
  int hybrid_group_size = 0;
  std::string name() const {
    return strategy + "/" + precision + (offload ? "/offload" : "") +
           (hybrid_group_size ? "/g" + std::to_string(hybrid_group_size) : "");
  }
};

ShardingStrategy strategy_of(const Scenario& run) {
  if (run.strategy == "grad_op") return ShardingStrategy::kShardGradOp;
  if (run.strategy == "none") return ShardingStrategy::kNoShard;
  if (run.strategy == "hybrid") return ShardingStrategy::kHybridShard;
  return ShardingStrategy::kFullShard;
}

Precision precision_of(const Scenario& run) {
  if (run.precision == "bf16") return Precision::kBf16;
  if (run.precision == "fp16") return Precision::kFp16;
  return Precision::kFp32;
}

ShardingOptions options_for(const Scenario& run, const ProcessGroup& pg) {
  ShardingOptions o;
  o.process_group = pg;
  o.cpu_offload = run.offload;
  o.hybrid_group_size = run.hybrid_group_size;
  o.strategy = strategy_of(run);
  if (run.precision != "fp32") {
    const auto dt = run.precision == "bf16" ? torch::kBFloat16 : torch::kHalf;
    o.mixed_precision.param_dtype = dt;
    o.mixed_precision.reduce_dtype = dt;
  }
  return o;
}

EstimateInput input_for(const Scenario& run, const gpt::Config& cfg, int world) {
  EstimateInput in;
  in.unit_params = gpt_unit_params(cfg.n_layer, cfg.d_model, cfg.block_size, cfg.vocab_size);
  in.world_size = world;
  in.strategy = strategy_of(run);
  in.hybrid_group_size = run.hybrid_group_size;
  in.precision = precision_of(run);
  in.cpu_offload = run.offload;
  return in;
}

// Bytes of AdamW's exp_avg and exp_avg_sq, from the optimizer itself.
int64_t adam_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (auto& kv : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
    bytes += st.exp_avg().numel() * st.exp_avg().element_size();
    bytes += st.exp_avg_sq().numel() * st.exp_avg_sq().element_size();
  }
  return bytes;
}

// Two AdamW steps (the second one prefetches in forward too, with the order recorded),
// then the estimate against the counters. Model state is on the device column, or on
// the host column with offload; the other column must be zero.
void compare(const ProcessGroup& pg, const Scenario& run) {
  SCOPED_TRACE(run.name() + " at world " + std::to_string(pg.size()));
  const auto cfg = test_gpt();
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), options_for(run, pg));
  torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  const auto est = estimate_memory(input_for(run, cfg, pg.size()));
  auto column = [&](const std::string& key) {
    const auto& t = est.term(key);
    EXPECT_EQ(run.offload ? t.device_bytes : t.host_bytes, 0) << key << " in the wrong column";
    return run.offload ? t.host_bytes : t.device_bytes;
  };

  int64_t n_params = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) n_params += f.numel;
  EXPECT_EQ(est.total_params, n_params) << "the GPT parameter count";
  EXPECT_EQ(column("parameters"), model.memory_stats().sharded_params.current);
  for (int64_t step = 0; step < 2; ++step) {
    opt.zero_grad();
    gpt::loss_on(model, my_rows(gpt_batch(step, 2 * pg.size(), cfg.block_size), pg)).backward();
    EXPECT_EQ(column("gradients"), model.memory_stats().grad_shards.current)
        << "after backward " << step;
    opt.step();
  }
  const auto mem = model.memory_stats();
  EXPECT_EQ(column("parameters"), mem.sharded_params.current);
  EXPECT_EQ(column("optimizer_state"), adam_state_bytes(opt));

  // The bounds hold, and for gathered units the estimate is reached: three equal blocks
  // prefetched two at a time, or all of them gathered at the end of forward.
  EXPECT_EQ(est.term("gathered_units").device_bytes, mem.gathered_params.peak);
  EXPECT_GE(est.term("comm_buffers").device_bytes, mem.comm_buffers.peak);
  const int64_t offload_est = run.offload ? est.term("offload_buffers").device_bytes +
                                                est.term("offload_buffers").host_bytes
                                          : 0;
  EXPECT_GE(offload_est, mem.offload_buffers.peak);
  if (run.offload) EXPECT_GT(mem.offload_buffers.peak, 0);
}

class EstimateAtWorld : public ::testing::TestWithParam<int> {};
TEST_P(EstimateAtWorld, FullShardTermsMatchTheCountersFp32AndBf16) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) {
    for (const char* precision : {"fp32", "bf16"}) compare(pg, Scenario{"full", precision});
  });
}
INSTANTIATE_TEST_SUITE_P(World, EstimateAtWorld, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(EstimateStrategies, OtherStrategiesAndOffloadMatchTheCountersAtWorld2) {
  run_ranks(2, [](const ProcessGroup& pg) {
    for (const Scenario& run :
         {Scenario{"grad_op", "bf16"}, Scenario{"none", "fp32"}, Scenario{"none", "bf16"},
          Scenario{"hybrid", "bf16", false, 1}, Scenario{"hybrid", "fp32", false, 2},
          Scenario{"full", "fp32", true}, Scenario{"full", "bf16", true}}) {
      compare(pg, run);
    }
  });
}

// The rules on numbers worked out by hand, so that a wrong rule fails even where the
// engine would agree with it by accident.
// A value cast into the enums from outside their enumerators is named, not estimated.
TEST(EstimateRules, AValueOutsideTheEnumsIsNamed) {
  EstimateInput in;
  in.unit_params = {10, 100};
  in.strategy = static_cast<ShardingStrategy>(7);
  try {
    estimate_memory(in);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "strategy 7 is not a ShardingStrategy; use one of its enumerators");
  }
  in.strategy = ShardingStrategy::kFullShard;
  in.precision = static_cast<Precision>(9);
  try {
    estimate_memory(in);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "precision 9 is not a Precision; use one of its enumerators");
  }
}

TEST(EstimateRules, HandWorkedFigures) {
  EstimateInput in;
  in.unit_params = {10, 100, 100, 50};  // root, then three units
  in.world_size = 4;
  in.precision = Precision::kBf16;
  auto est = estimate_memory(in);
  // Padded to 12, 100, 100, 52; shards 3 + 25 + 25 + 13 = 66 elements.
  EXPECT_EQ(est.term("parameters").device_bytes, 66 * 4);
  EXPECT_EQ(est.term("gradients").device_bytes, 66 * 4);
  EXPECT_EQ(est.term("optimizer_state").device_bytes, 66 * 8);
  EXPECT_EQ(est.term("gathered_units").device_bytes, (12 + 100 + 100) * 2);  // root + 2 largest
  // Backward: the root's flat gradient (bf16), the computing unit's and the one whose
  // reduce-scatter is in flight, and one prefetched shard cast to bf16; more than
  // forward's two casts in flight.
  EXPECT_EQ(est.term("comm_buffers").device_bytes, (12 + 100 + 100) * 2 + 25 * 2);
  EXPECT_EQ(est.host_total(), 0);

  in.strategy = ShardingStrategy::kShardGradOp;  // every unit gathered from forward on: no prefetch
                                                 // in backward
  est = estimate_memory(in);
  EXPECT_EQ(est.term("gathered_units").device_bytes, (12 + 100 + 100 + 52) * 2);
  EXPECT_EQ(est.term("comm_buffers").device_bytes, (12 + 100 + 100) * 2);
  in.strategy = ShardingStrategy::kHybridShard;
  in.hybrid_group_size = 2;  // padded 10, 100, 100, 50; shards 5 + 50 + 50 + 25
  EXPECT_EQ(estimate_memory(in).term("parameters").device_bytes, 130 * 4);
  EXPECT_EQ(estimate_memory(in).shard_group_size, 2);
  in.strategy = ShardingStrategy::kNoShard;
  in.precision =
      Precision::kFp32;  // a group of one in fp32 computes on the shard: nothing gathered
  est = estimate_memory(in);
  EXPECT_EQ(est.term("parameters").device_bytes, 260 * 4);
  EXPECT_EQ(est.term("gathered_units").device_bytes, 0);
  EXPECT_EQ(est.term("comm_buffers").device_bytes, (10 + 100 + 100) * 4);  // world 4: still reduced

  in.strategy = ShardingStrategy::kFullShard;
  in.precision = Precision::kBf16;
  in.cpu_offload = true;
  est = estimate_memory(in);
  EXPECT_EQ(est.term("optimizer_state").host_bytes, 66 * 8);
  EXPECT_EQ(est.term("optimizer_state").device_bytes, 0);
  // Host: the model state, and two units' fp32 gradient shards waiting to be added.
  EXPECT_EQ(est.host_total(), 66 * 16 + 2 * 25 * 4);
  // Device: forward's two prefetched shards in bf16, in transit to their gathers (more
  // than backward's one).
  EXPECT_EQ(est.term("offload_buffers").device_bytes, (25 + 25) * 2);
  EXPECT_EQ(est.term("offload_buffers").host_bytes, 2 * 25 * 4);
  EXPECT_EQ(est.term("comm_buffers").device_bytes,
            (12 + 100 + 100) * 2);  // the copy casts: no cast buffer
}

TEST(EstimateRules, ActivationCheckpointingKeepsBlockInputsAndOneBlock) {
  EstimateInput in;
  in.activations = {/*n_layer=*/4,      /*n_head=*/2,
                    /*d_model=*/64,     /*block_size=*/32,
                    /*vocab_size=*/256, /*micro_batch=*/3};
  in.unit_params = gpt_unit_params(4, 64, 32);
  const int64_t sbh = 32 * 3 * 64, logits = 2 * 32 * 3 * 256 * 4;
  const int64_t block = sbh * (34 + 5 * 2 * 32 / 64);  // fp32: twice the 2-byte figure / 2
  EXPECT_EQ(estimate_memory(in).term("activations").device_bytes, 4 * 2 * block + logits);
  in.activation_checkpointing = true;
  EXPECT_EQ(estimate_memory(in).term("activations").device_bytes, 4 * sbh * 4 + 2 * block + logits);
}

std::vector<std::string> tool(std::vector<std::string> args) {
  args.insert(args.begin(), bin_dir() + "/fsdp-estimate");
  return args;
}

const std::vector<std::string> kShape = {"--n-layer",     "24",
                                         "--n-head",      "16",
                                         "--d-model",     "2048",
                                         "--block-size",  "1024",
                                         "--world-size",  "8",
                                         "--precision",   "bf16",
                                         "--cpu-offload", "--activation-checkpointing",
                                         "--micro-batch", "4"};

EstimateInput shape_input() {
  EstimateInput in;
  in.unit_params = gpt_unit_params(24, 2048, 1024);
  in.world_size = 8;
  in.precision = Precision::kBf16;
  in.cpu_offload = true;
  in.activation_checkpointing = true;
  in.activations = {/*n_layer=*/24,     /*n_head=*/16,
                    /*d_model=*/2048,   /*block_size=*/1024,
                    /*vocab_size=*/256, /*micro_batch=*/4};
  return in;
}

TEST(EstimateTool, PrintsEveryTermAndExitsZero) {
  auto r = run_command(tool(kShape));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* want :
       {"parameters (fp32 shards)", "gradients (fp32 shards)", "optimizer state (AdamW m, v)",
        "gathered units (bf16)", "reduce/cast buffers", "offload transit buffers",
        "activations (checkpointed)", "total", "device", "host",
        "Estimated memory needed for params, optim states and gradients"}) {
    EXPECT_NE(r.output.find(want), std::string::npos) << "'" << want << "' missing:\n" << r.output;
  }
}

TEST(EstimateTool, JsonMatchesTheLibraryTermByTerm) {
  auto args = kShape;
  args.push_back("--json");
  auto r = run_command(tool(args));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const auto est = estimate_memory(shape_input());
  ASSERT_EQ(j.at("terms").size(), est.terms.size());
  for (size_t i = 0; i < est.terms.size(); ++i) {
    const auto& t = j.at("terms")[i];
    EXPECT_EQ(t.at("key").get<std::string>(), est.terms[i].key);
    EXPECT_EQ(t.at("device_bytes").get<int64_t>(), est.terms[i].device_bytes) << est.terms[i].key;
    EXPECT_EQ(t.at("host_bytes").get<int64_t>(), est.terms[i].host_bytes) << est.terms[i].key;
  }
  EXPECT_EQ(j.at("params").get<int64_t>(), est.total_params);
  EXPECT_EQ(j.at("shard_group_size").get<int>(), 8);
  EXPECT_EQ(j.at("device_total_bytes").get<int64_t>(), est.device_total());
  EXPECT_EQ(j.at("host_total_bytes").get<int64_t>(), est.host_total());
  // Offload puts all 16 bytes per sharded element on the host, and the gradient copies
  // that wait to be added (two of the largest shard, fp32).
  int64_t shard_elems = 0, largest = 0;
  for (int64_t n : shape_input().unit_params) {
    shard_elems += (n + 7) / 8;
    largest = std::max(largest, (n + 7) / 8);
  }
  EXPECT_EQ(j.at("host_total_bytes").get<int64_t>(), 16 * shard_elems + 2 * 4 * largest);
}

TEST(EstimateTool, ParamsCountIsSplitIntoEqualUnits) {
  auto r = run_command(tool({"--params", "1.3e9", "--units", "4", "--world-size", "3", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j.at("params").get<int64_t>(), 1300000000);
  EXPECT_EQ(j.at("units").get<std::vector<int64_t>>(),
            (std::vector<int64_t>{0, 325000000, 325000000, 325000000, 325000000}));
}

struct Bad {
  std::vector<std::string> args;
  std::string message;
};
// Names the case by its arguments in test listings (ctest shows them).
void PrintTo(const Bad& b, std::ostream* os) {
  *os << "fsdp-estimate";
  for (const auto& a : b.args) *os << " " << a;
}
class EstimateBadInput : public ::testing::TestWithParam<Bad> {};
TEST_P(EstimateBadInput, ExitsTwoWithTheMessage) {
  auto r = run_command(tool(GetParam().args));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("fsdp-estimate: error: " + GetParam().message), std::string::npos)
      << r.output;
}
INSTANTIATE_TEST_SUITE_P(
    Cases, EstimateBadInput,
    ::testing::Values(
        Bad{{},
            "no model given; give a GPT shape (--n-layer --n-head --d-model --block-size) or "
            "--params N"},
        Bad{{"--params", "1e9", "--strategy", "zero3"},
            "--strategy 'zero3' is unknown; use full, grad_op, none or hybrid"},
        Bad{{"--params", "1e9", "--precision", "fp8"},
            "--precision 'fp8' is unknown; use fp32, bf16 or fp16"},
        Bad{{"--params", "1e9", "--world-size", "0"},
            "--world-size 0 is invalid; it must be at least 1"},
        Bad{{"--params=-5"}, "--params -5 is invalid; give a positive count such as 1.3e9"},
        Bad{{"--params", "abc"}, "--params 'abc' is not a number; give a count such as 1.3e9"},
        Bad{{"--params", "1e9", "--units", "0"}, "--units 0 is invalid; it must be positive"},
        Bad{{"--params", "1e9", "--world-size", "6", "--strategy", "hybrid", "--hybrid-group-size",
             "4"},
            "--hybrid-group-size 4 is invalid; it must divide the world size 6"},
        Bad{{"--n-layer", "2", "--n-head", "3", "--d-model", "64", "--block-size", "8"},
            "--d-model 64 is not divisible by --n-head 3"},
        Bad{{"--n-layer", "2", "--n-head", "2", "--d-model", "64"}, "--block-size is missing"},
        Bad{{"--n-layer", "2", "--n-head", "2", "--d-model", "64", "--block-size", "8",
             "--micro-batch", "0"},
            "--micro-batch 0 is invalid; it must be positive"},
        Bad{{"--n-layer", "2", "--n-head", "2", "--d-model", "64", "--block-size", "8", "--params",
             "5"},
            "give either a GPT shape or --params, not both"},
        Bad{{"--params", "1e9", "--no-such-flag"}, "Option"}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// One version everywhere: the headers, the library, and every tool's --version.
TEST(Version, HeadersLibraryAndEveryToolAgree) {
  EXPECT_STREQ(fsdp::version(), FSDP_VERSION_STRING);
  EXPECT_EQ(std::string(FSDP_VERSION_STRING), std::to_string(FSDP_VERSION_MAJOR) + "." +
                                                  std::to_string(FSDP_VERSION_MINOR) + "." +
                                                  std::to_string(FSDP_VERSION_PATCH));
  std::vector<std::string> tools = {"fsdp-run", "fsdp-estimate"};
#ifdef FSDP_TEST_HAVE_HDF5
  tools.insert(tools.end(), {"fsdp-consolidate", "fsdp-inspect"});
#endif
  for (const auto& tool : tools) {
    auto r = run_command({bin_dir() + "/" + tool, "--version"});
    EXPECT_EQ(r.exit_code, 0) << tool << ": " << r.output;
    EXPECT_EQ(r.output, tool + " (fsdp-libtorch) " + FSDP_VERSION_STRING + ", checkpoint format " +
                            std::to_string(fsdp::kCheckpointFormatVersion) + "\n");
  }
}

}  // namespace

// The construction peaks, by hand: eager holds every parameter in fp32 on the host;
// sharded holds the shards (where the parameters live) plus the root and the largest
// other unit on the host.
TEST(EstimateRules, ConstructionPeaksEagerAndSharded) {
  EstimateInput in;
  in.unit_params = {10, 100, 100, 50};  // root, then three units
  in.world_size = 4;
  auto est = estimate_memory(in);
  ASSERT_EQ(est.construction.size(), 2u);
  EXPECT_EQ(est.construction[0].key, "construction_eager");
  EXPECT_EQ(est.construction[0].host_bytes, 260 * 4);
  EXPECT_EQ(est.construction[0].device_bytes, 0);
  EXPECT_EQ(est.construction[1].key, "construction_sharded");
  EXPECT_EQ(est.construction[1].device_bytes, 66 * 4);  // shards 3 + 25 + 25 + 13
  EXPECT_EQ(est.construction[1].host_bytes, (10 + 100) * 4);
  in.cpu_offload = true;
  est = estimate_memory(in);
  EXPECT_EQ(est.construction[1].device_bytes, 0);
  EXPECT_EQ(est.construction[1].host_bytes, (66 + 10 + 100) * 4);
  // The totals are training's terms alone, not construction's.
  int64_t host = 0;
  for (const auto& t : est.terms) host += t.host_bytes;
  EXPECT_EQ(est.host_total(), host);
}

// hpZ's slices (reshard_after_forward_group_size = 2 at world 4): the estimate's term is
// the engine's counter at its peak, between a training forward and its backward, in
// fp32 and bf16; bad group sizes are named with the fix.
TEST(EstimateStrategies, PostForwardSlicesMatchTheCounterAtWorld4) {
  run_ranks(4, [](const ProcessGroup& pg) {
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(precision);
      Scenario run{"full", precision};
      ShardingOptions o = options_for(run, pg);
      o.reshard_after_forward_group_size = 2;
      const auto cfg = test_gpt();
      torch::manual_seed(0);
      auto model = fully_shard(gpt::GPT(cfg), o);
      EstimateInput in = input_for(run, cfg, pg.size());
      in.reshard_after_forward_group_size = 2;
      const auto est = estimate_memory(in);
      gpt::loss_on(model, my_rows(gpt_batch(0, 2 * pg.size(), cfg.block_size), pg)).backward();
      const int64_t peak = model.memory_stats().post_forward_params.peak;
      EXPECT_GT(peak, 0);
      EXPECT_EQ(est.term("post_forward_slices").device_bytes, peak);
    }
  });
  EstimateInput in;
  in.unit_params = {10, 100, 100};
  in.world_size = 4;
  in.reshard_after_forward_group_size = 3;
  try {
    estimate_memory(in);
    FAIL() << "k=3 at a shard group of 4 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--reshard-after-forward-group-size 3 must divide the "
                                         "shard group size 4"),
              std::string::npos)
        << e.what();
  }
  // Off: no such term.
  in.reshard_after_forward_group_size = 0;
  EXPECT_THROW(estimate_memory(in).term("post_forward_slices"), std::invalid_argument);
}
