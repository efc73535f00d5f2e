// Consolidated checkpoints: export and import at other world sizes, files of other
// writers, strict loads, offline consolidation equal to the live export byte for byte,
// rounding as torch does, and h5py reading the file.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>

#include "support/checkpoint_helpers.h"
#include "support/hard_values.h"
#include "support/models.h"
#include "support/multirank.h"

#include <hdf5.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_consolidated_cases {

namespace {

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
    ckpt::ExportOptions eo;
    eo.with_optimizer = true;
    ckpt::export_consolidated(dir + "/full.h5", model, &opt, sample_state(2), eo);
    const auto mem = model.memory_stats();
    // One flat parameter gathered at a time: the peak is the largest one, and all is freed.
    int64_t largest = 0;
    for (const auto& f : fsdp::detail::flat_params(model))
      largest = std::max(largest, f.padded_numel * 4);
    EXPECT_EQ(mem.checkpoint_buffers.peak, largest);
    EXPECT_EQ(mem.checkpoint_buffers.current, 0);
    eo.with_optimizer = false;
    eo.dtype = torch::kBFloat16;
    ckpt::export_consolidated(dir + "/full_bf16.h5", model, nullptr, sample_state(2), eo);
    auto full = full_state_dict(model);
    if (pg.rank() == 0) {
      gpt::GPT plain(small_gpt_config());
      auto r = ckpt::load_consolidated(dir + "/full.h5", *plain);
      EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
      for (const auto& [name, p] : named_parameters_clean(*plain)) {
        EXPECT_TRUE(torch::equal(as_map(full).at(name), p)) << name;
      }
      gpt::GPT plain16(small_gpt_config());
      ckpt::load_consolidated(dir + "/full_bf16.h5", *plain16);
      for (const auto& [name, p] : named_parameters_clean(*plain16)) {
        EXPECT_TRUE(torch::equal(as_map(full).at(name).to(torch::kBFloat16).to(torch::kFloat32), p))
            << name << ": bf16 export differs from torch's rounding";
      }
      auto attrs = ckpt::consolidated_attributes(dir + "/full_bf16.h5");
      EXPECT_EQ(std::get<std::string>(attrs.at("format")), "fsdp.consolidated");
      EXPECT_EQ(std::get<std::string>(attrs.at("dtype")), "bfloat16");
      EXPECT_EQ(std::get<int64_t>(attrs.at("step")), 2);
      EXPECT_EQ(std::get<int64_t>(attrs.at("n_layer")), small_gpt_config().n_layer);
    }
  });
  // Import into a sharded model at another world size: the same values.
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(11);
    auto model =
        fully_shard(gpt::GPT(small_gpt_config()), options_for(pg, wrap::every_kth_policy(2)));
    const int64_t before = model.comm_stats().total.total_bytes();  // fully_shard's broadcast
    auto r = ckpt::import_consolidated(dir + "/full.h5", model);
    EXPECT_TRUE(r.missing.empty() && r.unexpected.empty());
    EXPECT_EQ(model.comm_stats().total.total_bytes(), before) << "import must not communicate";
    auto full = as_map(full_state_dict(model));
    gpt::GPT plain(small_gpt_config());
    ckpt::load_consolidated(dir + "/full.h5", *plain);
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
  ckpt::ExportOptions eo;
  eo.dtype = torch::kBFloat16;
  ckpt::export_consolidated(dir + "/bf16.h5", model, nullptr, sample_state(1), eo);
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
  ckpt::load_consolidated(p, *plain);
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
  ckpt::export_consolidated(dir + "/gpt.h5", model, nullptr, sample_state(0));
  // An MLP has none of the GPT's names.
  MlpNet mlp;
  const std::string msg = error_of([&] { ckpt::load_consolidated(dir + "/gpt.h5", *mlp); });
  EXPECT_NE(msg.find("does not match this model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("inp.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("out.bias"), std::string::npos) << msg;  // every name is listed
  EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lm_head.weight"), std::string::npos) << msg;
  ckpt::LoadOptions lo;
  lo.strict = false;
  auto r = ckpt::load_consolidated(dir + "/gpt.h5", *mlp, lo);
  EXPECT_EQ(r.missing.size(), named_parameters_clean(*mlp).size());
  EXPECT_EQ(r.unexpected.size(), named_parameters_clean(*model).size());
  // Same names, other shapes: always an error, naming the shapes.
  auto cfg = small_gpt_config();
  cfg.d_model = 64;
  gpt::GPT wide(cfg);
  const std::string shape_msg =
      error_of([&] { ckpt::load_consolidated(dir + "/gpt.h5", *wide, lo); });
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
    ckpt::save_sharded_checkpoint(dir, model, &opt, sample_state(2));
    ckpt::ExportOptions eo;
    ckpt::export_consolidated(dir + "/live_fp32.h5", model, &opt, sample_state(2), eo);
    eo.with_optimizer = true;
    eo.dtype = torch::kFloat16;
    ckpt::export_consolidated(dir + "/live_fp16_opt.h5", model, &opt, sample_state(2), eo);
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

TEST(ConsolidatedCheckpoint, ExportsRoundLikeTorchOnTiesSubnormalsInfinitiesAndNaN) {
  const std::string dir = scratch_dir("ties");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(HardValues(), options_for(pg, wrap::never_wrap_policy()));
    ckpt::save_sharded_checkpoint(dir + "/sharded", model, nullptr, sample_state(0));
    ckpt::ExportOptions eo;
    for (auto [dtype, tag] :
         {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"},
          std::pair{torch::kFloat32, "fp32"}}) {
      eo.dtype = dtype;
      ckpt::export_consolidated(dir + "/live_" + tag + ".h5", model, nullptr, sample_state(0), eo);
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
    ckpt::load_consolidated(dir + "/off_" + std::string(tag) + ".h5", *back);
    auto want = w.to(dtype).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(back->w.detach().isnan(), want.isnan())) << tag;
    EXPECT_TRUE(
        torch::equal(back->w.detach().nan_to_num(0, 1e38, -1e38), want.nan_to_num(0, 1e38, -1e38)))
        << tag << ": widening on load is not exact";
  }
}

// ---------------------------------------------------------------------------------
// h5py reads the consolidated file: names, shapes and values match the C++ side.

TEST(ConsolidatedCheckpoint, H5pyReadsNamesShapesAndValues) {
  const std::string dir = scratch_dir("h5py");
  torch::manual_seed(3);
  auto model = fully_shard(gpt::GPT(small_gpt_config()));
  ckpt::export_consolidated(dir + "/gpt.h5", model, nullptr, sample_state(9));
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

}  // namespace

}  // namespace test_checkpoint_consolidated_cases
