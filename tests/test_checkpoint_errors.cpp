// Checkpoint errors: misuse of the API and bad files, each message naming the file or
// the value and what to do.
#include <fsdp/checkpoint.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"
#include "support/multirank.h"

#include <hdf5.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_errors_cases {

namespace {

// ---------------------------------------------------------------------------------
// Misuse of the API: each error says what is wrong and what to do.

TEST(CheckpointApi, MisuseGetsAMessageNamingTheFix) {
  const std::string dir = scratch_dir("api");
  auto model = fully_shard(gpt::GPT(small_gpt_config()));
  auto opt = make_adamw(model);
  ckpt::save_sharded_checkpoint(dir + "/noopt", model, nullptr, sample_state(1));
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
  ckpt::ExportOptions with_opt;
  with_opt.with_optimizer = true;
  ckpt::ExportOptions int_dtype;
  int_dtype.dtype = torch::kInt32;
  ckpt::TrainingState reserved = sample_state(1);
  reserved.model_attrs["step"] = int64_t{3};
  ckpt::SaveOptions negative;
  negative.keep_last = -1;
  const std::vector<Case> cases = {
      {[&] { ckpt::load_sharded_checkpoint(dir + "/noopt", model, &opt, nullptr); },
       "holds no optimizer state; pass nullptr as the optimizer to load only the model"},
      {[&] { ckpt::save_sharded_checkpoint(dir + "/x", model, &foreign, sample_state(1)); },
       "the optimizer does not hold the shard of unit ''. Build it from "
       "model.sharded_parameters() or fsdp::ShardParamGroups."},
      {[&] { ckpt::save_sharded_checkpoint(dir + "/x", model, &rms, sample_state(1)); },
       "this optimizer is none of them (pass nullptr to save or load without optimizer state)"},
      {[&] {
         ckpt::save_sharded_checkpoint(dir + "/x", model, nullptr, sample_state(1), negative);
       },
       "keep_last -1 is negative; use 0 to keep every checkpoint"},
      {[&] { ckpt::export_consolidated(dir + "/e.h5", model, nullptr, sample_state(1), with_opt); },
       "export_consolidated: with_optimizer needs the optimizer"},
      {[&] {
         ckpt::export_consolidated(dir + "/e.h5", model, nullptr, sample_state(1), int_dtype);
       },
       "is not supported; use float32, bfloat16 or float16"},
      {[&] { ckpt::export_consolidated(dir + "/e.h5", model, nullptr, reserved); },
       "model attribute 'step' collides with a reserved root attribute"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_of(c.call);
    EXPECT_NE(msg.find(c.message), std::string::npos) << "want: " << c.message << "\ngot: " << msg;
  }
  // A checkpoint with optimizer state, loaded into an optimizer with other param groups.
  ckpt::save_sharded_checkpoint(dir + "/opt", model, &opt, sample_state(1));
  const std::string msg =
      error_of([&] { ckpt::load_sharded_checkpoint(dir + "/opt", model, &two_groups, nullptr); });
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
      ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(5));
    });
    ckpt = dir + "/step_00000005";
  }
  std::string load_error() {
    auto model = fully_shard(gpt::GPT(small_gpt_config()));
    return error_of([&] { ckpt::load_sharded_checkpoint(dir, model, nullptr, nullptr); });
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
  const std::string msg =
      error_of([&] { ckpt::load_sharded_checkpoint(dir, mlp, nullptr, nullptr); });
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
  EXPECT_NE(msg.find(p + " has format_version 99; this build reads versions 1 to 2"),
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

}  // namespace test_checkpoint_errors_cases
