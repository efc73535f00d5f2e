// Checkpoints of pipelined models (Note [Pipelined checkpoints] in
// checkpoint/sharded/sharded_save.cpp): one checkpoint of every stage, resumed at another layout
// (other stages, FULL_SHARD inside them, or no pipeline at all) and the reverse, with the losses of
// the same model trained without interruption in one process; the files' layout as fsdp-inspect
// verifies it; and PipelineOptions::parameter_names.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>
#include <fsdp/pipeline.h>

#include "../examples/gpt/gpt_model.h"
#include "../examples/llama/llama_model.h"

#include "support/checkpoint_helpers.h"
#include "support/multirank.h"
#include "support/pipeline_layers.h"

#include "../src/internal/sharded_model.h"  // shard_group_all_reduce

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_pipeline_cases {

namespace {

constexpr int64_t kRows = 16, kSteps = 4;

const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(1e-2).eps(1e-6);

// The losses of kSteps steps of the model trained whole in this process.
std::vector<double> reference_losses() {
  torch::manual_seed(0);
  auto model = pipeline_layers();
  torch::optim::AdamW opt(model->parameters(), kAdamW);
  std::vector<double> out;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = pipeline_batch(step, kRows);
    auto loss = pipeline_mse(model->forward(x), y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    out.push_back(loss.item<double>());
  }
  return out;
}

// Steps [first, last) of the schedule at `stages` stages (0: no pipeline, FULL_SHARD over
// the world), from the checkpoint under `dir` when first > 0; saves after `last` when
// `save`. Each step's loss (the whole batch's) must equal the reference's.
void train_span(const ProcessGroup& pg, int stages, int64_t first, int64_t last,
                const std::string& dir, bool save, bool async = false) {
  const std::vector<double> ref = reference_losses();
  torch::manual_seed(first == 0 ? 0 : 123);  // a resumed run starts from other weights
  ShardingOptions sharding;
  sharding.process_group = pg;
  std::optional<PipelinedModel> pm;
  std::optional<Sharded<torch::nn::Sequential>> whole;
  if (stages > 0) {
    PipelineOptions o;
    o.stages = stages;
    o.micro_batches = 4;
    o.sharding = sharding;
    pm = pipeline(pipeline_layers(), o);
  } else {
    whole = shard_sequential(pipeline_layers(), sharding);
  }
  torch::optim::AdamW opt(pm ? pm->sharded_parameters() : whole->sharded_parameters(), kAdamW);
  if (first > 0) {
    ckpt::TrainingState st;
    const ckpt::LoadReport r = pm ? ckpt::load_sharded_checkpoint(dir, *pm, &opt, &st)
                                  : ckpt::load_sharded_checkpoint(dir, *whole, &opt, &st);
    EXPECT_EQ(st.step, first);
    EXPECT_TRUE(r.missing.empty());
  }
  const int dp = pm ? pm->data_parallel_size() : pg.size();
  const int dp_rank = pm ? pm->data_parallel_rank() : pg.rank();
  const int64_t per = kRows / dp;
  for (int64_t step = first; step < last; ++step) {
    auto [x, y] = pipeline_batch(step, kRows);
    auto mx = x.narrow(0, dp_rank * per, per), my = y.narrow(0, dp_rank * per, per);
    double loss = 0;
    if (pm) {
      loss = pm->train_step(mx, my, pipeline_mse).item<double>();
    } else {
      auto l = pipeline_mse((*whole)->forward(mx), my);
      l.backward();
      // The whole batch's loss: the replicas' equal parts averaged.
      auto all = l.detach().reshape({1});
      fsdp::detail::shard_group_all_reduce(*whole, all, /*max=*/false);
      loss = all.item<double>() / dp;
    }
    opt.step();
    opt.zero_grad();
    const double want = ref[static_cast<size_t>(step)];
    EXPECT_LT(std::abs(loss - want) / std::abs(want), 1e-6)
        << "step " << step << " at " << stages << " stage(s): " << loss << ", whole " << want;
  }
  if (save) {
    ckpt::TrainingState st;
    st.step = last;
    if (pm && async) {
      ckpt::AsyncSave pending = ckpt::save_sharded_checkpoint_async(dir, *pm, &opt, st);
      // Training may go on: the background save holds a copy.
      auto [x, y] = pipeline_batch(99, kRows);
      pm->train_step(x.narrow(0, 0, kRows / pm->data_parallel_size()),
                     y.narrow(0, 0, kRows / pm->data_parallel_size()), pipeline_mse);
      opt.step();
      const std::string path = pending.path();
      EXPECT_EQ(pending.wait(), path);
    } else if (pm) {
      ckpt::save_sharded_checkpoint(dir, *pm, &opt, st);
    } else {
      ckpt::save_sharded_checkpoint(dir, *whole, &opt, st);
    }
  }
}

// Two steps at `from` (stages over `from_world` ranks), saved; two more at `to` from
// the checkpoint: the four losses are the whole model's.
void resume(int from_world, int from, int to_world, int to, bool async = false) {
  const std::string dir = scratch_dir("pipeline_resume");
  run_ranks(from_world,
            [&](const ProcessGroup& pg) { train_span(pg, from, 0, 2, dir, true, async); });
  run_ranks(to_world, [&](const ProcessGroup& pg) { train_span(pg, to, 2, kSteps, dir, false); });
}

}  // namespace

TEST(PipelineCheckpoint, TwoStagesTimesFullShardTwoResumeAtFourStages) { resume(4, 2, 4, 4); }
TEST(PipelineCheckpoint, FourStagesResumeAtTwoStagesTimesFullShardTwo) { resume(4, 4, 4, 2); }
TEST(PipelineCheckpoint, TwoStagesResumeWithoutAPipelineAtWorldFour) { resume(2, 2, 4, 0); }
TEST(PipelineCheckpoint, WithoutAPipelineResumesAtTwoStages) { resume(2, 0, 2, 2); }
// Saved in the background while the stages train on: the same checkpoint.
TEST(PipelineCheckpoint, TwoStagesTimesFullShardTwoSavedInTheBackgroundResumeAtFourStages) {
  resume(4, 2, 4, 4, /*async=*/true);
}

// The files: one per rank of the job, each stage's part laid out as a checkpoint of its
// own (fsdp-inspect --verify checks every file's slices), format_version 2.
TEST(PipelineCheckpoint, FilesAreOnePartPerStageThatInspectVerifies) {
  const std::string dir = scratch_dir("pipeline_files");
  run_ranks(4, [&](const ProcessGroup& pg) { train_span(pg, 2, 0, 1, dir, true); });
  const std::string report = ckpt::inspect_checkpoint(dir, /*verify=*/true);
  EXPECT_NE(report.find("format_version = 2"), std::string::npos) << report;
  EXPECT_NE(report.find("world_size = 4, shard_group_size = 2"), std::string::npos) << report;
  EXPECT_NE(report.find("pipeline_stages = 2: rank files of 2 ranks each"), std::string::npos)
      << report;
  EXPECT_NE(report.find("verified: 4 rank files complete"), std::string::npos) << report;
  // Every layer's parameters once: 6 Linear layers, weight and bias.
  for (const char* name : {"0.weight", "2.bias", "3.weight", "5.weight", "6.bias", "7.weight"})
    EXPECT_NE(report.find(std::string("      ") + name + " "), std::string::npos) << name;
}

// PipelineOptions::parameter_names: the stage's checkpoints and state dicts use the
// whole model's names; two parameters given one name is refused, naming both.
TEST(PipelineCheckpoint, ParameterNamesRenameTheStageAndRefuseCollisions) {
  PipelineOptions o;
  o.stages = 1;
  o.micro_batches = 1;
  o.parameter_names = [](const std::string& n) { return "net." + n; };
  PipelinedModel pm = pipeline(pipeline_layers(), o);
  std::vector<std::string> names;
  for (const auto& [name, t] : full_state_dict(pm.stage_model())) names.push_back(name);
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "net.0.weight");
  o.parameter_names = [](const std::string& n) { return n.substr(n.find('.') + 1); };
  EXPECT_EQ(error_of([&] { pipeline(pipeline_layers(), o); }),
            "renaming parameters: '0.weight' and '2.weight' would both be named 'weight'; give "
            "each parameter a name of its own");
}

// The reader refuses a pipelined checkpoint whose files disagree on the stages, naming
// the file and what it says.
TEST(PipelineCheckpoint, FilesThatDisagreeOnTheStagesAreRefused) {
  const std::string dir = scratch_dir("pipeline_bad");
  run_ranks(2, [&](const ProcessGroup& pg) { train_span(pg, 2, 0, 1, dir, true); });
  const std::string ckpt = *ckpt::latest_checkpoint(dir);
  auto set = [&](int rank, const char* attr, int64_t v) {
    const std::string p = ckpt + "/rank_0000" + std::to_string(rank) + ".h5";
    hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0) << p;
    hid_t a = H5Aopen(f, attr, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Fclose(f);
  };
  auto error = [&] { return error_of([&] { ckpt::inspect_checkpoint(ckpt, false); }); };
  const std::string f0 = ckpt + "/rank_00000.h5", f1 = ckpt + "/rank_00001.h5";
  set(0, "pipeline_stages", 3);
  EXPECT_EQ(error(), f0 + ": pipeline_stages 3 does not divide world_size 2");
  set(0, "pipeline_stages", 2);
  set(1, "pipeline_stage", 0);
  EXPECT_EQ(error(), f1 + " says it holds pipeline stage 0 but sits where stage 1 begins");
  set(1, "pipeline_stage", 1);
  set(1, "shard_group_size", 2);
  EXPECT_EQ(error(), f1 + ": shard_group_size 2 does not fit a pipeline stage of 1 ranks");
}

// The examples' maps from their pipeline layers' names to the models' own, and the
// error for a name that is not one of those layers'.
TEST(PipelineCheckpoint, TheExamplesMapLayerNamesToTheirModelsNames) {
  EXPECT_EQ(gpt::layer_param_name("embed.wte.weight"), "wte.weight");
  EXPECT_EQ(gpt::layer_param_name("block12.attn.qkv.bias"), "blocks.12.attn.qkv.bias");
  EXPECT_EQ(gpt::layer_param_name("head.lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(error_of([] { gpt::layer_param_name("blocks.1.ln1.weight"); }),
            "gpt::layer_param_name: 'blocks.1.ln1.weight' is not a parameter of as_layers' "
            "layers");
  EXPECT_EQ(llama::layer_param_name("embed_tokens.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(llama::layer_param_name("layer3.mlp.up_proj.weight"),
            "model.layers.3.mlp.up_proj.weight");
  EXPECT_EQ(llama::layer_param_name("head.norm.weight"), "model.norm.weight");
  EXPECT_EQ(llama::layer_param_name("head.lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(error_of([] { llama::layer_param_name("layer.x"); }),
            "llama::layer_param_name: 'layer.x' is not a parameter of as_layers' layers");
}

namespace {

// The pipeline layers at seed `seed`, in two stages over `pg` and whole (FULL_SHARD over
// `pg`): the same weights.
struct BothWays {
  PipelinedModel pm;
  Sharded<torch::nn::Sequential> whole;
  BothWays(const ProcessGroup& pg, uint64_t seed, int stages = 2)
      : pm([&] {
          PipelineOptions o;
          o.stages = stages;
          o.sharding.process_group = pg;
          torch::manual_seed(seed);
          return pipeline(pipeline_layers(), o);
        }()),
        whole([&] {
          ShardingOptions so;
          so.process_group = pg;
          torch::manual_seed(seed);
          return shard_sequential(pipeline_layers(), so);
        }()) {}
};

// Every file under `dir`, by name, with its bytes.
std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out[e.path().filename().string()] = file_bytes_of(e.path().string());
  return out;
}

}  // namespace

// Note [Pipelined exports]: a pipelined model's safetensors export is, byte for byte, the
// unpipelined model's, under another framework's layout too (names, one left out, one
// transposed, bf16, several files); its consolidated file holds the same weights; and
// the temporary checkpoint is gone.
TEST(PipelineCheckpoint, ExportsWriteWhatTheModelWritesUnpipelined) {
  const std::string dir = scratch_dir("pipeline_export");
  run_ranks(2, [&](const ProcessGroup& pg) {
    BothWays m(pg, 7);
    ckpt::TrainingState st;
    st.step = 3;
    st.model_attrs["hf_config"] = std::string("{\"model_type\": \"test\"}\n");
    ckpt::SafetensorsOptions o;
    o.dtype = torch::kBFloat16;
    o.max_shard_size = 1500;  // several files and an index
    o.name_for = [](const std::string& n) { return n == "3.bias" ? "" : "net." + n; };
    o.transpose = [](const std::string& n) { return n == "5.weight"; };
    ckpt::export_safetensors(dir + "/whole", m.whole, st, o);
    ckpt::export_safetensors(dir + "/stages/", m.pm, st, o);
    ckpt::export_consolidated(dir + "/whole.h5", m.whole, nullptr, st);
    ckpt::export_consolidated(dir + "/stages.h5", m.pm, nullptr, st);
    // A layout that transposes a 1-D tensor fails on every rank, naming it, and leaves no
    // temporary checkpoint behind.
    o.transpose = [](const std::string& n) { return n == "0.bias"; };
    EXPECT_NE(error_of([&] { ckpt::export_safetensors(dir + "/bad", m.pm, st, o); })
                  .find("export_safetensors to " + dir + "/bad failed" +
                        (pg.rank() == 0 ? ": consolidate_checkpoint: the layout transposes "
                                          "'0.bias', which has 1 dimensions; only 2-D tensors "
                                          "transpose"
                                        : " on rank 0 (see its error)")),
              std::string::npos);
  });
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad.stages.tmp"));
  const auto whole = files_of(dir + "/whole"), stages = files_of(dir + "/stages");
  EXPECT_GT(whole.size(), 3u);  // shards, the index and config.json
  ASSERT_EQ(whole.size(), stages.size());
  for (const auto& [name, bytes] : whole) {
    ASSERT_TRUE(stages.count(name)) << name;
    EXPECT_TRUE(stages.at(name) == bytes) << name << " differs";
  }
  EXPECT_EQ(whole.count("config.json"), 1u);
  auto a = pipeline_layers(), b = pipeline_layers();
  ckpt::load_consolidated(dir + "/whole.h5", *a);
  ckpt::load_consolidated(dir + "/stages.h5", *b);
  torch::manual_seed(7);
  auto seeded = pipeline_layers();
  for (const auto& p : seeded->named_parameters()) {
    EXPECT_TRUE(torch::equal(a->named_parameters()[p.key()], p.value())) << p.key();
    EXPECT_TRUE(torch::equal(b->named_parameters()[p.key()], p.value())) << p.key();
  }
  for (const char* tmp : {"/stages.stages.tmp", "/stages.h5.stages.tmp"})
    EXPECT_FALSE(std::filesystem::exists(dir + tmp)) << tmp;
}

// import_consolidated into stages: each stage takes its own names from a file of the
// whole model; a name no stage takes, or one a stage lacks, fails every rank alike.
TEST(PipelineCheckpoint, ImportConsolidatedFillsEachStageAndRefusesNamesNoStageTakes) {
  const std::string dir = scratch_dir("pipeline_import");
  const std::string file = dir + "/w.h5", more = dir + "/more.h5", less = dir + "/less.h5";
  run_ranks(2, [&](const ProcessGroup& pg) {
    ckpt::TrainingState st;
    ShardingOptions so;
    so.process_group = pg;
    torch::manual_seed(5);
    ckpt::export_consolidated(file, shard_sequential(pipeline_layers(), so), nullptr, st);
    auto longer = pipeline_layers();
    longer->push_back(torch::nn::Linear(kPipeOut, kPipeOut));
    ckpt::export_consolidated(more, shard_sequential(longer, so), nullptr, st);
    auto all = pipeline_layers();  // without its last layer
    torch::nn::Sequential shorter;
    for (size_t i = 0; i + 1 < all->size(); ++i)
      shorter->push_back(std::to_string(i), *(all->begin() + static_cast<int64_t>(i)));
    ckpt::export_consolidated(less, shard_sequential(shorter, so), nullptr, st);

    BothWays m(pg, 11, 2);
    const ckpt::LoadReport r = ckpt::import_consolidated(file, m.pm);
    EXPECT_TRUE(r.missing.empty());
    EXPECT_TRUE(r.unexpected.empty());
    torch::manual_seed(5);
    auto want = pipeline_layers()->named_parameters();
    int64_t n = 0;
    for (const auto& [name, full] : full_state_dict(m.pm.stage_model())) {
      EXPECT_TRUE(torch::equal(full, want[name])) << name;
      ++n;
    }
    EXPECT_GT(n, 0);
    const std::string extra = error_of([&] { ckpt::import_consolidated(more, m.pm); });
    EXPECT_NE(extra.find("checkpoint " + more +
                         " does not match this model. Not in the model: 8.bias, 8.weight (2)."),
              std::string::npos)
        << extra;
    ckpt::LoadOptions lenient;
    lenient.strict = false;
    EXPECT_EQ(ckpt::import_consolidated(more, m.pm, lenient).unexpected,
              (std::vector<std::string>{"8.bias", "8.weight"}));
    const std::string lacking = error_of([&] { ckpt::import_consolidated(less, m.pm); });
    EXPECT_NE(
        lacking.find("import_consolidated of " + less + " into a pipeline of 2 stages failed"),
        std::string::npos)
        << lacking;
    if (m.pm.stage() == 1)
      EXPECT_NE(lacking.find("7.bias"), std::string::npos) << lacking;
    else
      EXPECT_NE(lacking.find("on another rank (see its error)"), std::string::npos) << lacking;
  });
}

// The examples' layer factories make, layer by layer, the weights of the whole model
// built from the same seed (so a pipelined train_gpt or train_llama starts where the
// unpipelined one does), under the names the checkpoints use.
TEST(PipelineCheckpoint, TheExamplesLayerFactoriesMakeTheWholeModelsWeights) {
  auto check = [](const fsdp::PipelineLayers& layers, const torch::nn::Module& whole,
                  const std::function<std::string(const std::string&)>& rename) {
    torch::manual_seed(3);
    std::map<std::string, torch::Tensor> got;
    for (int64_t i = 0; i < layers.count; ++i) {
      auto [name, module] = layers.make(i);
      for (const auto& p : module.ptr()->named_parameters())
        got[rename(name + "." + p.key())] = p.value();
    }
    const auto want = named_parameters_clean(whole);
    EXPECT_EQ(got.size(), want.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_TRUE(torch::equal(got[name], t)) << name;
    }
  };
  lm::Config c;
  c.n_layer = 3;
  c.d_model = 32;
  c.n_head = 2;
  c.block_size = 16;
  c.n_kv_head = 1;  // llama's fields
  c.intermediate_size = 64;
  torch::manual_seed(3);
  gpt::GPT g(c);
  check(gpt::layer_factory(c), *g, gpt::layer_param_name);
  const llama::Config lc = llama::from_lm(c);
  torch::manual_seed(3);
  llama::Llama l(lc);
  check(llama::layer_factory(lc), *l, llama::layer_param_name);
}

}  // namespace test_checkpoint_pipeline_cases
