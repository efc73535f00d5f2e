// HDF5 checkpoints: exact resume, resharding across world sizes and wrap policies,
// consolidated export/import, offline consolidation, crash safety and bad input.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>

#include "support/models.h"
#include "support/multirank.h"

#include "../checkpoint/crc32c.h"
#include "../checkpoint/publish.h"
#include "../checkpoint/safetensors.h"

#include <hdf5.h>

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

namespace {

constexpr int64_t kRows = 12;  // divisible by 1, 2, 3 and 4 ranks

// A scratch directory shared by the test process and the rank processes it starts
// (they inherit the environment variable that names it).
std::string scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string var =
      "FSDP_CKPT_TEST_DIR_" + tag + "_" + info->test_suite_name() + "_" + info->name();
  for (char& c : var) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  if (const char* d = std::getenv(var.c_str())) return d;
  std::string tmpl = "/tmp/fsdp_ckpt_" + tag + "_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  if (d == nullptr) throw std::runtime_error("mkdtemp failed");
  setenv(var.c_str(), d, 1);
  return d;
}

ShardingOptions options_for(const ProcessGroup& pg, WrapPolicy policy = always_wrap_policy()) {
  ShardingOptions o;
  o.process_group = pg;
  o.auto_wrap_policy = std::move(policy);
  return o;
}

torch::optim::AdamW make_adamw(const ShardedModel& model) {
  return torch::optim::AdamW(model.sharded_parameters(),
                             torch::optim::AdamWOptions(3e-3).weight_decay(0.01).eps(1e-6));
}

template <class Model>
double train_step(Model& model, torch::optim::Optimizer& opt, int64_t step,
                  const ProcessGroup& pg) {
  auto batch = gpt_batch(step, kRows, small_gpt_config().block_size);
  opt.zero_grad();
  auto loss = gpt::loss_on(model, my_rows(batch, pg));
  loss.backward();
  opt.step();
  return global_mean(loss, pg);
}

std::map<std::string, torch::Tensor> as_map(
    const std::vector<std::pair<std::string, torch::Tensor>>& v) {
  return std::map<std::string, torch::Tensor>(v.begin(), v.end());
}

void write_losses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream out(path);
  out.precision(17);
  for (double l : losses) out << l << "\n";
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> v;
  for (double l; in >> l;) v.push_back(l);
  return v;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

// A file's whole contents.
std::string file_bytes_of(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TrainingState sample_state(int64_t step) {
  TrainingState st;
  st.step = step;
  st.scheduler = {{"last_step", static_cast<double>(step)}, {"warmup", 10.0}};
  st.extra = {{"data_position", std::to_string(step * kRows)}, {"note", "resume me"}};
  LossScalerState ls;
  ls.scale = 1024;
  ls.iteration = step;
  ls.last_overflow_iteration = 1;
  ls.hysteresis_left = 1;
  ls.skipped_steps = 2;
  st.loss_scaler = ls;
  auto c = small_gpt_config();
  st.model_attrs = {{"n_layer", c.n_layer},
                    {"n_head", c.n_head},
                    {"d_model", c.d_model},
                    {"block_size", c.block_size},
                    {"vocab_size", c.vocab_size}};
  return st;
}

// ---------------------------------------------------------------------------------
// The block checksum: table-driven and SSE4.2 versions agree; the CRC32C primitive
// gives the standard check value.

TEST(BlockChecksum, HardwareAndTableVersionsAgreeAndCrc32cIsStandard) {
  uint32_t c = 0xFFFFFFFFu;
  for (char ch : std::string("123456789")) c = h5::crc_detail::sw_u8(c, static_cast<uint8_t>(ch));
  EXPECT_EQ(c ^ 0xFFFFFFFFu, 0xE3069283u);
  std::mt19937 rng(1);
  std::vector<uint8_t> data(100003);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{4096}, data.size()}) {
    const uint32_t sw =
        h5::crc_detail::lanes(data.data(), n, h5::crc_detail::sw_u64, h5::crc_detail::sw_u8);
    EXPECT_EQ(h5::crc_block(data.data(), n), sw) << n << " bytes";
  }
  const uint32_t before = h5::crc_block(data.data(), data.size());
  data[5000] ^= 1;
  EXPECT_NE(h5::crc_block(data.data(), data.size()), before) << "a flipped bit went unnoticed";
}

// ---------------------------------------------------------------------------------
// Exact resume: the loss trajectory after loading equals the uninterrupted one, bit for bit.

void exact_resume(const ProcessGroup& pg, const std::string& dir) {
  const auto cfg = small_gpt_config();
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  torch::manual_seed(42 + pg.rank());  // a per-rank RNG stream to restore
  const std::string path = save_sharded_checkpoint(dir, model, &opt, sample_state(3));
  EXPECT_EQ(fs::path(path).filename().string(), "step_00000003");
  const auto rng_after_save = torch::rand({4});
  std::vector<double> uninterrupted;
  for (int64_t s = 3; s < 6; ++s) uninterrupted.push_back(train_step(model, opt, s, pg));

  // A fresh model, differently initialised, with another learning rate: the load
  // must restore all of it.
  torch::manual_seed(7);
  auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
  torch::optim::AdamW opt2(model2.sharded_parameters(), torch::optim::AdamWOptions(1.0).eps(1e-6));
  TrainingState st;
  torch::manual_seed(999);
  auto report = load_sharded_checkpoint(dir, model2, &opt2, &st);
  EXPECT_EQ(report.path, path);
  EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save))
      << "the CPU RNG state was not restored";
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.scheduler, sample_state(3).scheduler);
  EXPECT_EQ(st.extra, sample_state(3).extra);
  ASSERT_TRUE(st.loss_scaler.has_value());
  EXPECT_EQ(st.loss_scaler->scale, 1024);
  EXPECT_EQ(st.loss_scaler->skipped_steps, 2);
  EXPECT_EQ(st.loss_scaler->hysteresis_left, 1);
  EXPECT_EQ(std::get<int64_t>(st.model_attrs.at("d_model")), cfg.d_model);
  EXPECT_EQ(static_cast<torch::optim::AdamWOptions&>(opt2.param_groups()[0].options()).lr(), 3e-3);
  for (int64_t s = 3; s < 6; ++s) {
    const double l = train_step(model2, opt2, s, pg);
    EXPECT_EQ(l, uninterrupted[static_cast<size_t>(s - 3)])
        << "step " << s << " differs after resume";
  }
}

TEST(ShardedCheckpoint, ExactResumeIsBitwiseAtTwoRanks) {
  const std::string dir = scratch_dir("resume");
  run_ranks(2, [&](const ProcessGroup& pg) { exact_resume(pg, dir); });
}
TEST(ShardedCheckpoint, ExactResumeIsBitwiseAtOneRank) {
  const std::string dir = scratch_dir("resume");
  run_ranks(1, [&](const ProcessGroup& pg) { exact_resume(pg, dir); });
}

// ---------------------------------------------------------------------------------
// Resharding: saved at 4 ranks, loaded at 1, 2 and 3, and under another wrap policy.

void save_at_four(const ProcessGroup& pg, const std::string& dir, const ShardingOptions& o) {
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  save_sharded_checkpoint(dir + "/sharded", model, &opt, sample_state(3));
  export_consolidated(dir + "/full.h5", model, nullptr, sample_state(3));
  std::vector<double> cont;
  for (int64_t s = 3; s < 6; ++s) cont.push_back(train_step(model, opt, s, pg));
  if (pg.rank() == 0) write_losses(dir + "/losses.txt", cont);
}

void load_and_continue(const ProcessGroup& pg, const std::string& dir, const ShardingOptions& o) {
  torch::manual_seed(5);
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  auto opt = make_adamw(model);
  TrainingState st;
  load_sharded_checkpoint(dir + "/sharded", model, &opt, &st);
  EXPECT_EQ(st.step, 3);
  // The parameters are exactly the saved ones (the consolidated export of the same moment).
  torch::manual_seed(6);
  gpt::GPT plain(small_gpt_config());
  load_consolidated(dir + "/full.h5", *plain);
  auto loaded = full_state_dict(model);
  for (const auto& [name, p] : named_parameters_clean(*plain)) {
    EXPECT_TRUE(torch::equal(as_map(loaded).at(name), p)) << name;
  }
  const auto expected = read_losses(dir + "/losses.txt");
  ASSERT_EQ(expected.size(), 3u);
  for (int64_t s = 3; s < 6; ++s) {
    const double l = train_step(model, opt, s, pg), want = expected[static_cast<size_t>(s - 3)];
    EXPECT_LE(std::abs(l - want) / std::abs(want), 1e-6)
        << "step " << s << ": " << l << " vs " << want;
  }
}

TEST(ShardedCheckpoint, SavedAtFourRanksLoadsAtOneTwoAndThree) {
  const std::string dir = scratch_dir("reshard");
  run_ranks(4, [&](const ProcessGroup& pg) { save_at_four(pg, dir, options_for(pg)); });
  for (int m : {1, 2, 3}) {
    SCOPED_TRACE("load at " + std::to_string(m) + " ranks");
    run_ranks(m, [&](const ProcessGroup& pg) { load_and_continue(pg, dir, options_for(pg)); });
  }
}

TEST(ShardedCheckpoint, LoadsUnderAnotherWrapPolicyAndStrategy) {
  const std::string dir = scratch_dir("policy");
  // Saved with every block its own unit, as HYBRID_SHARD (2 groups of 2: replicas write nothing).
  run_ranks(4, [&](const ProcessGroup& pg) {
    auto o = options_for(pg);
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_group_size = 2;
    save_at_four(pg, dir, o);
  });
  // Loaded with one unit for the whole model (other flat layout), and with blocks but
  // only every second one a unit, at other world sizes.
  run_ranks(3, [&](const ProcessGroup& pg) {
    load_and_continue(pg, dir, options_for(pg, never_wrap_policy()));
  });
  run_ranks(2, [&](const ProcessGroup& pg) {
    load_and_continue(pg, dir, options_for(pg, every_kth_policy(2)));
  });
}

TEST(ShardedCheckpoint, SgdMomentumStateReshardsFromTwoRanksToThree) {
  const std::string dir = scratch_dir("sgd");
  auto make_sgd = [](const ShardedModel& m) {
    return torch::optim::SGD(m.sharded_parameters(),
                             torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
  };
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt = make_sgd(model);
    for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
    save_sharded_checkpoint(dir, model, &opt, sample_state(3));
    std::vector<double> cont;
    for (int64_t s = 3; s < 6; ++s) cont.push_back(train_step(model, opt, s, pg));
    if (pg.rank() == 0) write_losses(dir + "/losses.txt", cont);
  });
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(9);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(1.0));
    load_sharded_checkpoint(dir, model, &opt, nullptr);
    const auto& o = static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options());
    EXPECT_EQ(o.momentum(), 0.9);
    EXPECT_EQ(o.lr(), 0.05);
    const auto want = read_losses(dir + "/losses.txt");
    ASSERT_EQ(want.size(), 3u);
    for (int64_t s = 3; s < 6; ++s) {
      const double l = train_step(model, opt, s, pg);
      EXPECT_LE(std::abs(l - want[static_cast<size_t>(s - 3)]) / want[static_cast<size_t>(s - 3)],
                1e-6)
          << "step " << s;
    }
    // An Adam optimizer cannot take SGD state.
    auto adam = make_adamw(model);
    const std::string msg = error_of([&] { load_sharded_checkpoint(dir, model, &adam, nullptr); });
    EXPECT_NE(msg.find("holds sgd state but the optimizer is adamw"), std::string::npos) << msg;
  });
}

// ---------------------------------------------------------------------------------
// Consolidated export and import.

TEST(ConsolidatedCheckpoint, ExportImportRoundTripAndRankZeroMemoryBound) {
  const std::string dir = scratch_dir("consolidated");
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt = make_adamw(model);
    for (int64_t s = 0; s < 2; ++s) train_step(model, opt, s, pg);
    model.reset_peak_memory();
    ASSERT_EQ(model.memory_stats().checkpoint_buffers.current, 0);
    ExportOptions eo;
    eo.with_optimizer = true;
    export_consolidated(dir + "/full.h5", model, &opt, sample_state(2), eo);
    const auto mem = model.memory_stats();
    // One flat parameter gathered at a time: the peak is the largest one, and all is freed.
    int64_t largest = 0;
    for (const auto& f : fsdp::detail::flat_params(model))
      largest = std::max(largest, f.padded_numel * 4);
    EXPECT_EQ(mem.checkpoint_buffers.peak, largest);
    EXPECT_EQ(mem.checkpoint_buffers.current, 0);
    eo.with_optimizer = false;
    eo.dtype = torch::kBFloat16;
    export_consolidated(dir + "/full_bf16.h5", model, nullptr, sample_state(2), eo);
    auto full = full_state_dict(model);
    if (pg.rank() == 0) {
      gpt::GPT plain(small_gpt_config());
      auto r = load_consolidated(dir + "/full.h5", *plain);
      EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
      for (const auto& [name, p] : named_parameters_clean(*plain)) {
        EXPECT_TRUE(torch::equal(as_map(full).at(name), p)) << name;
      }
      gpt::GPT plain16(small_gpt_config());
      load_consolidated(dir + "/full_bf16.h5", *plain16);
      for (const auto& [name, p] : named_parameters_clean(*plain16)) {
        EXPECT_TRUE(torch::equal(as_map(full).at(name).to(torch::kBFloat16).to(torch::kFloat32), p))
            << name << ": bf16 export differs from torch's rounding";
      }
      auto attrs = consolidated_attributes(dir + "/full_bf16.h5");
      EXPECT_EQ(std::get<std::string>(attrs.at("format")), "fsdp.consolidated");
      EXPECT_EQ(std::get<std::string>(attrs.at("dtype")), "bfloat16");
      EXPECT_EQ(std::get<int64_t>(attrs.at("step")), 2);
      EXPECT_EQ(std::get<int64_t>(attrs.at("n_layer")), small_gpt_config().n_layer);
    }
  });
  // Import into a sharded model at another world size: the same values.
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(11);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg, every_kth_policy(2)));
    const int64_t before = model.comm_stats().total.total_bytes();  // fully_shard's broadcast
    auto r = import_consolidated(dir + "/full.h5", model);
    EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
    EXPECT_EQ(model.comm_stats().total.total_bytes(), before) << "import must not communicate";
    auto full = as_map(full_state_dict(model));
    gpt::GPT plain(small_gpt_config());
    load_consolidated(dir + "/full.h5", *plain);
    for (const auto& [name, p] : named_parameters_clean(*plain)) {
      EXPECT_TRUE(torch::equal(full.at(name), p)) << name;
    }
  });
}

// A consolidated file from another writer (h5py, say) carries no block checksums: it
// loads the same, 16-bit floats converted as torch rounds, and inspect says what it
// could not check.
TEST(ConsolidatedCheckpoint, AFileWithoutChecksumsLoadsAndInspectSaysSo) {
  const std::string dir = scratch_dir("no_checksums");
  torch::manual_seed(5);
  gpt::GPT source(small_gpt_config());
  auto model = fully_shard(source);
  ExportOptions eo;
  eo.dtype = torch::kBFloat16;
  export_consolidated(dir + "/bf16.h5", model, nullptr, sample_state(1), eo);
  auto full = as_map(full_state_dict(model));
  // Strip every dataset's checksum attributes.
  const std::string p = dir + "/bf16.h5";
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  int stripped = 0;
  for (const auto& [name, t] : full) {
    hid_t ds = H5Dopen2(f, ("model/" + name).c_str(), H5P_DEFAULT);
    ASSERT_GE(ds, 0) << name;
    ASSERT_GE(H5Adelete(ds, "fsdp_crc32c"), 0) << name;
    ASSERT_GE(H5Adelete(ds, "fsdp_crc_block"), 0) << name;
    H5Dclose(ds);
    ++stripped;
  }
  H5Fclose(f);
  gpt::GPT plain(small_gpt_config());
  load_consolidated(p, *plain);
  for (const auto& [name, t] : named_parameters_clean(*plain)) {
    EXPECT_TRUE(torch::equal(full.at(name).to(torch::kBFloat16).to(torch::kFloat32), t)) << name;
  }
  auto r = run_command({bin_dir() + "/fsdp-inspect", p});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified: every dataset read back; " + std::to_string(stripped) +
                          " datasets carry no checksums (written by another tool)"),
            std::string::npos)
      << r.output;
}

TEST(ConsolidatedCheckpoint, StrictLoadListsEveryMismatchAndNonStrictReportsThem) {
  const std::string dir = scratch_dir("strict");
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(small_gpt_config()));
  export_consolidated(dir + "/gpt.h5", model, nullptr, sample_state(0));
  // An MLP has none of the GPT's names.
  MlpNet mlp;
  const std::string msg = error_of([&] { load_consolidated(dir + "/gpt.h5", *mlp); });
  EXPECT_NE(msg.find("does not match this model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("inp.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("out.bias"), std::string::npos) << msg;  // every name is listed
  EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lm_head.weight"), std::string::npos) << msg;
  LoadOptions lo;
  lo.strict = false;
  auto r = load_consolidated(dir + "/gpt.h5", *mlp, lo);
  EXPECT_EQ(r.missing.size(), named_parameters_clean(*mlp).size());
  EXPECT_EQ(r.unexpected.size(), named_parameters_clean(*model).size());
  // Same names, other shapes: always an error, naming the shapes.
  auto cfg = small_gpt_config();
  cfg.d_model = 64;
  gpt::GPT wide(cfg);
  const std::string shape_msg = error_of([&] { load_consolidated(dir + "/gpt.h5", *wide, lo); });
  EXPECT_NE(shape_msg.find("has shape [256, 32] in the file but [256, 64]"), std::string::npos)
      << shape_msg;
}

// ---------------------------------------------------------------------------------
// Offline consolidation equals the live export, byte for byte.

TEST(OfflineConsolidation, FsdpConsolidateOutputIsIdenticalToLiveExport) {
  const std::string dir = scratch_dir("offline");
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt = make_adamw(model);
    for (int64_t s = 0; s < 2; ++s) train_step(model, opt, s, pg);
    save_sharded_checkpoint(dir, model, &opt, sample_state(2));
    ExportOptions eo;
    export_consolidated(dir + "/live_fp32.h5", model, &opt, sample_state(2), eo);
    eo.with_optimizer = true;
    eo.dtype = torch::kFloat16;
    export_consolidated(dir + "/live_fp16_opt.h5", model, &opt, sample_state(2), eo);
  });
  const std::string tool = bin_dir() + "/fsdp-consolidate";
  auto a = run_command({tool, dir, dir + "/off_fp32.h5"});
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("parameters (100%)"), std::string::npos)
      << "no progress shown: " << a.output;
  auto b =
      run_command({tool, dir, dir + "/off_fp16_opt.h5", "--dtype", "fp16", "--with-optimizer"});
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(file_bytes_of(dir + "/off_fp32.h5"), file_bytes_of(dir + "/live_fp32.h5"));
  EXPECT_EQ(file_bytes_of(dir + "/off_fp16_opt.h5"), file_bytes_of(dir + "/live_fp16_opt.h5"));
  EXPECT_GT(file_bytes_of(dir + "/off_fp16_opt.h5").size(), 1000u);
  auto file = run_command({tool, dir + "/live_fp32.h5", dir + "/x.h5"});
  EXPECT_EQ(file.exit_code, 1);
  EXPECT_NE(file.output.find("is a file, but a sharded checkpoint is a directory"),
            std::string::npos)
      << file.output;
  auto bad = run_command({tool, dir, dir + "/x.h5", "--dtype", "int8"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("--dtype int8 is unknown; use fp32, bf16 or fp16"), std::string::npos)
      << bad.output;
}

// ---------------------------------------------------------------------------------
// 16-bit exports round as torch's Tensor::to does (Note [Float conversion] in h5_convert.cpp),
// on values built to be hard: exact ties both ways and both signs, ties into and out of
// subnormals, overflow to infinity, infinities and NaNs.

std::vector<uint32_t> hard_fp32_bits() {
  return {
      // bf16 ties (the low 16 bits are exactly 0x8000): to even, down and up, both signs
      0x3bc68000,
      0x3bc78000,
      0xbbc68000,
      0xbbc78000,
      0x3f808000,
      0x3f818000,
      0xbf808000,
      0xbf818000,
      // bf16: not ties, either side of one
      0x3bc67fff,
      0x3bc68001,
      // fp32 subnormals: bf16 ties to 0 and to 2, the largest subnormal's tie up into normals
      0x00000001,
      0x00008000,
      0x00018000,
      0x80018000,
      0x007f8000,
      0x807f8000,
      // bf16 overflow: the tie above the largest finite value and the largest float go to inf
      0x7f7f8000,
      0x7f7fffff,
      0xff7f8000,
      // fp16 ties: 1 + 2^-11 (to 1), 1 + 3 * 2^-11 (up), both signs
      0x3f801000,
      0x3f803000,
      0xbf801000,
      0xbf803000,
      // fp16 subnormal ties: 2^-25 (to 0), 3 * 2^-25 (up to 2^-23), 5 * 2^-25 (down to 2^-23)
      0x33000000,
      0x33400000,
      0x33a00000,
      0xb3400000,
      // fp16 overflow: 65520 is the tie between 65504 and 65536 (to inf); 65519 stays finite
      0x477ff000,
      0x477fef00,
      0xc77ff000,
      // infinities, NaNs (quiet, signalling, negative, all payload bits), zeros
      0x7f800000,
      0xff800000,
      0x7fc00000,
      0xffc00000,
      0x7f800001,
      0xff800001,
      0x7fffffff,
      0x00000000,
      0x80000000,
  };
}

// A model whose one parameter holds `hard_fp32_bits()` and then random values.
struct HardValuesImpl : torch::nn::Module {
  HardValuesImpl() {
    auto bits = hard_fp32_bits();
    std::vector<int32_t> v(bits.begin(), bits.end());
    torch::manual_seed(5);
    auto rest = torch::randn({64 - static_cast<int64_t>(v.size())});
    w = register_parameter(
        "w", torch::cat({torch::tensor(v, torch::kInt).view(torch::kFloat), rest}).reshape({8, 8}));
    // A float64 buffer with float32 ties (1 + 2^-24 to 1, 1 + 3 * 2^-24 up), a tie below
    // the smallest float32 subnormal, overflow, and a NaN.
    b = register_buffer(
        "b", torch::tensor(
                 {1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24),
                  -(1.0 + std::ldexp(1.0, -24)), std::ldexp(1.0, -150), 1e39, std::nan(""), 0.1},
                 torch::kDouble));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w); }
  torch::Tensor w, b;
};
TORCH_MODULE(HardValues);

// The raw words of dataset /model/<name>, read in the file's own type.
template <typename Word = uint16_t>
std::vector<Word> raw_words(const std::string& file, const std::string& name) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << file;
  hid_t ds = H5Dopen2(f, ("/model/" + name).c_str(), H5P_DEFAULT);
  hid_t t = H5Dget_type(ds);
  EXPECT_EQ(H5Tget_size(t), sizeof(Word)) << file;
  hid_t sp = H5Dget_space(ds);
  std::vector<Word> out(static_cast<size_t>(H5Sget_simple_extent_npoints(sp)));
  EXPECT_GE(H5Dread(ds, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), 0) << file;
  H5Sclose(sp);
  H5Tclose(t);
  H5Dclose(ds);
  H5Fclose(f);
  return out;
}

// Every word equals torch's `to(dtype)`, except NaN, which is the one quiet NaN of
// Note [Float conversion] (torch's own NaN bits differ between versions).
void expect_rounded_like_torch(const std::vector<uint16_t>& got, const torch::Tensor& fp32,
                               torch::ScalarType dtype, const std::string& what) {
  auto src = fp32.reshape({-1}).contiguous();
  auto want = src.to(dtype).view(torch::kShort);
  ASSERT_EQ(got.size(), static_cast<size_t>(src.numel())) << what;
  for (int64_t i = 0; i < src.numel(); ++i) {
    const float x = src[i].item<float>();
    const auto bits = static_cast<uint32_t>(src.view(torch::kInt)[i].item<int32_t>());
    uint16_t expected = static_cast<uint16_t>(want[i].item<int16_t>());
    if (std::isnan(x))
      expected = dtype == torch::kBFloat16 ? 0x7fc0 : (std::signbit(x) ? 0xfe00 : 0x7e00);
    EXPECT_EQ(got[static_cast<size_t>(i)], expected)
        << what << ": element " << i << " (fp32 bits 0x" << std::hex << bits << ") stored as 0x"
        << got[i] << ", torch rounds it to 0x" << expected;
  }
}

TEST(ConsolidatedCheckpoint, ExportsRoundLikeTorchOnTiesSubnormalsInfinitiesAndNaN) {
  const std::string dir = scratch_dir("ties");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(HardValues(), options_for(pg, never_wrap_policy()));
    save_sharded_checkpoint(dir + "/sharded", model, nullptr, sample_state(0));
    ExportOptions eo;
    for (auto [dtype, tag] :
         {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"},
          std::pair{torch::kFloat32, "fp32"}}) {
      eo.dtype = dtype;
      export_consolidated(dir + "/live_" + tag + ".h5", model, nullptr, sample_state(0), eo);
    }
  });
  HardValues fresh;
  const torch::Tensor w = fresh->w.detach();
  const std::string tool = bin_dir() + "/fsdp-consolidate";
  for (const std::string tag : {"bf16", "fp16", "fp32"}) {
    auto r = run_command({tool, dir + "/sharded", dir + "/off_" + tag + ".h5", "--dtype", tag});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(file_bytes_of(dir + "/off_" + tag + ".h5"),
              file_bytes_of(dir + "/live_" + tag + ".h5"))
        << tag;
  }
  // The float64 buffer in an fp32 export: rounded like torch's to(float), NaN kept.
  {
    auto got = raw_words<uint32_t>(dir + "/off_fp32.h5", "b");
    auto want = fresh->b.to(torch::kFloat).view(torch::kInt);
    ASSERT_EQ(got.size(), static_cast<size_t>(want.numel()));
    for (int64_t i = 0; i < want.numel(); ++i) {
      if (std::isnan(fresh->b[i].item<double>())) {
        float x = 0;
        std::memcpy(&x, &got[static_cast<size_t>(i)], sizeof(x));
        EXPECT_TRUE(std::isnan(x)) << "buffer element " << i;
        continue;
      }
      EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<uint32_t>(want[i].item<int32_t>()))
          << "buffer element " << i;
    }
  }
  for (auto [dtype, tag] :
       {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"}}) {
    expect_rounded_like_torch(raw_words(dir + "/live_" + std::string(tag) + ".h5", "w"), w, dtype,
                              std::string("live export, ") + tag);
    expect_rounded_like_torch(raw_words(dir + "/off_" + std::string(tag) + ".h5", "w"), w, dtype,
                              std::string("fsdp-consolidate --dtype ") + tag);
    // Reading back widens exactly: the model gets torch's rounded values (NaN stays NaN).
    HardValues back;
    load_consolidated(dir + "/off_" + std::string(tag) + ".h5", *back);
    auto want = w.to(dtype).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(back->w.detach().isnan(), want.isnan())) << tag;
    EXPECT_TRUE(
        torch::equal(back->w.detach().nan_to_num(0, 1e38, -1e38), want.nan_to_num(0, 1e38, -1e38)))
        << tag << ": widening on load is not exact";
  }
}

// ---------------------------------------------------------------------------------
// Safetensors exports: live and offline byte for byte, values as torch rounds them.

// Every file of a directory, by name, with its bytes.
std::map<std::string, std::string> dir_bytes(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    out[e.path().filename().string()] = file_bytes_of(e.path().string());
  return out;
}

template <typename Word>
std::vector<Word> st_words(const std::string& path, const std::string& name) {
  fsdp::st::Reader r(path);
  const auto& e = r.entries().at(name);
  std::vector<Word> out((e.end - e.begin) / sizeof(Word));
  r.read(name, 0, e.end - e.begin, out.data());
  return out;
}

TEST(SafetensorsExport, LiveAndOfflineAreByteIdenticalAndRoundLikeTorch) {
  const std::string dir = scratch_dir("st_hard");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(HardValues(), options_for(pg, never_wrap_policy()));
    save_sharded_checkpoint(dir + "/sharded", model, nullptr, sample_state(4));
    for (auto [dtype, tag] :
         {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"},
          std::pair{torch::kFloat32, "fp32"}}) {
      SafetensorsOptions so;
      so.dtype = dtype;
      export_safetensors(dir + "/live_" + tag, model, sample_state(4), so);
      so.max_shard_size = 64;  // w (128 or 256 bytes) and b in files of their own
      export_safetensors(dir + "/live_split_" + tag, model, sample_state(4), so);
    }
  });
  HardValues fresh;
  const torch::Tensor w = fresh->w.detach();
  const std::string tool = bin_dir() + "/fsdp-consolidate";
  for (const std::string tag : {"bf16", "fp16", "fp32"}) {
    auto r = run_command(
        {tool, dir + "/sharded", dir + "/off_" + tag, "--format", "safetensors", "--dtype", tag});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(dir_bytes(dir + "/off_" + tag), dir_bytes(dir + "/live_" + tag)) << tag;
    EXPECT_EQ(dir_bytes(dir + "/live_" + tag).size(), 1u) << "one model.safetensors";
    r = run_command({tool, dir + "/sharded", dir + "/off_split_" + tag, "--format", "safetensors",
                     "--dtype", tag, "--max-shard-size", "64"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto split = dir_bytes(dir + "/live_split_" + tag);
    EXPECT_EQ(dir_bytes(dir + "/off_split_" + tag), split) << tag;
    EXPECT_EQ(split.size(), 3u) << "two files and the index";
    EXPECT_TRUE(split.count("model.safetensors.index.json")) << tag;
  }
  for (auto [dtype, tag] :
       {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"}}) {
    expect_rounded_like_torch(st_words<uint16_t>(dir + "/live_" + std::string(tag), "w"), w, dtype,
                              std::string("safetensors export, ") + tag);
  }
  EXPECT_EQ(st_words<uint32_t>(dir + "/live_fp32", "w"),
            std::vector<uint32_t>(static_cast<const uint32_t*>(w.data_ptr()),
                                  static_cast<const uint32_t*>(w.data_ptr()) + w.numel()));
  fsdp::st::Reader r(dir + "/live_split_bf16");
  EXPECT_EQ(r.entries().at("w").dtype, "BF16");
  EXPECT_EQ(r.entries().at("w").shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(r.entries().at("b").dtype, "BF16") << "floating buffers take the export dtype";
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("fsdp_format"), "fsdp.consolidated");
  EXPECT_EQ(r.metadata().at("dtype"), "bfloat16");
  EXPECT_EQ(r.metadata().at("step"), "4");
  EXPECT_EQ(r.metadata().at("n_layer"), std::to_string(small_gpt_config().n_layer));
  fs::remove_all(dir);
}

TEST(SafetensorsExport, AGptSplitOverFilesHoldsExactlyItsFullStateDict) {
  const std::string dir = scratch_dir("st_gpt");
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(8);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    SafetensorsOptions so;
    so.max_shard_size = 40000;
    export_safetensors(dir + "/st", model, sample_state(2), so);
    const auto full = full_state_dict(model);
    if (pg.rank() != 0) return;
    fsdp::st::Reader r(dir + "/st");
    EXPECT_GT(r.files().size(), 2u);
    size_t params = 0;
    for (const auto& [name, t] : full) {
      ASSERT_TRUE(r.entries().count(name)) << name;
      const auto& e = r.entries().at(name);
      EXPECT_EQ(e.shape, t.sizes().vec()) << name;
      auto got = torch::empty_like(t);
      r.read(name, 0, e.end - e.begin, got.data_ptr());
      EXPECT_TRUE(torch::equal(got, t)) << name;
      ++params;
    }
    EXPECT_EQ(params, full.size());
    EXPECT_EQ(r.entries().size(), full.size() + named_buffers_clean(*model).size());
  });
  fs::remove_all(dir);
}

TEST(SafetensorsImport, ExportedAtTwoRanksImportsAtThreeIntoTheSameFullStateDict) {
  const std::string dir = scratch_dir("st_import");
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(8);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    SafetensorsOptions so;
    so.max_shard_size = 40000;  // several files and an index
    export_safetensors(dir + "/fp32", model, sample_state(2), so);
    so.dtype = torch::kBFloat16;
    export_safetensors(dir + "/bf16", model, sample_state(2), so);
    export_consolidated(dir + "/ref.h5", model, nullptr, sample_state(2));
  });
  gpt::GPT reference(small_gpt_config());
  load_consolidated(dir + "/ref.h5", *reference);
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(99);  // other initial weights: all of them must be replaced
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg, never_wrap_policy()));
    auto report = import_consolidated(dir + "/fp32", model);
    EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
    expect_params_match(full_state_dict(model), *reference, 0.0);
    import_consolidated(dir + "/bf16/model.safetensors.index.json", model);
    for (const auto& [name, t] : full_state_dict(model)) {
      const auto want = named_parameters_clean(*reference);
      for (const auto& [n, r] : want) {
        if (n == name)
          EXPECT_TRUE(torch::equal(t, r.detach().to(torch::kBFloat16).to(torch::kFloat))) << name;
      }
    }
  });
  // Into a plain module, as inference does.
  gpt::GPT plain(small_gpt_config());
  load_consolidated(dir + "/fp32", *plain);
  for (const auto& [n, t] : named_parameters_clean(*plain)) {
    for (const auto& [m, r] : named_parameters_clean(*reference)) {
      if (n == m) EXPECT_TRUE(torch::equal(t, r)) << n;
    }
  }
  auto attrs = consolidated_attributes(dir + "/fp32");
  EXPECT_EQ(std::get<int64_t>(attrs.at("n_layer")), small_gpt_config().n_layer);
  EXPECT_EQ(std::get<std::string>(attrs.at("fsdp_format")), "fsdp.consolidated");
  // Integer data where a parameter needs floats: refused, naming the tensor and its dtype.
  {
    fsdp::st::DirWriter w(dir + "/ints", {{"w", "I64", {8, 8}}}, {}, 1u << 20);
    std::vector<int64_t> ints(64, 3);
    w.add(0, ints.data(), ints.size() * sizeof(int64_t));
    w.finish();
    auto hv = fully_shard(HardValues());
    try {
      import_consolidated(dir + "/ints", hv, LoadOptions{true, false});
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("tensor 'w' is I64, not a floating type a parameter can take"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  // Another model's weights: every missing and unexpected name, listed.
  MlpNet mlp;
  try {
    load_consolidated(dir + "/fp32", *mlp);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("inp.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
  }
  fs::remove_all(dir);
}

TEST(SafetensorsExport, BadOptionsAreRefusedWithTheFix) {
  const std::string dir = scratch_dir("st_bad");
  auto model = fully_shard(MlpNet());
  SafetensorsOptions so;
  so.dtype = torch::kInt64;
  try {
    export_safetensors(dir + "/x", model, {}, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("use float32, bfloat16 or float16"),
              std::string::npos);
  }
  so.dtype = torch::kFloat32;
  so.max_shard_size = 0;
  try {
    export_safetensors(dir + "/x", model, {}, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("max_shard_size must be positive"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_FALSE(fs::exists(dir + "/x/model.safetensors"));
  // At 2 ranks every rank throws: rank 0 with its error, the other pointing at rank 0's.
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto m = fully_shard(MlpNet(), options_for(pg));
    try {
      export_safetensors(dir + "/y", m, {}, so);
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      const std::string want =
          pg.rank() == 0 ? "export_safetensors to " + dir + "/y failed: "
                         : "export_safetensors to " + dir + "/y failed on rank 0 (see its error)";
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
    }
  });
  const std::string tool = bin_dir() + "/fsdp-consolidate";
  auto r = run_command({tool, dir, dir + "/o", "--format", "onnx"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--format onnx is unknown; use hdf5 or safetensors"), std::string::npos)
      << r.output;
  r = run_command({tool, dir, dir + "/o", "--format", "safetensors", "--max-shard-size", "5GB"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--max-shard-size 5GB is not a positive number of bytes"),
            std::string::npos)
      << r.output;
  r = run_command({tool, dir, dir + "/o", "--format", "safetensors", "--with-optimizer"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--with-optimizer needs --format hdf5"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------
// h5py reads the consolidated file: names, shapes and values match the C++ side.

TEST(ConsolidatedCheckpoint, H5pyReadsNamesShapesAndValues) {
  const std::string dir = scratch_dir("h5py");
  torch::manual_seed(3);
  auto model = fully_shard(gpt::GPT(small_gpt_config()));
  export_consolidated(dir + "/gpt.h5", model, nullptr, sample_state(9));
  // What the C++ side wrote, as text: name, shape, then every value (exact float text).
  {
    std::ofstream out(dir + "/expected.txt");
    out.precision(9);
    for (const auto& [name, t] : full_state_dict(model)) {
      out << name << " " << t.dim();
      for (auto d : t.sizes()) out << " " << d;
      auto flat = t.reshape({-1});
      out << " " << flat.numel();
      for (int64_t i = 0; i < flat.numel(); ++i) out << " " << flat[i].item<float>();
      out << "\n";
    }
  }
  auto r = run_command({FSDP_PYTHON,
                        std::string(FSDP_SOURCE_DIR) + "/tests/interop/read_consolidated.py",
                        dir + "/gpt.h5", dir + "/expected.txt"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ok:"), std::string::npos) << r.output;
}

// ---------------------------------------------------------------------------------
// Retention and names.

TEST(ShardedCheckpoint, KeepsTheNewestKAndNeverOverwrites) {
  const std::string dir = scratch_dir("keep");
  auto model = fully_shard(MlpNet());
  SaveOptions so;
  so.keep_last = 2;
  for (int64_t s : {1, 2, 3, 4}) save_sharded_checkpoint(dir, model, nullptr, sample_state(s), so);
  const std::string again = save_sharded_checkpoint(dir, model, nullptr, sample_state(4), so);
  EXPECT_EQ(fs::path(again).filename().string(), "step_00000004_2");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000004", "step_00000004_2"}));
  EXPECT_EQ(*latest_checkpoint(dir), again);
  EXPECT_FALSE(latest_checkpoint(dir + "/step_00000004").has_value());
  const std::string msg =
      error_of([&] { save_sharded_checkpoint(dir, model, nullptr, sample_state(-1)); });
  EXPECT_NE(msg.find("step -1 is negative"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------
// Crash safety: a save killed at any moment leaves the previous checkpoint loadable.

// Every shard element of checkpoint `step` holds the value `step`, so a load that mixed
// files of two checkpoints would show.
void fill_with(const ShardedModel& model, int64_t step) {
  torch::NoGradGuard g;
  for (auto& p : model.sharded_parameters()) p.fill_(static_cast<float>(step));
}

// The child process of the crash tests (main() runs it when FSDP_CRASH_SAVER_DIR is
// set): saves checkpoints step after step until killed.
void crash_saver(const char* dir) {
  auto model = fully_shard(MlpNet(64, 512, 8, 64));
  int64_t step = 0;
  if (latest_checkpoint(dir)) {
    TrainingState st;
    load_sharded_checkpoint(dir, model, nullptr, &st);
    step = st.step;
  }
  const int64_t stop = std::getenv("FSDP_CRASH_SAVER_ONCE") ? step + 1 : INT64_MAX;
  const bool async = std::getenv("FSDP_CRASH_SAVER_ASYNC") != nullptr;
  if (const char* flag = std::getenv("FSDP_CRASH_SAVER_SIGNAL")) {
    // Each save announces the write of its rank file and lingers in it (in the background
    // thread for an asynchronous one), so that the test's kill lands inside one on purpose.
    const std::string path = flag;
    fsdp::detail::set_save_hook([path](const std::string& step, const std::string&) {
      if (step != "write") return;
      std::ofstream(path) << "writing\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
  }
  SaveOptions so;
  so.keep_last = 2;
  AsyncSave pending;
  const char* progress = std::getenv("FSDP_CRASH_SAVER_PROGRESS");
  int64_t returned = 0;
  while (step < stop) {
    ++step;
    fill_with(model, step);
    if (async) {
      pending = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(step), so);
      fill_with(model, -step);  // training goes on: the save must hold `step` regardless
    } else {
      save_sharded_checkpoint(dir, model, nullptr, sample_state(step), so);
    }
    std::cout << "saved " << step << std::endl;
    // How many save calls have returned (an asynchronous one returns before its write).
    if (progress != nullptr) std::ofstream(std::string(progress) + ".tmp") << ++returned << "\n";
    if (progress != nullptr) fs::rename(std::string(progress) + ".tmp", progress);
  }
}

pid_t start_saver(const std::string& dir, bool once, bool async = false,
                  const std::string& signal = "", const std::string& progress = "") {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("FSDP_CRASH_SAVER_DIR", dir.c_str(), 1);
    if (!progress.empty()) setenv("FSDP_CRASH_SAVER_PROGRESS", progress.c_str(), 1);
    if (once) setenv("FSDP_CRASH_SAVER_ONCE", "1", 1);
    if (async) setenv("FSDP_CRASH_SAVER_ASYNC", "1", 1);
    if (!signal.empty()) setenv("FSDP_CRASH_SAVER_SIGNAL", signal.c_str(), 1);
    const std::string self = bin_dir() + "/test_checkpoint";
    int devnull = ::open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    execl(self.c_str(), self.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

// Waits up to two minutes until the saver's progress file counts `n` returned saves.
bool wait_for_saves(const std::string& progress, int64_t n) {
  for (int i = 0; i < 60000; ++i) {
    std::ifstream f(progress);
    int64_t k = 0;
    if (f >> k && k >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// Half the kills are aimed into the write of a rank file (the saver announces it), half
// land at random moments of the save loop (after its first `saves_first` saves returned,
// so that each such round makes progress however slow the machine: it may run under
// sanitizers): after each, the newest complete checkpoint loads, whole.
TEST(CrashSafety, KilledSavesNeverBreakThePreviousCheckpoint) {
  const std::string dir = scratch_dir("crash");
  const std::string signal = dir + ".writing";
  int status = 0;
  pid_t first = start_saver(dir, /*once=*/true);
  waitpid(first, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::mt19937 rng(12345);
  auto model = fully_shard(MlpNet(64, 512, 8, 64));
  int64_t last_step = 1, aimed = 0, killed_writing = 0;
  for (int round = 0; round < 20; ++round) {
    fs::remove(signal);
    const bool aim = round % 2 == 0;
    const std::string progress = dir + ".progress";
    fs::remove(progress);
    pid_t pid = start_saver(dir, false, false, aim ? signal : "", progress);
    if (aim) {
      for (int i = 0; i < 30000 && !fs::exists(signal); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_TRUE(fs::exists(signal)) << "round " << round << ": no write began";
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 50)(rng)));
      ++aimed;
    } else {
      ASSERT_TRUE(wait_for_saves(progress, 1)) << "round " << round << ": no save returned";
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "round " << round << ": the saver ended before the kill";
    // A kill inside a save leaves its temporary directory behind (the next save removes it).
    bool tmp_left = false;
    for (const auto& e : fs::directory_iterator(dir))
      tmp_left |= e.path().filename().string().rfind(".tmp-", 0) == 0;
    killed_writing += aim && tmp_left ? 1 : 0;
    // The previous complete checkpoint loads, whole and consistent.
    TrainingState st;
    ASSERT_NO_THROW(load_sharded_checkpoint(dir, model, nullptr, &st)) << "round " << round;
    EXPECT_GE(st.step, last_step) << "latest went backwards";
    last_step = st.step;
    for (auto& p : model.sharded_parameters()) {
      ASSERT_TRUE(torch::all(p == static_cast<float>(st.step)).item<bool>())
          << "files of two checkpoints mixed";
    }
    EXPECT_NE(inspect_checkpoint(dir).find("verified"), std::string::npos);
  }
  EXPECT_EQ(killed_writing, aimed) << "an aimed kill missed the write";
  EXPECT_GT(last_step, 1)
      << "no save ever completed: the kill times are too short to test anything";
  fs::remove(signal);
}

// The same with asynchronous saves, half the kills aimed into a background write (the
// thread announces it), half at random moments: every checkpoint `latest` names loads,
// whole, with the values of its own step (the staging copy, not what training wrote after).
TEST(CrashSafety, KilledAsyncSavesNeverBreakThePreviousCheckpoint) {
  const std::string dir = scratch_dir("crash_async");
  const std::string signal = dir + ".writing";
  int status = 0;
  pid_t first = start_saver(dir, /*once=*/true, /*async=*/true);
  waitpid(first, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::mt19937 rng(2024);
  auto model = fully_shard(MlpNet(64, 512, 8, 64));
  int64_t last_step = 1, aimed = 0, killed_writing = 0;
  for (int round = 0; round < 20; ++round) {
    fs::remove(signal);
    const bool aim = round % 2 == 0;
    const std::string progress = dir + ".progress";
    fs::remove(progress);
    pid_t pid = start_saver(dir, false, true, aim ? signal : "", progress);
    if (aim) {
      // The first write is announced after start-up, a load and one snapshot.
      for (int i = 0; i < 30000 && !fs::exists(signal); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_TRUE(fs::exists(signal)) << "round " << round << ": no background write began";
      // Well inside the 300 ms the write lingers, even on a loaded machine.
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 50)(rng)));
      ++aimed;
    } else {
      // Two returned calls: the second waited for the first's write, now complete.
      ASSERT_TRUE(wait_for_saves(progress, 2)) << "round " << round << ": no save returned";
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "round " << round << ": the saver ended before the kill";
    // A kill inside a write leaves its temporary directory behind (the next save removes it).
    bool tmp_left = false;
    for (const auto& e : fs::directory_iterator(dir))
      tmp_left |= e.path().filename().string().rfind(".tmp-", 0) == 0;
    killed_writing += aim && tmp_left ? 1 : 0;
    TrainingState st;
    ASSERT_NO_THROW(load_sharded_checkpoint(dir, model, nullptr, &st)) << "round " << round;
    EXPECT_GE(st.step, last_step) << "latest went backwards";
    last_step = st.step;
    for (auto& p : model.sharded_parameters()) {
      ASSERT_TRUE(torch::all(p == static_cast<float>(st.step)).item<bool>())
          << "round " << round << ": checkpoint " << st.step
          << " does not hold its own step's values";
    }
    EXPECT_NE(inspect_checkpoint(dir).find("verified"), std::string::npos);
  }
  EXPECT_EQ(killed_writing, aimed) << "an aimed kill missed the background write";
  EXPECT_GT(last_step, 1) << "no save ever completed";
  fs::remove(signal);
}

// ---------------------------------------------------------------------------------
// Asynchronous saves (Note [Asynchronous saves]).

// What the async save of step 3 must hold: the state at the call, though training goes
// on before the save is waited for. Rank r's flat shards and AdamW moments are staged,
// and rank 0's buffers: checkpoint_staging counts exactly those bytes until the wait.
void async_save_and_resume(const ProcessGroup& pg, const std::string& dir) {
  const auto cfg = small_gpt_config();
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  torch::manual_seed(42 + pg.rank());
  int64_t expected_staging = 0;
  for (const auto& ls : fsdp::detail::local_shards(model)) {
    const int64_t length = ls.writer ? ls.length : 0;
    expected_staging +=
        4 * length * (1 + (ls.info.requires_grad ? 2 : 0));  // param, exp_avg, exp_avg_sq
  }
  if (pg.rank() == 0) {
    for (const auto& b : model.as_module().buffers())
      expected_staging += static_cast<int64_t>(b.nbytes());
  }
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, 0);
  AsyncSave pending = save_sharded_checkpoint_async(dir, model, &opt, sample_state(3));
  EXPECT_EQ(pending.path(), dir + "/step_00000003");
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, expected_staging);
  const auto rng_after_save = torch::rand({4});
  std::vector<double> uninterrupted;
  // Training changes every shard and moment while the thread may still be writing.
  for (int64_t s = 3; s < 6; ++s) uninterrupted.push_back(train_step(model, opt, s, pg));
  EXPECT_EQ(pending.wait(), dir + "/step_00000003");
  EXPECT_TRUE(pending.done());
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, expected_staging)
      << "kept for the next save";
  EXPECT_EQ(model.memory_stats().checkpoint_staging.peak, expected_staging);
  release_checkpoint_staging(model);
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, 0);
  EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());
  pg.barrier();  // rank 0's wait() returns once published; the others' once written
  EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000003");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir + "/step_00000003"))
    names.push_back(e.path().filename().string());
  EXPECT_EQ(names.size(), static_cast<size_t>(pg.size())) << "markers left in the checkpoint";

  torch::manual_seed(7);
  auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
  torch::optim::AdamW opt2(model2.sharded_parameters(), torch::optim::AdamWOptions(1.0).eps(1e-6));
  TrainingState st;
  torch::manual_seed(999);
  load_sharded_checkpoint(dir, model2, &opt2, &st);
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save))
      << "the RNG state of the call was not saved";
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.extra, sample_state(3).extra);
  for (int64_t s = 3; s < 6; ++s) {
    EXPECT_EQ(train_step(model2, opt2, s, pg), uninterrupted[static_cast<size_t>(s - 3)])
        << "step " << s << " differs after resuming from the asynchronous save";
  }
}

TEST(AsyncCheckpoint, SavesTheStateOfTheCallWhileTrainingGoesOnAtTwoRanks) {
  const std::string dir = scratch_dir("async");
  run_ranks(2, [&](const ProcessGroup& pg) { async_save_and_resume(pg, dir); });
}

// Note [Staging reuse]: the second save copies into the first one's buffers (the same
// memory, so the counter never holds two snapshots) and still writes its own step's
// values; buffers a save no longer needs are freed; keep_staging = false and
// release_checkpoint_staging give the memory back.
TEST(AsyncCheckpoint, StagingBuffersAreReusedByTheNextSaveAndReleasedOnRequest) {
  const std::string dir = scratch_dir("async_reuse");
  run_ranks(2, [&](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
    auto opt = make_adamw(model);
    train_step(model, opt, 0, pg);
    int64_t param_bytes = 0, optim_bytes = 0;
    for (const auto& ls : fsdp::detail::local_shards(model)) {
      const int64_t length = ls.writer ? ls.length : 0;
      param_bytes += 4 * length;
      if (ls.info.requires_grad) optim_bytes += 2 * 4 * length;  // exp_avg, exp_avg_sq
    }
    if (pg.rank() == 0) {
      for (const auto& b : model.as_module().buffers())
        param_bytes += static_cast<int64_t>(b.nbytes());
    }
    auto stats = [&] { return model.memory_stats().checkpoint_staging; };
    auto addresses = [&] {
      std::map<std::string, const void*> a;
      for (const auto& [key, t] : fsdp::detail::checkpoint_staging_pool(model))
        a[key] = t.data_ptr();
      return a;
    };

    // Without the optimizer: parameters (and rank 0's buffers) only.
    AsyncSave first = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1));
    first.wait();
    EXPECT_EQ(stats().current, param_bytes);
    const auto kept = addresses();
    EXPECT_FALSE(kept.empty());

    // With it: the parameters' buffers are reused, the moments' are new.
    train_step(model, opt, 1, pg);
    std::vector<torch::Tensor> expected;
    for (const auto& ls : fsdp::detail::local_shards(model))
      expected.push_back(ls.shard.narrow(0, 0, ls.length).clone());
    AsyncSave second = save_sharded_checkpoint_async(dir, model, &opt, sample_state(2));
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    EXPECT_EQ(stats().peak, param_bytes + optim_bytes)
        << "the first save's buffers were not reused";
    train_step(model, opt, 2, pg);  // changes every shard while the second save may write
    second.wait();
    const auto now = addresses();
    for (const auto& [key, ptr] : kept) {
      ASSERT_TRUE(now.count(key)) << key;
      EXPECT_EQ(now.at(key), ptr) << key << " was allocated afresh";
    }
    EXPECT_GT(now.size(), kept.size());

    // The reused buffers held the second save's values.
    pg.barrier();
    torch::manual_seed(5);
    auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
    load_sharded_checkpoint(dir, model2, nullptr, nullptr);
    const auto loaded = fsdp::detail::local_shards(model2);
    ASSERT_EQ(loaded.size(), expected.size());
    for (size_t k = 0; k < expected.size(); ++k) {
      EXPECT_TRUE(torch::equal(loaded[k].shard.narrow(0, 0, loaded[k].length), expected[k])) << k;
    }

    // Without the optimizer again: its moments' buffers are freed.
    AsyncSave third = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(3));
    third.wait();
    EXPECT_EQ(stats().current, param_bytes);

    SaveOptions no_keep;
    no_keep.keep_staging = false;
    AsyncSave fourth = save_sharded_checkpoint_async(dir, model, &opt, sample_state(4), no_keep);
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    fourth.wait();
    EXPECT_EQ(stats().current, 0);
    EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());

    AsyncSave fifth = save_sharded_checkpoint_async(dir, model, &opt, sample_state(5));
    fifth.wait();
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    release_checkpoint_staging(model);
    EXPECT_EQ(stats().current, 0);
    EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());
  });
}

TEST(AsyncCheckpoint, AnEmptyHandleHoldsNoSave) {
  AsyncSave none;
  EXPECT_TRUE(none.done());
  EXPECT_EQ(none.path(), "");
  const std::string msg = error_of([&] { none.wait(); });
  EXPECT_NE(msg.find("AsyncSave::wait: this handle holds no save"), std::string::npos) << msg;
}

TEST(AsyncCheckpoint, SavesTheStateOfTheCallWhileTrainingGoesOnAtOneRank) {
  const std::string dir = scratch_dir("async");
  run_ranks(1, [&](const ProcessGroup& pg) { async_save_and_resume(pg, dir); });
}

// A write that fails in the background (a full disk, injected on rank 1): wait() says so
// on each rank, `latest` stays at the previous checkpoint, the next save throws on every
// rank naming the file and saves nothing, and the save after it works.
TEST(AsyncCheckpoint, ABackgroundFailureIsReportedByTheNextSaveOnEveryRank) {
  const std::string dir = scratch_dir("async_fail");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook([&](const std::string& step, const std::string& file) {
      if (step == "write" && pg.rank() == 1)
        throw std::runtime_error("No space left on device (injected)");
      (void)file;
    });
    AsyncSave pending = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
    const std::string waited = error_of([&] { pending.wait(); });
    const std::string file1 = dir + "/.tmp-step_00000002/rank_00001.h5";
    EXPECT_NE(waited.find("the asynchronous save of " + dir + "/step_00000002 failed"),
              std::string::npos)
        << waited;
    EXPECT_NE(waited.find("writing " + file1 + " failed: No space left on device (injected)"),
              std::string::npos)
        << waited;
    if (pg.rank() == 0) EXPECT_NE(waited.find("rank 1: "), std::string::npos) << waited;
    fsdp::detail::set_save_hook({});
    pg.barrier();
    EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000001");
    EXPECT_FALSE(fs::exists(dir + "/step_00000002"));
    EXPECT_GT(model.memory_stats().checkpoint_staging.current, 0);
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current,
              model.memory_stats().checkpoint_staging.peak);

    const std::string next =
        error_of([&] { save_sharded_checkpoint(dir, model, nullptr, sample_state(3)); });
    EXPECT_NE(next.find("save_sharded_checkpoint: the asynchronous save of " + dir +
                        "/step_00000002 failed"),
              std::string::npos)
        << next;
    EXPECT_NE(next.find("this call saved nothing"), std::string::npos) << next;
    pg.barrier();
    EXPECT_FALSE(fs::exists(dir + "/step_00000003"));
    EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000001");

    AsyncSave again = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(3));
    EXPECT_EQ(again.wait(), dir + "/step_00000003");
    pg.barrier();
    EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000003");
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_00000001", "step_00000003"}));
  });
}

// Rank 1's background write stalls (its thread holds back until rank 0 has given up):
// rank 0's thread waits the process group's timeout (3 s here) without the files growing,
// says so naming the directory and the count, and removes the temporary directory; rank
// 1's write then fails; the next save throws on both and `latest` stays.
TEST(AsyncCheckpoint, RankZeroGivesUpOnAStalledRankAfterTheTimeout) {
  const std::string dir = scratch_dir("async_stall");
  const std::string tmp = dir + "/.tmp-step_00000002";
  run_ranks(
      2,
      [&](const ProcessGroup& pg) {
        ASSERT_EQ(pg.timeout_s(), 3.0);
        auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
        save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
        fsdp::detail::set_save_hook([&](const std::string& step, const std::string& file) {
          if (step != "write" || pg.rank() != 1) return;
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (fs::exists(tmp) && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          (void)file;
        });
        const auto t0 = std::chrono::steady_clock::now();
        AsyncSave pending = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
        const std::string waited = error_of([&] { pending.wait(); });
        const double waited_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (pg.rank() == 0) {
          EXPECT_NE(waited.find("waited 3 s (the process group's timeout, FSDP_TIMEOUT_S) for the "
                                "other ranks' files in " +
                                tmp + " without progress: 1 of 2 complete"),
                    std::string::npos)
              << waited;
          EXPECT_GE(waited_s, 3.0);
          EXPECT_LT(waited_s, 20.0);
        } else {
          EXPECT_NE(waited.find("writing " + tmp + "/rank_00001.h5 failed"), std::string::npos)
              << waited;
        }
        EXPECT_FALSE(fs::exists(tmp));
        fsdp::detail::set_save_hook({});
        const std::string next =
            error_of([&] { save_sharded_checkpoint(dir, model, nullptr, sample_state(3)); });
        EXPECT_NE(next.find("the asynchronous save of " + dir + "/step_00000002 failed"),
                  std::string::npos)
            << next;
        pg.barrier();
        EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000001");
        EXPECT_FALSE(fs::exists(dir + "/step_00000002"));
      },
      300, {"FSDP_TIMEOUT_S=3"});
}

// Staging fails on rank 1 halfway (out of host memory, injected at its second flat, with
// the last save's buffers in hand): the call throws on both ranks before either goes on
// training, nothing is written, and rank 1 holds no staging memory afterwards (what it
// had staged and what it kept are both freed and uncounted). The next save works.
TEST(AsyncCheckpoint, AFailureWhileStagingFailsTheCallEverywhere) {
  const std::string dir = scratch_dir("async_stage");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1)).wait();
    const int64_t snapshot_bytes = model.memory_stats().checkpoint_staging.current;
    ASSERT_GT(snapshot_bytes, 0);
    int staged = 0;
    fsdp::detail::set_save_hook([&](const std::string& step, const std::string&) {
      if (step == "stage" && pg.rank() == 1 && ++staged == 2)
        throw std::runtime_error("out of host memory (injected)");
    });
    const std::string msg = error_of(
        [&] { (void)save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2)); });
    fsdp::detail::set_save_hook({});
    EXPECT_NE(msg.find("save_sharded_checkpoint_async to " + dir + " failed"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find(pg.rank() == 1 ? "out of host memory (injected)"
                                      : "on another rank (see its error)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current, pg.rank() == 1 ? 0 : snapshot_bytes);
    EXPECT_EQ(model.memory_stats().checkpoint_staging.peak, snapshot_bytes);
    pg.barrier();
    EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000001");
    EXPECT_FALSE(fs::exists(dir + "/.tmp-step_00000002"));
    pg.barrier();  // both have looked before the next save makes that directory again
    EXPECT_EQ(save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2)).wait(),
              dir + "/step_00000002");
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current, snapshot_bytes);
  });
}

// Publishing fails on rank 0 (the rename or `latest`, injected): rank 0's wait() names
// the directory; rank 1, whose file was written, learns it at the next save, which throws
// on both; nothing of the save is left and `latest` stays.
TEST(AsyncCheckpoint, AFailedPublishLeavesLatestAndIsReportedEverywhere) {
  const std::string dir = scratch_dir("async_publish");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook([&](const std::string& step, const std::string& what) {
      if (step == "publish" && what == dir + "/step_00000002")
        throw std::runtime_error("rename: Input/output error (injected)");
    });
    AsyncSave pending = save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
    if (pg.rank() == 0) {
      const std::string waited = error_of([&] { pending.wait(); });
      EXPECT_NE(waited.find("publishing " + dir +
                            "/step_00000002 failed: rename: Input/output error (injected)"),
                std::string::npos)
          << waited;
      EXPECT_FALSE(fs::exists(dir + "/.tmp-step_00000002"));
    } else {
      EXPECT_EQ(pending.wait(), dir + "/step_00000002");  // its own file is on disk
    }
    fsdp::detail::set_save_hook({});
    const std::string next =
        error_of([&] { save_sharded_checkpoint(dir, model, nullptr, sample_state(3)); });
    EXPECT_NE(next.find("the asynchronous save of " + dir + "/step_00000002 failed"),
              std::string::npos)
        << next;
    if (pg.rank() == 1)
      EXPECT_NE(next.find("on another rank (see its error)"), std::string::npos) << next;
    pg.barrier();
    EXPECT_EQ(*latest_checkpoint(dir), dir + "/step_00000001");
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_00000001"}));
  });
}

// Note [Agreed outcomes]: what rank 0 alone does in a synchronous save (prepare the
// directory, publish) fails on every rank alike, rank 0 naming the cause, the others
// pointing at it; nothing is left behind and `latest` stays.
TEST(ShardedCheckpoint, RankZeroFailuresFailTheSaveOnEveryRank) {
  const std::string dir = scratch_dir("rank0_fails");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    if (pg.rank() == 0) {
      fs::create_directories(dir);
      std::ofstream(dir + "/file") << "not a directory";
    }
    pg.barrier();
    std::string msg = error_of(
        [&] { save_sharded_checkpoint(dir + "/file/ck", model, nullptr, sample_state(1)); });
    EXPECT_NE(msg.find("save_sharded_checkpoint: preparing " + dir + "/file/ck failed" +
                       (pg.rank() == 0 ? ": " : " on rank 0 (see its error)")),
              std::string::npos)
        << msg;

    save_sharded_checkpoint(dir + "/ck", model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook([&](const std::string& step, const std::string&) {
      if (step == "publish") throw std::runtime_error("rename: Input/output error (injected)");
    });
    msg = error_of([&] { save_sharded_checkpoint(dir + "/ck", model, nullptr, sample_state(2)); });
    fsdp::detail::set_save_hook({});
    const std::string head =
        "save_sharded_checkpoint: publishing " + dir + "/ck/step_00000002 failed";
    EXPECT_NE(msg.find(pg.rank() == 0 ? head + ": rename: Input/output error (injected)"
                                      : head + " on rank 0 (see its error)"),
              std::string::npos)
        << msg;
    pg.barrier();
    EXPECT_EQ(*latest_checkpoint(dir + "/ck"), dir + "/ck/step_00000001");
  });
}

// ---------------------------------------------------------------------------------
// Note [Atomic publish]: one helper, used by every writer.

TEST(AtomicPublish, WritesWholeOrNotAtAllAndNamesWhatFailed) {
  const std::string dir = scratch_dir("publish");
  fs::create_directories(dir);
  fsdp::ckpt::write_atomically(dir + "/latest", "step_00000001\n");
  fsdp::ckpt::write_atomically(dir + "/latest", "step_00000002\n");
  std::ifstream in(dir + "/latest");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "step_00000002\n");
  EXPECT_FALSE(fs::exists(dir + "/latest.tmp"));

  std::string msg =
      error_of([&] { fsdp::ckpt::publish_atomically(dir + "/absent", dir + "/target"); });
  EXPECT_NE(
      msg.find("cannot rename " + dir + "/absent to " + dir + "/target: No such file or directory"),
      std::string::npos)
      << msg;
  msg = error_of([&] { fsdp::ckpt::fsync_path(dir + "/absent"); });
  EXPECT_NE(msg.find("cannot open " + dir + "/absent to fsync it: No such file or directory"),
            std::string::npos)
      << msg;
  // A directory is published whole, as the sharded save does.
  fs::create_directories(dir + "/.tmp-step");
  std::ofstream(dir + "/.tmp-step/rank_00000.h5") << "x";
  fsdp::ckpt::publish_atomically(dir + "/.tmp-step", dir + "/step");
  EXPECT_TRUE(fs::exists(dir + "/step/rank_00000.h5"));
  EXPECT_FALSE(fs::exists(dir + "/.tmp-step"));
}

// No writer renames into place on its own (the second implementation, and the one that
// did not fsync the directory, are gone): rename(2) is called in publish.cpp only.
TEST(AtomicPublish, EveryWriterInCheckpointUsesTheOneHelper) {
  std::vector<std::string> offenders;
  int scanned = 0;
  for (const auto& e : fs::directory_iterator(std::string(FSDP_SOURCE_DIR) + "/checkpoint")) {
    if (e.path().filename() == "publish.cpp") continue;
    ++scanned;
    std::ifstream in(e.path());
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.find("rename(") != std::string::npos)
        offenders.push_back(e.path().filename().string() + ":" + std::to_string(n));
    }
  }
  EXPECT_GE(scanned, 10) << "checkpoint/ not found under " << FSDP_SOURCE_DIR;
  EXPECT_TRUE(offenders.empty()) << ::testing::PrintToString(offenders);
}

// ---------------------------------------------------------------------------------
// Misuse of the API: each error says what is wrong and what to do.

TEST(CheckpointApi, MisuseGetsAMessageNamingTheFix) {
  const std::string dir = scratch_dir("api");
  auto model = fully_shard(gpt::GPT(small_gpt_config()));
  auto opt = make_adamw(model);
  save_sharded_checkpoint(dir + "/noopt", model, nullptr, sample_state(1));
  struct Case {
    std::function<void()> call;
    std::string message;
  };
  auto other_params = std::vector<torch::Tensor>{torch::zeros({3}, torch::requires_grad())};
  torch::optim::AdamW foreign(other_params);
  const auto shards = model.sharded_parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{shards[0]});
  groups.emplace_back(std::vector<torch::Tensor>(shards.begin() + 1, shards.end()));
  torch::optim::AdamW two_groups(std::move(groups));
  torch::optim::RMSprop rms(model.sharded_parameters());
  ExportOptions with_opt;
  with_opt.with_optimizer = true;
  ExportOptions int_dtype;
  int_dtype.dtype = torch::kInt32;
  TrainingState reserved = sample_state(1);
  reserved.model_attrs["step"] = int64_t{3};
  SaveOptions negative;
  negative.keep_last = -1;
  const std::vector<Case> cases = {
      {[&] { load_sharded_checkpoint(dir + "/noopt", model, &opt, nullptr); },
       "holds no optimizer state; pass nullptr as the optimizer to load only the model"},
      {[&] { save_sharded_checkpoint(dir + "/x", model, &foreign, sample_state(1)); },
       "the optimizer does not hold the shard of unit ''. Build it from "
       "model.sharded_parameters()."},
      {[&] { save_sharded_checkpoint(dir + "/x", model, &rms, sample_state(1)); },
       "this optimizer is none of them (pass nullptr to save or load without optimizer state)"},
      {[&] { save_sharded_checkpoint(dir + "/x", model, nullptr, sample_state(1), negative); },
       "keep_last -1 is negative; use 0 to keep every checkpoint"},
      {[&] { export_consolidated(dir + "/e.h5", model, nullptr, sample_state(1), with_opt); },
       "export_consolidated: with_optimizer needs the optimizer"},
      {[&] { export_consolidated(dir + "/e.h5", model, nullptr, sample_state(1), int_dtype); },
       "is not supported; use float32, bfloat16 or float16"},
      {[&] { export_consolidated(dir + "/e.h5", model, nullptr, reserved); },
       "model attribute 'step' collides with a reserved root attribute"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_of(c.call);
    EXPECT_NE(msg.find(c.message), std::string::npos) << "want: " << c.message << "\ngot: " << msg;
  }
  // A checkpoint with optimizer state, loaded into an optimizer with other param groups.
  save_sharded_checkpoint(dir + "/opt", model, &opt, sample_state(1));
  const std::string msg =
      error_of([&] { load_sharded_checkpoint(dir + "/opt", model, &two_groups, nullptr); });
  EXPECT_NE(msg.find("holds 1 optimizer param groups but the optimizer has 2"), std::string::npos)
      << msg;
  auto r = run_command(
      {bin_dir() + "/fsdp-consolidate", dir + "/noopt", dir + "/c.h5", "--with-optimizer"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds no optimizer state; drop --with-optimizer"), std::string::npos)
      << r.output;
}

// ---------------------------------------------------------------------------------
// Bad input: each names the file and what is wrong.

struct BadCheckpoint : ::testing::Test {
  std::string dir;
  std::string ckpt;
  void SetUp() override {
    dir = scratch_dir(std::string("bad_") +
                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
    run_ranks(2, [&](const ProcessGroup& pg) {
      auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
      fill_with(model, 3);  // 3.0f everywhere: easy to find in the file
      save_sharded_checkpoint(dir, model, nullptr, sample_state(5));
    });
    ckpt = dir + "/step_00000005";
  }
  std::string load_error() {
    auto model = fully_shard(gpt::GPT(small_gpt_config()));
    return error_of([&] { load_sharded_checkpoint(dir, model, nullptr, nullptr); });
  }
};

TEST_F(BadCheckpoint, TruncatedFile) {
  fs::resize_file(ckpt + "/rank_00001.h5", fs::file_size(ckpt + "/rank_00001.h5") / 2);
  const std::string msg = load_error();
  EXPECT_NE(msg.find("rank_00001.h5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(BadCheckpoint, CorruptedData) {
  // Flip a byte inside the parameter data (a run of 3.0f) of rank 1's file.
  const std::string p = ckpt + "/rank_00001.h5";
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), {});
  const float three = 3.0f;
  std::string pattern;
  for (int i = 0; i < 8; ++i) pattern.append(reinterpret_cast<const char*>(&three), 4);
  const size_t at = bytes.find(pattern);
  ASSERT_NE(at, std::string::npos);
  f.seekp(static_cast<std::streamoff>(at + 13));
  f.put(static_cast<char>(0x5a));
  f.close();
  const std::string msg = load_error();
  EXPECT_NE(msg.find("rank_00001.h5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
  auto r = run_command({bin_dir() + "/fsdp-inspect", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
}

TEST_F(BadCheckpoint, MissingRankFile) {
  fs::remove(ckpt + "/rank_00001.h5");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("was saved by 2 ranks but rank_00001.h5 is missing"), std::string::npos)
      << msg;
}

TEST_F(BadCheckpoint, CheckpointOfAnotherModel) {
  auto mlp = fully_shard(MlpNet());
  const std::string msg = error_of([&] { load_sharded_checkpoint(dir, mlp, nullptr, nullptr); });
  EXPECT_NE(msg.find(ckpt), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not match this model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Missing from the checkpoint: inp.weight"), std::string::npos) << msg;
}

TEST_F(BadCheckpoint, BadLatestMarker) {
  for (const std::string& content : {"step_99999999\n", "../../etc\n", "\n"}) {
    std::ofstream(dir + "/latest") << content;
    const std::string msg = load_error();
    EXPECT_NE(msg.find("the 'latest' marker " + dir + "/latest is bad"), std::string::npos) << msg;
  }
}

TEST_F(BadCheckpoint, FormatVersionFromTheFuture) {
  const std::string p = ckpt + "/rank_00000.h5";
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
  const int64_t v = 99;
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Fclose(f);
  const std::string msg = load_error();
  EXPECT_NE(msg.find(p + " has format_version 99; this build reads versions 1 to 1"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("newer fsdp"), std::string::npos) << msg;
}

// Sizes read from the file are checked before they divide or size anything: fuzzing
// found a checksum block smaller than one element (a division by zero). Its input, and
// the other sizes it found, replay in tests/fuzz/regressions/rank_file.
TEST_F(BadCheckpoint, AChecksumBlockSmallerThanAnElementIsRefused) {
  const std::string p = ckpt + "/rank_00001.h5";
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t ds = H5Dopen2(f, "flats/00000/param", H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  hid_t a = H5Aopen(ds, "fsdp_crc_block", H5P_DEFAULT);
  ASSERT_GE(a, 0);
  const int64_t two = 2;  // bytes, for 4-byte fp32 elements
  H5Awrite(a, H5T_NATIVE_INT64, &two);
  H5Aclose(a);
  H5Dclose(ds);
  H5Fclose(f);
  const std::string msg = load_error();
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find(p + ": dataset 'flats/00000/param' has checksum blocks of 2 bytes for "
                         "elements of 4 bytes: the file is corrupted"),
            std::string::npos)
      << msg;
}

// Links and attributes of shapes our writers never make (fuzzing met each): a group
// linked into itself, a dataset replaced by an external link to another file, and a
// one-value attribute holding several.
TEST_F(BadCheckpoint, LinkCyclesForeignLinksAndManyValuedAttributesAreRefused) {
  const std::string p0 = ckpt + "/rank_00000.h5", p1 = ckpt + "/rank_00001.h5";
  hid_t f = H5Fopen(p1.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Lcreate_hard(f, "/", f, "flats/loop", H5P_DEFAULT, H5P_DEFAULT), 0);
  H5Fclose(f);
  auto r = run_command({bin_dir() + "/fsdp-inspect", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(
      r.output.find(
          p1 + ":/flats/loop: this group is reached twice (a link cycle): the file is corrupted"),
      std::string::npos)
      << r.output;

  f = H5Fopen(p1.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Ldelete(f, "flats/loop", H5P_DEFAULT), 0);
  ASSERT_GE(H5Ldelete(f, "flats/00000/param", H5P_DEFAULT), 0);
  ASSERT_GE(H5Lcreate_external(p0.c_str(), "/flats/00000/param", f, "flats/00000/param",
                               H5P_DEFAULT, H5P_DEFAULT),
            0);
  H5Fclose(f);
  std::string msg = load_error();
  EXPECT_NE(msg.find(p1 + ": 'flats/00000/param' is an external link, not a dataset"),
            std::string::npos)
      << msg;

  f = H5Fopen(p0.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Adelete(f, "step"), 0);
  const hsize_t two = 2;
  hid_t space = H5Screate_simple(1, &two, nullptr);
  hid_t a = H5Acreate2(f, "step", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(a, 0);
  const int64_t steps[2] = {5, 6};
  H5Awrite(a, H5T_NATIVE_INT64, steps);
  H5Aclose(a);
  H5Sclose(space);
  H5Fclose(f);
  msg = load_error();
  EXPECT_NE(
      msg.find(p0 +
               ": attribute 'step' holds 2 values where one is expected: the file is corrupted"),
      std::string::npos)
      << msg;
}

TEST_F(BadCheckpoint, InspectDescribesAGoodCheckpoint) {
  auto r = run_command({bin_dir() + "/fsdp-inspect", dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* want : {"world_size = 2", "step = 5", "blocks.0.attn.qkv.weight [96, 32]",
                           "verified: 2 rank files"}) {
    EXPECT_NE(r.output.find(want), std::string::npos) << want << " not in:\n" << r.output;
  }
  auto missing = run_command({bin_dir() + "/fsdp-inspect", dir + "/nope"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* dir = std::getenv("FSDP_CRASH_SAVER_DIR")) {
    crash_saver(dir);
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
