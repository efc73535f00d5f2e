// fsdp-estimate against the engine's own counters: the model-state terms must equal
// the bytes the engine and the optimizer hold after a training step, exactly.
#include <fsdp/estimate.h>
#include <fsdp/fused_adamw.h>

#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

using namespace fsdp;
using namespace fsdp::testing;

namespace {

void compare(const ProcessGroup& pg, const std::string& precision) {
  const auto cfg = small_gpt_config();
  ShardingOptions o;
  o.process_group = pg;
  if (precision == "bf16") {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), o);
  FusedAdamW opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  model->reset_peak_memory();
  gpt::loss_on(model, my_rows(gpt_batch(0, 6, cfg.block_size), pg)).backward();
  opt.step();
  const auto mem = model->memory_stats();
  int64_t optim = 0;
  for (auto& kv : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*kv.second);
    optim += (st.exp_avg().numel() + st.exp_avg_sq().numel()) * 4;
  }

  EstimateInput in;
  in.unit_params = gpt_unit_params(cfg.n_layer, cfg.d_model, cfg.block_size, cfg.vocab_size);
  in.world_size = pg.size();
  in.precision = precision;
  const auto est = estimate_memory(in);
  int64_t n_params = 0;
  for (const auto& f : model->flat_params()) n_params += f.numel;
  EXPECT_EQ(est.total_params, n_params) << "the GPT parameter count";
  EXPECT_EQ(est.term("parameters (fp32 shards)").device_bytes, mem.sharded_params.current);
  EXPECT_EQ(est.term("gradients (fp32 shards)").device_bytes, mem.grad_shards.current);
  EXPECT_EQ(est.term("optimizer state (Adam m, v)").device_bytes, optim);
  EXPECT_EQ(est.term("gathered units (" + precision + ")").device_bytes, mem.gathered_params.peak);
}

class EstimateAtWorld : public ::testing::TestWithParam<int> {};
TEST_P(EstimateAtWorld, ModelStateTermsEqualTheMeasuredCountersFp32) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { compare(pg, "fp32"); });
}
TEST_P(EstimateAtWorld, ModelStateTermsEqualTheMeasuredCountersBf16) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { compare(pg, "bf16"); });
}
INSTANTIATE_TEST_SUITE_P(World, EstimateAtWorld, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(EstimateTool, PrintsTheTermsAndItsJsonMatchesTheLibrary) {
  const std::string tool = bin_dir() + "/fsdp-estimate";
  std::vector<std::string> shape = {"--n-layer", "24", "--n-head", "16", "--d-model", "2048", "--block-size", "1024",
                                    "--world-size", "8", "--precision", "bf16", "--cpu-offload",
                                    "--activation-checkpointing", "--micro-batch", "4"};
  std::vector<std::string> cmd = {tool};
  cmd.insert(cmd.end(), shape.begin(), shape.end());
  auto table = run_command(cmd);
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* want : {"parameters (fp32 shards)", "gradients (fp32 shards)", "optimizer state (Adam m, v)",
                           "gathered units (bf16)", "activations (checkpointed)", "offload transit buffers", "total"}) {
    EXPECT_NE(table.output.find(want), std::string::npos) << want << " missing:\n" << table.output;
  }
  cmd.push_back("--json");
  auto js = run_command(cmd);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  auto j = nlohmann::json::parse(js.output);
  EstimateInput in;
  in.unit_params = gpt_unit_params(24, 2048, 1024);
  in.world_size = 8;
  in.precision = "bf16";
  in.cpu_offload = true;
  in.activation_checkpointing = true;
  in.n_layer = 24;
  in.n_head = 16;
  in.d_model = 2048;
  in.block_size = 1024;
  in.micro_batch = 4;
  const auto est = estimate_memory(in);
  EXPECT_EQ(j.at("device_total_bytes").get<int64_t>(), est.device_total());
  EXPECT_EQ(j.at("host_total_bytes").get<int64_t>(), est.host_total());
  // Offload puts the 16 bytes per sharded parameter on the host.
  int64_t shard_elems = 0;
  for (int64_t n : in.unit_params) shard_elems += (n + 7) / 8;
  EXPECT_EQ(est.term("parameters (fp32 shards)").host_bytes, 4 * shard_elems);
  EXPECT_EQ(est.host_total(), 16 * shard_elems);
  EXPECT_EQ(est.term("parameters (fp32 shards)").device_bytes, 0);
}

struct Bad {
  std::vector<std::string> args;
  std::string message;
};
class EstimateBadInput : public ::testing::TestWithParam<Bad> {};
TEST_P(EstimateBadInput, ExitsTwoWithTheMessage) {
  std::vector<std::string> cmd = {bin_dir() + "/fsdp-estimate"};
  cmd.insert(cmd.end(), GetParam().args.begin(), GetParam().args.end());
  auto r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(GetParam().message), std::string::npos) << r.output;
}
INSTANTIATE_TEST_SUITE_P(
    Cases, EstimateBadInput,
    ::testing::Values(
        Bad{{}, "fsdp-estimate: error: give a GPT shape (--n-layer --n-head --d-model --block-size) or --params N"},
        Bad{{"--params", "1e9", "--strategy", "zero3"}, "strategy 'zero3' is unknown; use full, grad_op, none or hybrid"},
        Bad{{"--params", "1e9", "--precision", "fp8"}, "precision 'fp8' is unknown; use fp32, bf16 or fp16"},
        Bad{{"--params", "1e9", "--world-size", "0"}, "world size 0 must be at least 1"},
        Bad{{"--params", "1e9", "--world-size", "6", "--strategy", "hybrid", "--hybrid-group-size", "4"},
            "hybrid group size 4 must divide the world size 6"},
        Bad{{"--n-layer", "2", "--n-head", "3", "--d-model", "64", "--block-size", "8"},
            "--d-model 64 must be divisible by --n-head 3"},
        Bad{{"--n-layer", "2", "--n-head", "2", "--d-model", "64", "--block-size", "8", "--params", "5"},
            "give either a GPT shape or --params, not both"},
        Bad{{"--params", "abc"}, "fsdp-estimate: error: "}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

}  // namespace
