// Safetensors exports and imports of a sharded model: live and offline byte for byte,
// values as torch rounds them, split over files, imported at another world size. (The
// writer and reader against the format's rules: test_safetensors.)
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>

#include "support/checkpoint_helpers.h"
#include "support/hard_values.h"
#include "support/models.h"
#include "support/multirank.h"

#include "../checkpoint/format/safetensors/safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_safetensors_cases {

namespace {

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
    auto model = fully_shard(HardValues(), options_for(pg, wrap::never_wrap_policy()));
    ckpt::save_sharded_checkpoint(dir + "/sharded", model, nullptr, sample_state(4));
    for (auto [dtype, tag] :
         {std::pair{torch::kBFloat16, "bf16"}, std::pair{torch::kFloat16, "fp16"},
          std::pair{torch::kFloat32, "fp32"}}) {
      ckpt::SafetensorsOptions so;
      so.dtype = dtype;
      ckpt::export_safetensors(dir + "/live_" + tag, model, sample_state(4), so);
      so.max_shard_size = 64;  // w (128 or 256 bytes) and b in files of their own
      ckpt::export_safetensors(dir + "/live_split_" + tag, model, sample_state(4), so);
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
    ckpt::SafetensorsOptions so;
    so.max_shard_size = 40000;
    ckpt::export_safetensors(dir + "/st", model, sample_state(2), so);
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
    ckpt::SafetensorsOptions so;
    so.max_shard_size = 40000;  // several files and an index
    ckpt::export_safetensors(dir + "/fp32", model, sample_state(2), so);
    so.dtype = torch::kBFloat16;
    ckpt::export_safetensors(dir + "/bf16", model, sample_state(2), so);
    ckpt::export_consolidated(dir + "/ref.h5", model, nullptr, sample_state(2));
  });
  gpt::GPT reference(small_gpt_config());
  ckpt::load_consolidated(dir + "/ref.h5", *reference);
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(99);  // other initial weights: all of them must be replaced
    auto model =
        fully_shard(gpt::GPT(small_gpt_config()), options_for(pg, wrap::never_wrap_policy()));
    auto report = ckpt::import_consolidated(dir + "/fp32", model);
    EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
    expect_params_match(full_state_dict(model), *reference, 0.0);
    ckpt::import_consolidated(dir + "/bf16/model.safetensors.index.json", model);
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
  ckpt::load_consolidated(dir + "/fp32", *plain);
  for (const auto& [n, t] : named_parameters_clean(*plain)) {
    for (const auto& [m, r] : named_parameters_clean(*reference)) {
      if (n == m) EXPECT_TRUE(torch::equal(t, r)) << n;
    }
  }
  auto attrs = ckpt::consolidated_attributes(dir + "/fp32");
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
      ckpt::import_consolidated(dir + "/ints", hv, ckpt::LoadOptions{true, false});
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
    ckpt::load_consolidated(dir + "/fp32", *mlp);
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
  ckpt::SafetensorsOptions so;
  so.dtype = torch::kInt64;
  try {
    ckpt::export_safetensors(dir + "/x", model, {}, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("use float32, bfloat16 or float16"),
              std::string::npos);
  }
  so.dtype = torch::kFloat32;
  so.max_shard_size = 0;
  try {
    ckpt::export_safetensors(dir + "/x", model, {}, so);
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
      ckpt::export_safetensors(dir + "/y", m, {}, so);
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

}  // namespace

namespace {

// SafetensorsOptions::name_for and ::transpose write another framework's layout (GPT-2's,
// for train_gpt --export-hf), and a model attribute "hf_config" becomes config.json beside
// the weights and not __metadata__; a transposed tensor that is not 2-D and a non-string
// hf_config are refused.
TEST(SafetensorsExport, AnotherLayoutRenamesTransposesAndWritesConfigJson) {
  const std::string dir = scratch_dir("st_layout");
  auto model = fully_shard(MlpNet());  // inp.weight is [32, 16]
  std::map<std::string, torch::Tensor> full;
  for (auto& [name, t] : full_state_dict(model)) full[name] = t;
  ckpt::SafetensorsOptions so;
  so.name_for = [](const std::string& fqn) { return fqn == "out.bias" ? "" : "x." + fqn; };
  so.transpose = [](const std::string& fqn) { return fqn == "inp.weight"; };
  ckpt::TrainingState state = sample_state(3);
  state.model_attrs["hf_config"] = std::string("{\"model_type\": \"mlp\"}\n");
  ckpt::export_safetensors(dir + "/a", model, state, so);
  std::ifstream config(dir + "/a/config.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(config), {}), "{\"model_type\": \"mlp\"}\n");
  st::Reader r(dir + "/a");
  EXPECT_EQ(r.metadata().count("hf_config"), 0u);
  EXPECT_EQ(r.entries().count("out.bias") + r.entries().count("x.out.bias"), 0u) << "left out";
  ASSERT_EQ(r.entries().count("x.inp.weight"), 1u);
  EXPECT_EQ(r.entries().at("x.inp.weight").shape, (std::vector<int64_t>{16, 32}));
  at::Tensor w = at::empty({16, 32}, at::kFloat);
  r.read("x.inp.weight", 0, w.nbytes(), w.data_ptr());
  EXPECT_TRUE(torch::equal(w, full.at("inp.weight").t())) << "written transposed";

  so.transpose = [](const std::string& fqn) { return fqn == "inp.bias"; };
  try {
    ckpt::export_safetensors(dir + "/b", model, state, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("export_safetensors: SafetensorsOptions::transpose picks 'inp.bias', "
                        "which has 1 dimensions; only 2-D tensors transpose"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  so.transpose = nullptr;
  state.model_attrs["hf_config"] = int64_t{1};
  try {
    ckpt::export_safetensors(dir + "/c", model, state, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("model attribute hf_config must be a string (a Hugging Face config.json)"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace

}  // namespace test_checkpoint_safetensors_cases
