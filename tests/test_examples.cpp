// The example programs as a user runs them: train_gpt under fsdp-run and torchrun,
// fsdp-run's failure handling, and train_gpt's errors for bad input.
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <tuple>

using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_examples_cases {

namespace {

std::string bin(const std::string& name) { return bin_dir() + "/" + name; }

std::string temp_path(const std::string& stem) {
  char tmpl[256];
  std::snprintf(tmpl, sizeof(tmpl), "/tmp/fsdp_%s_XXXXXX", stem.c_str());
  int fd = mkstemp(tmpl);
  close(fd);
  return tmpl;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream f(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// A small, fast configuration shared by the runs that are compared; on the CPU unless
// `device` says otherwise (the losses compared bit for bit are the CPU's).
std::vector<std::string> small_run(const std::string& log, int steps = 8,
                                   const std::string& device = "cpu",
                                   const std::string& program = "train_gpt") {
  return {bin(program),
          "--device",
          device,
          "--steps",
          std::to_string(steps),
          "--batch-size",
          "12",
          "--n-layer",
          "2",
          "--d-model",
          "32",
          "--n-head",
          "2",
          "--block-size",
          "16",
          "--log-jsonl",
          log,
          "--seed",
          "7"};
}

std::vector<double> losses(const std::string& log) {
  std::vector<double> out;
  for (const auto& j : read_jsonl(log)) out.push_back(j.at("loss").get<double>());
  return out;
}

// ---- --device (examples/common/device.h over fsdp::choose_device) ----------------------

const std::string kNotADevice =
    " is not a device; use cpu, cuda, cuda:N (N = a GPU's index, 0-based) or auto";

void expect_usage_error(const std::vector<std::string>& cmd, const std::string& message) {
  auto r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(message), std::string::npos) << "expected: " << message << "\n"
                                                       << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;  // no backtrace
}

// A value that names no device is refused by every example, naming it and the choices.
TEST(Device, AnUnknownValueExitsTwoNamingItAndTheChoices) {
  expect_usage_error({bin("train_gpt"), "--device", "tpu"},
                     "train_gpt: error: --device tpu" + kNotADevice);
  expect_usage_error({bin("train_gpt"), "--device", "cuda:-1"},
                     "train_gpt: error: --device cuda:-1" + kNotADevice);
  expect_usage_error({bin("train_mlp"), "--device", "gpu"},
                     "train_mlp: error: --device gpu" + kNotADevice);
  expect_usage_error({bin("generate"), "--weights", "/nonexistent/w.h5", "--prompt", "a",
                      "--max-new-tokens", "1", "--device", "cuda:x"},
                     "generate: error: --device cuda:x" + kNotADevice);
}

// --device cuda where it cannot run exits 2 before any training, naming the value and the
// fix: a LibTorch without CUDA, no GPU visible, a GPU index past the last one, or more
// ranks on the machine than GPUs.
TEST(Device, CudaThatCannotRunExitsTwoNamingTheValueAndTheFix) {
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  const std::string past = "cuda:" + std::to_string(std::max<int64_t>(gpus, 7));
  if (!FSDP_TEST_HAVE_CUDA) {
    const std::string fix =
        ": this fsdp-libtorch is built against a LibTorch without CUDA (a CPU-only build, e.g. "
        "Debian's libtorch); rebuild it against a CUDA LibTorch (PyPI's torch, or pytorch.org's "
        "CUDA LibTorch) or use --device cpu";
    expect_usage_error({bin("train_gpt"), "--device", "cuda"},
                       "train_gpt: error: --device cuda" + fix);
    expect_usage_error({bin("train_mlp"), "--device", past},
                       "train_mlp: error: --device " + past + fix);
  } else if (gpus == 0) {
    const std::string fix =
        ": no CUDA device is visible (torch::cuda::device_count() = 0); run on a GPU machine "
        "(check nvidia-smi and CUDA_VISIBLE_DEVICES) or use --device cpu";
    expect_usage_error({bin("train_gpt"), "--device", "cuda"},
                       "train_gpt: error: --device cuda" + fix);
    expect_usage_error({bin("train_gpt"), "--device", past},
                       "train_gpt: error: --device " + past + fix);
    expect_usage_error({bin("train_mlp"), "--device", "cuda"},
                       "train_mlp: error: --device cuda" + fix);
  }
  if (FSDP_TEST_HAVE_CUDA && gpus > 0) {
    expect_usage_error({bin("train_gpt"), "--device", past},
                       "train_gpt: error: --device " + past + ": there is no GPU " +
                           std::to_string(std::max<int64_t>(gpus, 7)) + "; ");
    // More ranks than GPUs: NCCL would refuse two ranks on one GPU, so --device cuda does.
    const std::string ranks = std::to_string(gpus + 1);
    auto r = run_command({bin("fsdp-run"), "--nproc", ranks, "--", bin("train_gpt"), "--device",
                          "cuda", "--steps", "1"});
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(
        r.output.find("train_gpt: error: --device cuda: " + ranks +
                      " ranks run on this machine (LOCAL_WORLD_SIZE) but " + std::to_string(gpus)),
        std::string::npos)
        << r.output;
  }
  expect_usage_error({bin("generate"), "--weights", "/nonexistent/w.h5", "--prompt", "a",
                      "--max-new-tokens", "1", "--device", past},
                     "generate: error: --device " + past + ": ");
}

// --device cpu trains on the CPU whatever the machine has; the summary says so.
TEST(Device, CpuIsHonouredAndNamedInTheSummary) {
  auto log = temp_path("dcpu");
  auto r = run_command(small_run(log, 2, "cpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train_gpt: device cpu (--device cpu), collectives over none"),
            std::string::npos)
      << r.output;
  std::remove(log.c_str());
}

#define SKIP_WITHOUT_GPUS(n)                                               \
  if (static_cast<int64_t>(torch::cuda::device_count()) < (n))             \
  GTEST_SKIP() << "no CUDA device visible for this test (it needs " << (n) \
               << ", torch::cuda::device_count() = "                       \
               << static_cast<int>(torch::cuda::device_count())            \
               << (FSDP_TEST_HAVE_CUDA ? "" : "; this LibTorch has no CUDA") << ")"

// train_gpt on the CPU at world 1 against train_gpt --device cuda on `gpus` ranks (under
// fsdp-run from 2): the GPU run's output names `expect`, its loss falls, and each step's
// loss is within 1e-3 of the CPU's.
void expect_gpu_follows_cpu(int gpus, const std::string& expect,
                            const std::string& program = "train_gpt") {
  auto log_cpu = temp_path("gcpu"), log_gpu = temp_path("ggpu");
  auto rc = run_command(small_run(log_cpu, 8, "cpu", program));
  ASSERT_EQ(rc.exit_code, 0) << rc.output;
  std::vector<std::string> launch;
  if (gpus > 1) launch = {bin("fsdp-run"), "--nproc", std::to_string(gpus), "--"};
  auto args = small_run(log_gpu, 8, "cuda", program);
  launch.insert(launch.end(), args.begin(), args.end());
  auto rg = run_command(launch);
  ASSERT_EQ(rg.exit_code, 0) << rg.output;
  EXPECT_NE(rg.output.find(expect), std::string::npos) << rg.output;
  auto c = losses(log_cpu), g = losses(log_gpu);
  ASSERT_EQ(c.size(), 8u);
  ASSERT_EQ(g.size(), 8u);
  EXPECT_LT(g.back(), g.front());
  for (size_t i = 0; i < c.size(); ++i) EXPECT_NEAR(g[i], c[i], 1e-3 * c[i]) << "step " << i + 1;
  std::remove(log_cpu.c_str());
  std::remove(log_gpu.c_str());
}

// train_gpt --device cuda at world 1 trains (the loss falls) and follows the CPU's losses.
TEST(Cuda, TrainGptOnTheGpuFollowsTheCpuLosses_CUDA) {
  SKIP_WITHOUT_GPUS(1);
  expect_gpu_follows_cpu(1, "train_gpt: device cuda:0 (--device cuda)");
}

// train_llama --device cuda at world 1 likewise (the Llama's rotary tables, RMSNorm in fp32
// and grouped-query attention on the GPU).
TEST(Cuda, TrainLlamaOnTheGpuFollowsTheCpuLosses_CUDA) {
  SKIP_WITHOUT_GPUS(1);
  expect_gpu_follows_cpu(1, "train_llama: device cuda:0 (--device cuda)", "train_llama");
}

// Two ranks on two GPUs under fsdp-run (NCCL) follow one rank on the CPU.
TEST(Cuda, TrainGptOnTwoGpusUnderFsdpRunFollowsTheCpuLosses_CUDA) {
  SKIP_WITHOUT_GPUS(2);
  expect_gpu_follows_cpu(2, "collectives over nccl");
}

// --pipeline-stages: the GPT's layers (embeddings, blocks, head) in stages over the
// ranks, alone and with two data-parallel ranks a stage, GPipe and 1F1B, gradients clipped
// across the stages (train_gpt's default --clip-grad 1): the losses of one process.
TEST(TrainGpt, PipelineStagesGiveTheLossesOfOneProcess) {
  auto run_at = [](int nproc, const std::vector<std::string>& extra, const std::string& stem) {
    const std::string log = temp_path(stem);
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", std::to_string(nproc), "--"};
    auto args = small_run(log);
    args[6] = "16";  // --batch-size: 2 replicas x 8 micro-batches divide it
    args[8] = "4";   // --n-layer: six layers with the embeddings and the head
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::make_pair(losses(log), r.output);
  };
  const auto [one, out1] = run_at(1, {}, "pp_w1");
  ASSERT_EQ(one.size(), 8u) << out1;
  // A DeepSpeed config's pipeline section drives the same: 2 stages over 4 ranks, its
  // gradient_accumulation_steps the micro-batches.
  const std::string ds = temp_path("pp_ds") + ".json";
  std::ofstream(ds) << R"({"train_batch_size": 16, "gradient_accumulation_steps": 4,
                          "pipeline": {"stages": 2, "partition": "parameters"}})";
  const std::vector<std::tuple<int, std::string, std::vector<std::string>>> layouts = {
      {2, "2 stages (1f1b, 4", {"--pipeline-stages", "2"}},
      {2, "2 stages (gpipe, 4", {"--pipeline-stages", "2", "--pipeline-schedule", "gpipe"}},
      {4, "2 stages (1f1b, 2", {"--pipeline-stages", "2", "--micro-batches", "2"}},
      {4, "4 stages (1f1b, 8", {"--pipeline-stages", "4", "--partition", "uniform"}},
      {4, "2 stages (1f1b, 4", {"--deepspeed-config", ds}}};
  {
    // 2 ranks at 2 stages: one replica of 4 micro-batches, which 18 sequences do not fill.
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
    auto args = small_run(temp_path("pp_bad"));
    args[6] = "18";
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), {"--pipeline-stages", "2"});
    auto r = run_command(cmd);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("--batch-size 18 must be divisible by 1 data-parallel ranks x "
                            "--micro-batches 4; try --batch-size 20"),
              std::string::npos)
        << r.output;
  }
  for (const auto& [nproc, expected, extra] : layouts) {
    const auto [got, out] = run_at(nproc, extra, "pp_layout");
    EXPECT_NE(out.find("train_gpt: pipeline of " + expected + " micro-batches)"), std::string::npos)
        << out;
    ASSERT_EQ(got.size(), one.size()) << out;
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(got[i], one[i], 1e-6 * one[i])
          << "step " << i + 1 << " at " << nproc << " ranks, " << extra.back();
  }
}

// What a pipelined run does not do yet is refused by flag, before any rank starts.
TEST(TrainGpt, PipelineStagesRefuseWhatTheyDoNotDoYet) {
  expect_usage_error({bin("train_gpt"), "--pipeline-stages", "2", "--grad-accum", "2"},
                     "--grad-accum 2 with --pipeline-stages 2: a pipeline's micro-batches are its "
                     "gradient accumulation; give --micro-batches 2 instead");
  expect_usage_error({bin("train_gpt"), "--pipeline-schedule", "zb"},
                     "--pipeline-schedule 'zb' is not a pipeline schedule; expected gpipe or 1f1b");
  expect_usage_error({bin("train_gpt"), "--pipeline-stages", "2"},
                     "--pipeline-stages 2 does not divide the world size 1");
  expect_usage_error({bin("train_gpt"), "--pipeline-stages", "0"},
                     "--pipeline-stages 0 must be at least 1");
  expect_usage_error({bin("train_gpt"), "--micro-batches", "-1"},
                     "--micro-batches -1 must be 0 (2 x --pipeline-stages) or positive");
  expect_usage_error({bin("train_llama"), "--pipeline-stages", "2", "--tie-embeddings"},
                     "--pipeline-stages 2 with --tie-embeddings (the embedding would be the first "
                     "stage's and lm_head the last's)");
}

// A pipelined run's checkpoint holds the GPT's own names (the checkpoint contract), and
// resumes without a pipeline at another world size, and the reverse, with the losses of
// one uninterrupted process.
TEST(TrainGpt, PipelinedCheckpointsResumeAtAnotherLayout) {
  auto run_at = [&](int nproc, const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", std::to_string(nproc), "--"};
    auto args = small_run(log, 4);
    args[6] = "16";  // --batch-size: 2 replicas x 4 micro-batches divide it
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  const std::string log1 = temp_path("ppck_w1");
  run_at(1, {}, log1);
  const auto one = losses(log1);
  ASSERT_EQ(one.size(), 4u);
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> layouts = {
      {{"4", "--pipeline-stages", "2"}, {"2"}},   // 2 stages x FULL_SHARD 2, then FULL_SHARD 2
      {{"2"}, {"2", "--pipeline-stages", "2"}}};  // FULL_SHARD 2, then 2 stages
  for (const auto& [first, second] : layouts) {
    const std::string dir = temp_path("ppck_dir"), log_a = temp_path("ppck_a"),
                      log_b = temp_path("ppck_b");
    std::filesystem::remove(dir);  // a name for the checkpoints' directory, which the run makes
    std::vector<std::string> a(first.begin() + 1, first.end()), b(second.begin() + 1, second.end());
    for (auto* v : {&a, &b}) v->insert(v->end(), {"--save-dir", dir});
    a.insert(a.end(), {"--stop-at", "2"});
    b.push_back("--resume");
    run_at(std::stoi(first[0]), a, log_a);
    if (first.size() > 1) {
      auto r = run_command({bin("fsdp-inspect"), dir});
      EXPECT_NE(r.output.find("pipeline_stages = 2"), std::string::npos) << r.output;
      for (const char* name : {"      wte.weight ", "      blocks.1.attn.qkv.weight ",
                               "      ln_f.bias ", "      lm_head.weight "})
        EXPECT_NE(r.output.find(name), std::string::npos) << name << "\n" << r.output;
    }
    const std::string out = run_at(std::stoi(second[0]), b, log_b);
    EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
    const auto got = losses(log_b);
    ASSERT_EQ(got.size(), 2u) << out;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], one[i + 2], 1e-6 * one[i + 2])
          << "step " << i + 3 << " after " << first.back() << " then " << second.back();
    std::filesystem::remove_all(dir);
  }
}

namespace {

// The "eval loss at step N: X" lines of a run, by step.
std::map<int64_t, double> eval_losses(const std::string& output) {
  std::map<int64_t, double> out;
  const std::regex line("eval loss at step ([0-9]+): ([-+.eE0-9]+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it)
    out[std::stoll((*it)[1])] = std::stod((*it)[2]);
  return out;
}

std::string file_contents(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A safetensors file's header (its JSON) and its data as floats (an fp32 export).
std::pair<std::string, std::vector<float>> safetensors_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  std::vector<char> rest((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<float> data(rest.size() / sizeof(float));
  std::memcpy(data.data(), rest.data(), data.size() * sizeof(float));
  return {header, data};
}

}  // namespace

// A pipelined run evaluates (--eval-text), starts from consolidated weights
// (--init-from), saves in the background (--async-save) and exports (--consolidate-to,
// and --export-hf in GPT-2's layout) as the same run without stages does: the same eval
// losses, and the same files holding the same weights.
TEST(TrainGpt, PipelineStagesEvaluateImportSaveInTheBackgroundAndExportAsOneProcess) {
  const std::string text = temp_path("ppx_text");
  {
    std::ofstream f(text);
    for (int i = 0; i < 200; ++i) f << "a pipeline evaluates this line, number " << i << "\n";
  }
  auto run_at = [&](int nproc, const std::vector<std::string>& extra) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", std::to_string(nproc), "--"};
    auto args = small_run(temp_path("ppx_log"), 2);
    args[6] = "16";  // --batch-size: 4 micro-batches
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    cmd.insert(cmd.end(), {"--eval-text", text});
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::make_pair(eval_losses(r.output), r.output);
  };
  const std::string ca = temp_path("ppx_ca") + ".h5", cb = temp_path("ppx_cb") + ".h5",
                    ea = temp_path("ppx_ea"), eb = temp_path("ppx_eb"), sd = temp_path("ppx_sd");
  for (const auto& d : {ea, eb, sd}) std::filesystem::remove(d);  // names for what the runs make
  const auto [a, out_a] = run_at(1, {"--consolidate-to", ca, "--export-hf", ea});
  const auto [b, out_b] = run_at(2, {"--pipeline-stages", "2", "--consolidate-to", cb,
                                     "--export-hf", eb, "--save-dir", sd, "--async-save"});
  ASSERT_EQ(a.size(), 2u) << out_a;  // steps 0 and 2
  ASSERT_EQ(b.size(), 2u) << out_b;
  for (const auto& [step, loss] : a) EXPECT_NEAR(b.at(step), loss, 1e-6 * loss) << step;
  // The Hugging Face exports: the same tensors (names, shapes, dtypes; the order of the
  // stages' units may differ), the same metadata and config.json, and the same weights up
  // to the order of additions.
  const auto [ha, da] = safetensors_of(ea + "/model.safetensors");
  const auto [hb, db] = safetensors_of(eb + "/model.safetensors");
  const auto ja = nlohmann::json::parse(ha), jb = nlohmann::json::parse(hb);
  EXPECT_EQ(ja.at("__metadata__"), jb.at("__metadata__"));
  ASSERT_EQ(ja.size(), jb.size());
  EXPECT_TRUE(ja.contains("transformer.h.1.attn.c_attn.weight")) << ha;
  double worst = 0;
  for (const auto& [name, t] : ja.items()) {
    if (name == "__metadata__") continue;
    ASSERT_TRUE(jb.contains(name)) << name;
    const auto& u = jb.at(name);
    EXPECT_EQ(t.at("dtype"), u.at("dtype")) << name;
    EXPECT_EQ(t.at("shape"), u.at("shape")) << name;
    const auto oa = t.at("data_offsets").get<std::vector<size_t>>();
    const auto ob = u.at("data_offsets").get<std::vector<size_t>>();
    ASSERT_EQ(oa[1] - oa[0], ob[1] - ob[0]) << name;
    for (size_t i = 0; i < (oa[1] - oa[0]) / 4; ++i)
      worst = std::max(worst, std::abs(double(da[oa[0] / 4 + i]) - db[ob[0] / 4 + i]));
  }
  EXPECT_LT(worst, 1e-5);
  EXPECT_EQ(file_contents(ea + "/config.json"), file_contents(eb + "/config.json"));
  EXPECT_FALSE(std::filesystem::exists(eb + ".stages.tmp"));
  // The background save: a checkpoint of both stages.
  auto inspect = run_command({bin("fsdp-inspect"), sd});
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("pipeline_stages = 2"), std::string::npos) << inspect.output;
  // The consolidated files hold those weights: started from them, both layouts evaluate
  // as the runs ended, and train alike.
  const auto [c, out_c] = run_at(2, {"--pipeline-stages", "2", "--init-from", cb});
  const auto [d, out_d] = run_at(1, {"--init-from", ca});
  EXPECT_NE(out_c.find("initial weights from " + cb), std::string::npos) << out_c;
  ASSERT_EQ(c.size(), 2u) << out_c;
  ASSERT_EQ(d.size(), 2u) << out_d;
  EXPECT_NEAR(c.at(0), b.at(2), 1e-6 * b.at(2));
  EXPECT_NEAR(d.at(0), a.at(2), 1e-6 * a.at(2));
  EXPECT_NEAR(c.at(2), d.at(2), 1e-6 * d.at(2));
  for (const auto& p : {ca, cb, text}) std::filesystem::remove(p);
  for (const auto& p : {ea, eb, sd}) std::filesystem::remove_all(p);
}

// --steps 0, a conversion: a fresh run saves its initial weights (step 0) and trains
// nothing; resumed from that checkpoint, a run gives a fresh run's losses. A resumed run of
// zero steps evaluates the checkpoint and writes no new one. The same through pipeline
// stages.
TEST(TrainGpt, StepsZeroLoadsEvaluatesAndSavesWithoutTraining) {
  const std::string text = temp_path("s0_text");
  {
    std::ofstream f(text);
    for (int i = 0; i < 100; ++i) f << "zero steps evaluate this line, number " << i << "\n";
  }
  for (const std::string stages : {"1", "2"}) {
    SCOPED_TRACE("--pipeline-stages " + stages);
    auto run_at = [&](const std::string& log, int steps, const std::vector<std::string>& extra) {
      std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
      auto args = small_run(log, steps);
      cmd.insert(cmd.end(), args.begin(), args.end());
      cmd.insert(cmd.end(), {"--pipeline-stages", stages, "--eval-text", text});
      cmd.insert(cmd.end(), extra.begin(), extra.end());
      auto r = run_command(cmd);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      return r;
    };
    const std::string dir = temp_path("s0_ck"), zero = temp_path("s0_log0"),
                      fresh = temp_path("s0_log1"), resumed = temp_path("s0_log2"),
                      again = temp_path("s0_log3");
    std::filesystem::remove(dir);
    const auto convert = run_at(zero, 0, {"--save-dir", dir});
    EXPECT_NE(convert.output.find("--steps 0: no training; load, evaluate and write only"),
              std::string::npos)
        << convert.output;
    EXPECT_TRUE(losses(zero).empty()) << "no step was logged";
    ASSERT_EQ(eval_losses(convert.output).size(), 1u) << convert.output;  // at step 0
    ASSERT_TRUE(std::filesystem::is_directory(dir + "/step_00000000")) << convert.output;
    // Resumed from step 0, two steps are a fresh run's two steps.
    run_at(fresh, 2, {});
    const auto continued = run_at(resumed, 2, {"--save-dir", dir, "--resume"});
    EXPECT_EQ(losses(resumed), losses(fresh)) << continued.output;
    ASSERT_EQ(losses(fresh).size(), 2u);
    // Zero steps on a resumed checkpoint: evaluated at its step, nothing new written.
    const auto look = run_at(again, 0, {"--save-dir", dir, "--resume"});
    EXPECT_NE(look.output.find("at step 2"), std::string::npos) << look.output;
    const auto evals = eval_losses(look.output);
    ASSERT_EQ(evals.size(), 1u) << look.output;
    // Evaluated once (nothing trained between), printed with 9 digits: the same to 1e-8.
    size_t printed = 0;
    for (size_t at = look.output.find("eval loss at step"); at != std::string::npos;
         at = look.output.find("eval loss at step", at + 1))
      ++printed;
    EXPECT_EQ(printed, 1u) << look.output;
    EXPECT_NEAR(evals.at(2), eval_losses(continued.output).at(2), 1e-8 * evals.at(2))
        << look.output;
    size_t entries = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      entries += e.path().filename().string().rfind("step_", 0) == 0;
    EXPECT_EQ(entries, 2u) << "step_0 and step_2 only";
    std::filesystem::remove_all(dir);
    for (const auto& p : {zero, fresh, resumed, again}) std::filesystem::remove(p);
  }
  std::filesystem::remove(text);
}

// Within stages, as without: activation checkpointing (each block recomputed in its
// backward, which the trace shows), host offload of the optimizer's state, and bf16
// compute give the losses of the same run without stages.
TEST(TrainGpt, PipelineStagesCheckpointOffloadAndComputeInBf16AsOneProcess) {
  const std::vector<std::vector<std::string>> modes = {
      {"--activation-checkpointing", "all"}, {"--cpu-offload"}, {"--precision", "bf16"}};
  for (const auto& mode : modes) {
    auto run_at = [&](int nproc, const std::vector<std::string>& extra) {
      const std::string log = temp_path("ppm_log");
      std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", std::to_string(nproc), "--"};
      auto args = small_run(log, 3);
      args[6] = "16";
      cmd.insert(cmd.end(), args.begin(), args.end());
      cmd.insert(cmd.end(), mode.begin(), mode.end());
      cmd.insert(cmd.end(), extra.begin(), extra.end());
      auto r = run_command(cmd);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      return losses(log);
    };
    const std::string trace = temp_path("ppm_trace");
    std::filesystem::remove(trace);
    const auto one = run_at(1, {});
    const auto two = run_at(2, {"--pipeline-stages", "2", "--trace", trace});
    ASSERT_EQ(one.size(), 3u) << mode[0];
    ASSERT_EQ(two.size(), 3u) << mode[0];
    // bf16: the stages add the micro-batches' gradients in another order, in bf16.
    const double tol = mode.back() == "bf16" ? 2e-3 : 1e-6;
    for (size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(two[i], one[i], tol * one[i]) << mode[0] << ", step " << i + 1;
    auto summary = run_command({bin("fsdp-trace"), "summary", trace});
    EXPECT_EQ(summary.exit_code, 0) << summary.output;
    const bool recomputed = summary.output.find("recompute") != std::string::npos;
    EXPECT_EQ(recomputed, mode[0] == "--activation-checkpointing") << summary.output;
    EXPECT_NE(summary.output.find(" ms waiting for the link (receives after the sender posted"),
              std::string::npos)
        << summary.output;
    std::filesystem::remove_all(trace);
  }
}

// train_llama's layers (embedding, decoder layers, norm and head) in two stages give the
// losses of one process.
TEST(TrainLlama, PipelineStagesGiveTheLossesOfOneProcess) {
  const std::string log1 = temp_path("llpp1"), log2 = temp_path("llpp2");
  auto r1 = run_command(small_run(log1, 6, "cpu", "train_llama"));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
  auto args = small_run(log2, 6, "cpu", "train_llama");
  cmd.insert(cmd.end(), args.begin(), args.end());
  cmd.insert(cmd.end(), {"--pipeline-stages", "2", "--micro-batches", "4"});
  auto r2 = run_command(cmd);
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_NE(r2.output.find("train_llama: pipeline of 2 stages (1f1b, 4 micro-batches)"),
            std::string::npos)
      << r2.output;
  const auto a = losses(log1), b = losses(log2);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-6 * a[i]) << "step " << i + 1;
}

TEST(TrainGpt, WorldOneAndWorldThreeGiveTheSameLosses) {
  auto log1 = temp_path("w1"), log3 = temp_path("w3");
  auto r1 = run_command(small_run(log1));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  std::vector<std::string> launch = {bin("fsdp-run"), "--nproc", "3", "--"};
  auto args3 = small_run(log3);
  launch.insert(launch.end(), args3.begin(), args3.end());
  auto r3 = run_command(launch);
  ASSERT_EQ(r3.exit_code, 0) << r3.output;
  auto a = losses(log1), b = losses(log3);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << "step " << i + 1;
  auto first = read_jsonl(log3)[0];
  for (const char* key : {"step", "loss", "lr", "tokens_per_s", "peak_bytes", "comm_bytes"}) {
    EXPECT_TRUE(first.contains(key)) << key;
  }
  EXPECT_GT(first.at("comm_bytes").get<int64_t>(), 0);
  std::remove(log1.c_str());
  std::remove(log3.c_str());
}

TEST(TrainGpt, TorchrunGivesTheSameLossesAsFsdpRun) {
  auto log_a = temp_path("fr"), log_b = temp_path("tr");
  std::vector<std::string> a = {bin("fsdp-run"), "--nproc", "2", "--"};
  auto args = small_run(log_a);
  a.insert(a.end(), args.begin(), args.end());
  auto ra = run_command(a);
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  // torchrun as the README documents it: scripts/torchrun.py is torchrun, with a store
  // that also works on a PyTorch without libuv (Debian 13's 2.6); FSDP_PYTHON is the
  // build's Python (PyPI's torch in .venv, or Debian's).
  std::vector<std::string> b = {FSDP_PYTHON,
                                std::string(FSDP_SOURCE_DIR) + "/scripts/torchrun.py",
                                "--nproc_per_node",
                                "2",
                                "--master_port",
                                std::to_string(free_port()),
                                "--redirects",
                                "1",
                                "--tee",
                                "1",
                                "--no_python"};
  args = small_run(log_b);
  b.insert(b.end(), args.begin(), args.end());
  auto rb = run_command(b);
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  auto la = losses(log_a), lb = losses(log_b);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(la, lb);  // same world size, same seed: bit-identical
}

TEST(TrainGpt, SyntheticTaskLossFallsBelowItsUnigramEntropy) {
  auto log = temp_path("learn");
  std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2",           "--", bin("train_gpt"),
                                  "--steps",       "150",     "--log-jsonl", log};
  auto r = run_command(cmd, {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto pos = r.output.find("unigram entropy ");
  ASSERT_NE(pos, std::string::npos) << r.output;
  double entropy = std::stod(r.output.substr(pos + 16));
  auto l = losses(log);
  ASSERT_EQ(l.size(), 150u);
  EXPECT_GT(l.front(), entropy);       // starts above: the model knows nothing
  EXPECT_LT(l.back(), 0.5 * entropy);  // ends well below what no context can reach
}

TEST(TrainGpt, Bf16RunHalvesTheBytesPerStepAndStillLearns) {
  auto log32 = temp_path("p32"), log16 = temp_path("p16");
  for (auto [log, precision] : {std::pair{log32, "fp32"}, std::pair{log16, "bf16"}}) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
    auto args = small_run(log, 30);
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), {"--precision", precision});
    auto r = run_command(cmd);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  auto a = read_jsonl(log32), b = read_jsonl(log16);
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  EXPECT_EQ(2 * b.back().at("comm_bytes").get<int64_t>(), a.back().at("comm_bytes").get<int64_t>());
  EXPECT_LT(b.back().at("loss").get<double>(), b.front().at("loss").get<double>() - 1.0);
}

TEST(TrainGpt, ActivationCheckpointingLeavesTheLossesUnchanged) {
  auto plain = temp_path("ac0"), ckpt = temp_path("ac1");
  for (auto [log, mode] : {std::pair{plain, "none"}, std::pair{ckpt, "every:1"}}) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
    auto args = small_run(log, 5);
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), {"--activation-checkpointing", mode, "--dropout", "0.1"});
    auto r = run_command(cmd);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  EXPECT_EQ(losses(plain), losses(ckpt));  // recompute restores the RNG: bit-identical
  // ... and checkpointing did run: each of the 2 blocks recomputed once per step.
  const auto with = read_jsonl(ckpt), without = read_jsonl(plain);
  ASSERT_EQ(with.size(), 5u);
  for (const auto& j : with)
    EXPECT_EQ(j.at("recomputes").get<int64_t>(), 2 * j.at("step").get<int64_t>()) << j;
  for (const auto& j : without) EXPECT_EQ(j.at("recomputes").get<int64_t>(), 0) << j;
}

// --attention: the fused kernel (the default) and the explicit softmax train alike without
// dropout, GPT and Llama at world 2: the losses agree within fp32 rounding (1e-4), and the
// summary names the kernel.
TEST(TrainGpt, FusedAndMathAttentionGiveTheSameLossesForGptAndLlama) {
  for (const std::string program : {"train_gpt", "train_llama"}) {
    SCOPED_TRACE(program);
    auto fused = temp_path("sdpa"), math = temp_path("math");
    for (auto [log, kernel] : {std::pair{fused, "sdpa"}, std::pair{math, "math"}}) {
      std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
      auto args = small_run(log, 20, "cpu", program);
      cmd.insert(cmd.end(), args.begin(), args.end());
      cmd.insert(cmd.end(), {"--attention", kernel});
      auto r = run_command(cmd);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find(std::string(", attention ") + kernel + ", world size 2"),
                std::string::npos)
          << r.output;
    }
    auto a = losses(fused), b = losses(math);
    ASSERT_EQ(a.size(), 20u);
    ASSERT_EQ(b.size(), 20u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4 * b[i]) << "step " << i + 1;
    EXPECT_LT(a.back(), a.front() - 0.5);  // and it learns
    std::remove(fused.c_str());
    std::remove(math.c_str());
  }
}

// Every program that builds a model refuses an unknown kernel, naming it and the choices.
TEST(TrainGpt, AnUnknownAttentionKernelIsRefusedByEveryProgram) {
  const std::string choices =
      "--attention flash is not an attention kernel; use sdpa (the fused kernel, the default) "
      "or math (the explicit softmax)";
  expect_usage_error({bin("train_gpt"), "--attention", "flash"}, "train_gpt: error: " + choices);
  expect_usage_error({bin("train_llama"), "--attention", "flash"},
                     "train_llama: error: " + choices);
  // The generators read the flag before the weights: no file is needed to be refused.
  expect_usage_error({bin("generate"), "--weights", "/nonexistent/w.h5", "--prompt", "a",
                      "--max-new-tokens", "1", "--attention", "flash"},
                     "generate: error: " + choices);
  expect_usage_error({bin("generate_llama"), "--model", "/nonexistent", "--prompt", "a",
                      "--max-new-tokens", "1", "--attention", "flash"},
                     "generate_llama: error: " + choices);
}

// --master-dtype bf16 (pure bf16) at two ranks: the summary names the rounding (auto:
// stochastic, since the CPU steps on the host), it learns, and its loss stays within
// stochastic rounding's tolerance of fp32 masters (tests/test_pure_bf16.cpp: 10%).
TEST(TrainGpt, PureBf16FlagTrainsNearFp32MastersWithStochasticRounding) {
  auto masters = temp_path("bf16m"), pure = temp_path("bf16p");
  std::string output;
  for (auto [log, master] : {std::pair{masters, "fp32"}, std::pair{pure, "bf16"}}) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
    auto args = small_run(log, 30);
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), {"--precision", "bf16", "--master-dtype", master});
    auto r = run_command(cmd);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    output = r.output;
  }
  EXPECT_NE(output.find("train_gpt: pure bf16: shards, gradients and optimizer state in bf16 "
                        "(stochastic rounding)"),
            std::string::npos)
      << output;
  const auto a = losses(masters), b = losses(pure);
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  EXPECT_NE(a, b) << "the shards are bf16, so the losses differ";
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(std::abs(b[i] - a[i]) / a[i], 0.10) << i;
  EXPECT_LT(b.back(), b.front() - 1.0) << "it learns";
}

// --offload-activations: the same losses as checkpointing alone, and each step holds
// every checkpointed block's input on the host: 2 blocks x (6 rows x 16 positions x 32
// wide) fp32 per rank.
TEST(TrainGpt, OffloadActivationsGivesTheSameLossesAndHoldsTheBlockInputsOnTheHost) {
  auto plain = temp_path("oa0"), off = temp_path("oa1");
  for (auto [log, offload] : {std::pair{plain, false}, std::pair{off, true}}) {
    std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
    auto args = small_run(log, 5);
    cmd.insert(cmd.end(), args.begin(), args.end());
    cmd.insert(cmd.end(), {"--activation-checkpointing", "all"});
    if (offload) cmd.push_back("--offload-activations");
    auto r = run_command(cmd);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    if (offload)
      EXPECT_NE(r.output.find(", checkpointed inputs offloaded to host memory"), std::string::npos)
          << r.output;
  }
  EXPECT_EQ(losses(plain), losses(off));
  for (const auto& j : read_jsonl(off))
    EXPECT_EQ(j.at("offloaded_activation_bytes").get<int64_t>(), 2 * 6 * 16 * 32 * 4) << j;
  for (const auto& j : read_jsonl(plain))
    EXPECT_EQ(j.at("offloaded_activation_bytes").get<int64_t>(), 0) << j;
}

TEST(TrainGpt, CpuOffloadGivesTheSameLossesAtTwoRanks) {
  auto a = temp_path("nooff"), b = temp_path("off");
  std::vector<std::string> launch = {bin("fsdp-run"), "--nproc", "2", "--"};
  auto run = [&](const std::string& log, bool offload) {
    auto args = launch;
    auto rest = small_run(log);
    args.insert(args.end(), rest.begin(), rest.end());
    if (offload) args.push_back("--cpu-offload");
    return run_command(args);
  };
  auto ra = run(a, false), rb = run(b, true);
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 8u);
  EXPECT_EQ(la, lb);
  // ... and offload did run: every step copies each gradient shard back to the host (the
  // same bytes each step, at least this rank's half of the fp32 parameters) and each
  // shard to the device at least once for its gathers; without offload, nothing.
  const std::string out = rb.output;
  const size_t at = out.find(" parameters, ");
  ASSERT_NE(at, std::string::npos) << out;
  const int64_t params = std::stoll(out.substr(out.rfind(' ', at - 1) + 1, at));
  const auto on = read_jsonl(b), off = read_jsonl(a);
  const int64_t to_host = on.front().at("offload_to_host_bytes").get<int64_t>();
  EXPECT_GE(2 * to_host, 4 * params);
  EXPECT_LE(2 * to_host, 4 * params + 4 * 2 * 16) << "more than the padding of a few units";
  for (const auto& j : on) {
    EXPECT_EQ(j.at("offload_to_host_bytes").get<int64_t>(), to_host) << j;
    EXPECT_GE(j.at("offload_to_device_bytes").get<int64_t>(), to_host) << j;
  }
  for (const auto& j : off) {
    EXPECT_EQ(j.at("offload_to_host_bytes").get<int64_t>(), 0) << j;
    EXPECT_EQ(j.at("offload_to_device_bytes").get<int64_t>(), 0) << j;
  }
}

TEST(FsdpRun, AKilledRankStopsEveryRankAndFailsWithinSeconds) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_command({bin("fsdp-run"), "--nproc", "3", "--", "sh", "-c",
                        "if [ \"$RANK\" = 1 ]; then sleep 0.5; kill -9 $$; else sleep 60; fi"},
                       {}, 30);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 137);
  EXPECT_NE(
      r.output.find("fsdp-run: rank 1 was killed by signal SIGKILL; stopping the other 2 rank(s)"),
      std::string::npos)
      << r.output;
  EXPECT_LT(secs, 10.0);
}

// A rank of a real training job killed mid-step: the survivor is left inside a
// collective (its own timeout is 300 s), and fsdp-run ends the job within seconds,
// naming the rank. Rank 1 is killed by a watcher once the log (rank 0's) shows two steps.
TEST(FsdpRun, ARankKilledMidStepEndsTheTrainingJobWithinSecondsNamingIt) {
  const std::string log = temp_path("killed_mid_step");
  std::string train;
  for (const auto& a : small_run(log, 100000)) train += "'" + a + "' ";
  auto lines = [](const std::string& path) {  // the survivor may have been stopped mid-line
    std::ifstream f(path);
    size_t n = 0;
    for (std::string line; std::getline(f, line);) n += line.empty() ? 0 : 1;
    return n;
  };
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then (while [ \"$(cat '" + log +
      "' 2>/dev/null | wc -l)\" -lt 2 ]; do sleep 0.05; done; kill -9 $$) & fi; exec " + train;
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_command({bin("fsdp-run"), "--nproc", "2", "--", "sh", "-c", script},
                       {"FSDP_TIMEOUT_S=300"}, 120);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 137) << r.output;
  EXPECT_NE(
      r.output.find("fsdp-run: rank 1 was killed by signal SIGKILL; stopping the other 1 rank(s)"),
      std::string::npos)
      << r.output;
  EXPECT_GE(lines(log), 2u) << "rank 0 was not training when rank 1 died";
  EXPECT_LT(lines(log), 100000u);
  EXPECT_LT(secs, 30.0) << r.output;
}

TEST(FsdpRun, ARankExitingNonZeroIsNamedWithItsCode) {
  auto r = run_command({bin("fsdp-run"), "--nproc", "2", "--", "sh", "-c",
                        "if [ \"$RANK\" = 0 ]; then exit 3; else sleep 60; fi"},
                       {}, 30);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.output.find("fsdp-run: rank 0 exited with code 3"), std::string::npos) << r.output;
}

// Rank 0 failing to serve the rendezvous ends the whole run at once: the other ranks
// do not wait out the rendezvous timeout (120 s here).
TEST(FsdpRun, RankZeroThatCannotServeTheRendezvousStopsEveryRankAtOnce) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 8), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string port = std::to_string(ntohs(a.sin_port));
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_command({bin("fsdp-run"), "--nproc", "3", "--master-port", port, "--",
                        bin("train_gpt"), "--steps", "1"},
                       {"FSDP_TIMEOUT_S=120"}, 150);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("rank 0 cannot serve the rendezvous: port " + port), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("fsdp-run: rank 0 exited with code 1"), std::string::npos) << r.output;
  EXPECT_LT(secs, 60.0) << "the other ranks waited for the rendezvous timeout";
}

TEST(FsdpRun, BadArgumentsAreUsageErrors) {
  auto r = run_command({bin("fsdp-run"), "--nproc", "zero", "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("fsdp-run: error: --nproc 'zero' must be a positive integer"),
            std::string::npos);
  r = run_command({bin("fsdp-run"), "--nproc", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("fsdp-run: error: no command given after --"), std::string::npos);
  r = run_command({bin("fsdp-run"), "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("fsdp-run: error: --nproc N is required"), std::string::npos);
  r = run_command({bin("fsdp-run"), "--nproc", "2", "--master-port", "0", "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(
      r.output.find("fsdp-run: error: --master-port '0' must be a TCP port between 1 and 65535"),
      std::string::npos);
  r = run_command({bin("fsdp-run"), "--nproc", "2", "--foo", "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("fsdp-run: error: unknown option '--foo'; put the command after --"),
            std::string::npos);
  r = run_command({bin("fsdp-run"), "--nproc", "2", "--peak-rss-json", "/nonexistent/dir/rss.json",
                   "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(
      r.output.find(
          "fsdp-run: error: --peak-rss-json /nonexistent/dir/rss.json: cannot write the file"),
      std::string::npos)
      << r.output;
  r = run_command({bin("fsdp-run"), "--nproc", "2", "--peak-rss-json=", "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("fsdp-run: error: --peak-rss-json needs a file name"), std::string::npos)
      << r.output;
}

// --peak-rss-json: one figure per rank, each that rank's own peak. A rank that holds
// 256 MiB more than the other shows it; fsdp-run's own figure would not tell them apart.
TEST(FsdpRun, PeakRssJsonHasEachRanksOwnPeak) {
  const std::string json = temp_path("rss") + ".json";
  auto r = run_command(
      {bin("fsdp-run"), "--nproc", "2", "--peak-rss-json", json, "--", FSDP_PYTHON, "-c",
       "import os; b = bytearray((256 << 20) if os.environ['RANK'] == '1' else 0); "
       "b[::4096] = b'x' * len(b[::4096])"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(std::ifstream(json));
  const auto kb = j.at("peak_rss_kb").get<std::vector<int64_t>>();
  ASSERT_EQ(kb.size(), 2u) << j.dump();
  EXPECT_GT(kb[0], 0);
  EXPECT_GT(kb[1] - kb[0], 200 * 1024) << j.dump();  // KiB
}

struct BadInput {
  std::vector<std::string> args;
  std::string message;
};
// Names the case by its arguments in test listings (ctest shows them).
void PrintTo(const BadInput& b, std::ostream* os) {
  *os << "train_gpt";
  for (const auto& a : b.args) *os << " " << a;
}

class TrainGptBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(TrainGptBadInput, ExitsNonZeroWithAMessageAndNoStackDump) {
  std::vector<std::string> cmd = {bin("train_gpt")};
  cmd.insert(cmd.end(), GetParam().args.begin(), GetParam().args.end());
  auto r = run_command(cmd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(GetParam().message), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;  // no backtrace
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TrainGptBadInput,
    ::testing::Values(
        BadInput{{"--sharding", "zero4"},
                 "train_gpt: error: --sharding zero4 is unknown; use full, grad_op, none, hybrid, "
                 "zero2 or zero1 (zero3 is full)"},
        BadInput{{"--wrap", "size:many"},
                 "train_gpt: error: --wrap size:many is unknown; use block, none or size:N"},
        BadInput{{"--lr-schedule", "linear"},
                 "train_gpt: error: --lr-schedule linear is unknown; use constant, cosine, warmup "
                 "or warmup_decay"},
        BadInput{{"--lr-schedule", "warmup", "--warmup-steps", "0"},
                 "train_gpt: error: --lr-schedule warmup needs --warmup-steps of at least 1"},
        BadInput{{"--warmup-type", "cosine"},
                 "train_gpt: error: --warmup-type cosine is unknown; use log or linear"},
        BadInput{{"--adam-betas", "0.9"},
                 "train_gpt: error: --adam-betas 0.9 must be two numbers in [0, 1), e.g. 0.9,0.95"},
        BadInput{{"--offload-optimizer", "disk"},
                 "train_gpt: error: --offload-optimizer disk is unknown; use none, cpu or nvme"},
        BadInput{{"--cpu-offload", "--offload-optimizer", "nvme"},
                 "train_gpt: error: --cpu-offload (everything to host memory) contradicts "
                 "--offload-optimizer nvme and --offload-param none; use one or the other "
                 "(--cpu-offload means both offloads on the host)"},
        BadInput{{"--n-layer", "0"}, "train_gpt: error: --n-layer 0 must be positive"},
        BadInput{{"--lr", "-0.5"}, "train_gpt: error: --lr -0.5 must not be negative"},
        BadInput{{"--quantize-weights", "--quantize-weight-bits", "2"},
                 "train_gpt: error: --quantize-weight-bits 2 is unsupported; use 8 (int8) or 4 "
                 "(int4)"},
        BadInput{{"--quantize-block", "64"},
                 "train_gpt: error: --quantize-weight-bits, --quantize-gradient-bits and "
                 "--quantize-block tune --quantize-weights and --quantize-gradients, and neither "
                 "is given; add one"},
        BadInput{{"--max-gathered-units", "0"},
                 "train_gpt: error: --max-gathered-units 0 must be at least 1 (the unit that "
                 "computes; 1: no prefetch)"},
        BadInput{{"--max-live-numel", "-1"},
                 "train_gpt: error: --max-live-numel -1 must be 0 (off) or a positive number of "
                 "parameter elements"},
        BadInput{{"--loss-scale-window", "10"},
                 "train_gpt: error: --loss-scale-window applies only to --precision fp16"},
        BadInput{{"--deepspeed-config", "/nonexistent/ds.json"},
                 "train_gpt: error: --deepspeed-config /nonexistent/ds.json: ds_config: cannot "
                 "open /nonexistent/ds.json"},
        BadInput{{"--master-dtype", "fp16"},
                 "train_gpt: error: --master-dtype fp16 is unsupported; use fp32 (fp32 masters) or "
                 "bf16 (pure bf16)"},
        BadInput{
            {"--master-dtype", "bf16"},
            "train_gpt: error: --master-dtype bf16 (pure bf16) needs --precision bf16 too (got "
            "fp32): the gathered parameters cannot be more precise than the shards"},
        BadInput{{"--bf16-rounding", "stochastic"},
                 "train_gpt: error: --bf16-rounding stochastic applies only to --master-dtype "
                 "bf16 (this run's shards are fp32)"},
        BadInput{{"--precision", "bf16", "--master-dtype", "bf16", "--bf16-rounding", "up"},
                 "train_gpt: error: --bf16-rounding up is unknown; use auto, nearest, stochastic "
                 "or compensated"},
        BadInput{{"--offload-activations"},
                 "train_gpt: error: --offload-activations keeps the inputs that activation "
                 "checkpointing saves in host memory, and no block is checkpointed; set "
                 "--activation-checkpointing (all or every:K) too"},
        BadInput{{"--no-decay-recipe", "biases"},
                 "train_gpt: error: --no-decay-recipe biases is unknown; use standard or none"},
        BadInput{{"--d-model", "30", "--n-head", "4"},
                 "train_gpt: error: --d-model 30 must be divisible by --n-head 4"},
        BadInput{{"--data", "/nonexistent/input.txt"},
                 "train_gpt: error: --data /nonexistent/input.txt: cannot open the file"},
        BadInput{{"--steps", "abc"}, "train_gpt: error: "},
        BadInput{{"--no-such-flag"}, "train_gpt: error: "},
        BadInput{{"--precision", "fp8"},
                 "train_gpt: error: --precision fp8 is unknown; use fp32, bf16 or fp16"},
        BadInput{{"--construction", "lazy"},
                 "train_gpt: error: --construction lazy is unknown; use sharded or eager"},
        BadInput{
            {"--precision", "fp16", "--loss-scale-power", "99"},
            "train_gpt: error: --loss-scale-power 99 must be between 0 and 60 (the default is 16)"},
        BadInput{{"--loss-scale-power", "8"},
                 "train_gpt: error: --loss-scale-power applies only to --precision fp16 (this run "
                 "is fp32)"},
        BadInput{{"--activation-checkpointing", "every:0"},
                 "train_gpt: error: --activation-checkpointing every:0 is unknown; use none, all "
                 "or every:K (K >= 1)"},
        BadInput{{"--data", "/dev/null"},
                 "train_gpt: error: --data holds 0 bytes, fewer than --block-size + 2 = 34; use a "
                 "longer file or a smaller --block-size"},
        BadInput{{"--config", "/etc/os-release"},
                 "train_gpt: error: --config /etc/os-release: not valid JSON ("},
        BadInput{{"--dropout", "1"}, "train_gpt: error: --dropout must be in [0, 1)"},
        BadInput{{"--backend", "mpi"},
                 "train_gpt: error: --backend mpi is unknown; use auto (nccl on a GPU, gloo on "
                 "the CPU), gloo or nccl"},
        BadInput{{"--device", "cpu", "--backend", "nccl"},
                 "train_gpt: error: --backend nccl needs a GPU, but the device is cpu; use "
                 "--backend gloo (or auto) on the CPU"},
        BadInput{{"--warmup-steps", "-1"}, "train_gpt: error: --warmup-steps must not be negative"},
        BadInput{{"--clip-grad", "-1"},
                 "train_gpt: error: --clip-grad must not be negative (0 turns clipping off)"},
        BadInput{{"--steps", "-1"},
                 "train_gpt: error: --steps -1 must not be negative (0: load, evaluate and export "
                 "without training)"},
        BadInput{{"--config", "/nonexistent/c.json"},
                 "train_gpt: error: --config /nonexistent/c.json: cannot open the file"},
        BadInput{
            {"--steps", "10", "--stop-at", "11"},
            "train_gpt: error: --stop-at 11 must be between 1 and --steps 10 (0: run all steps)"},
        BadInput{{"--save-every", "-1", "--save-dir", "/tmp/x"},
                 "train_gpt: error: --save-every -1 must not be negative"},
        BadInput{{"--save-every", "5"}, "train_gpt: error: --save-every needs --save-dir DIR"},
        BadInput{
            {"--val-fraction", "1"},
            "train_gpt: error: --val-fraction 1 must be at least 0 and below 1 (0: no validation)"},
        BadInput{{"--save-dir", "/proc/fsdp_no"},
                 "train_gpt: error: --save-dir /proc/fsdp_no: cannot create the directory"},
        BadInput{{"--consolidate-to", "/nonexistent/dir/w.h5"},
                 "train_gpt: error: --consolidate-to /nonexistent/dir/w.h5: the directory "
                 "/nonexistent/dir does not exist"}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// --data holds out its last --val-fraction for validation: a text whose training part
// is "ab" repeated and whose held-out tenth is all 'z' trains to a low loss while the
// validation loss stays high (the model never saw a 'z'); had training read the held-out
// part, 'z' would be predicted. Validation losses come on the progress steps only, and a
// split too small for a block is an error naming both parts.
TEST(TrainGpt, DataHoldsOutItsLastFractionForTheValidationLoss) {
  const std::string text_path = temp_path("val") + ".txt";
  {
    std::ofstream f(text_path);
    for (int i = 0; i < 900; ++i) f << "ab";
    f << std::string(200, 'z');  // 2000 bytes: the last 10% are the z's
  }
  auto log = temp_path("val_log");
  auto r = run_command({bin("fsdp-run"),
                        "--nproc",
                        "2",
                        "--",
                        bin("train_gpt"),
                        "--data",
                        text_path,
                        "--steps",
                        "30",
                        "--log-every",
                        "10",
                        "--n-layer",
                        "1",
                        "--d-model",
                        "32",
                        "--n-head",
                        "2",
                        "--block-size",
                        "16",
                        "--batch-size",
                        "8",
                        "--lr",
                        "1e-2",
                        "--warmup-steps",
                        "5",
                        "--lr-schedule",
                        "constant",
                        "--log-jsonl",
                        log});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1800 bytes to train on, 200 held out for validation"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| val loss "), std::string::npos) << r.output;
  auto steps = read_jsonl(log);
  ASSERT_EQ(steps.size(), 30u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].contains("val_loss"), (i + 1) % 10 == 0) << steps[i].dump();
  }
  const double train = steps.back().at("loss").get<double>(),
               val = steps.back().at("val_loss").get<double>();
  EXPECT_LT(train, 0.1) << "alternating a and b is easy to learn";
  EXPECT_GT(val, 3.0) << "the held-out z's must be unseen (train loss " << train << ")";

  const std::string small = temp_path("val_small") + ".txt";
  std::ofstream(small) << std::string(100, 'a');
  auto bad = run_command({bin("train_gpt"), "--data", small, "--steps", "1"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(
      bad.output.find("train_gpt: error: --data " + small +
                      " (100 bytes) split by --val-fraction leaves 90 "
                      "bytes to train on and 10 to validate on; each needs --block-size + 2 = 34"),
      std::string::npos)
      << bad.output;
  auto none =
      run_command({bin("train_gpt"), "--data", small, "--steps", "1", "--val-fraction", "0"});
  EXPECT_EQ(none.exit_code, 0) << none.output;
}

// fp16 on CPU (LibTorch 2.x has the kernels): train_gpt trains at world 2 with the
// dynamic loss scaler.
// With `extra` (--pipeline-stages 2: the skip agreed across the stages too).
void fp16_trains_with_the_loss_scaler(const std::vector<std::string>& extra) {
  auto log = temp_path("fp16");
  std::vector<std::string> cmd = {bin("fsdp-run"), "--nproc", "2", "--"};
  auto args = small_run(log, 40);
  cmd.insert(cmd.end(), args.begin(), args.end());
  // 2^24 makes the first steps' scaled gradients overflow fp16 on purpose, so steps are
  // skipped and the scale comes down.
  cmd.insert(cmd.end(), {"--precision", "fp16", "--loss-scale-power", "24"});
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  auto r = run_command(cmd, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto steps = read_jsonl(log);
  ASSERT_EQ(steps.size(), 40u);
  int64_t skipped_before = 0;
  for (const auto& j : steps) {
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>())) << j.dump();
    const int64_t skipped = j.at("skipped_steps").get<int64_t>();
    EXPECT_GE(skipped, skipped_before) << j.dump();
    skipped_before = skipped;
  }
  EXPECT_GT(skipped_before, 0) << "a scale of 2^24 must overflow fp16";
  EXPECT_LT(skipped_before, 20) << r.output;
  EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>() - 1.0)
      << r.output;
  // Both ranks skipped the same steps and end on the same scale.
  const std::string tail =
      " of 40 steps, loss scale " +
      std::to_string(static_cast<int64_t>(steps.back().at("loss_scale").get<double>()));
  for (int rank = 0; rank < 2; ++rank) {
    const std::string line = "train_gpt: rank " + std::to_string(rank) + ": fp16 skipped " +
                             std::to_string(skipped_before) + tail;
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing: " << line << "\n" << r.output;
  }
}

TEST(TrainGpt, Fp16TrainsWithTheLossScaler) { fp16_trains_with_the_loss_scaler({}); }

TEST(TrainGpt, Fp16TrainsWithTheLossScalerInPipelineStages) {
  fp16_trains_with_the_loss_scaler({"--pipeline-stages", "2"});
}

TEST(TrainGpt, BatchNotDivisibleByTheWorldSaysWhatToUse) {
  auto r = run_command({bin("fsdp-run"), "--nproc", "3", "--", bin("train_gpt"), "--batch-size",
                        "10", "--steps", "1"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train_gpt: error: --batch-size 10 must be divisible by world size 3 x "
                          "--grad-accum 1; try --batch-size 12"),
            std::string::npos)
      << r.output;
}

TEST(TrainGpt, ConfigFileSetsOptionsAndFlagsOverrideIt) {
  auto cfg = temp_path("cfg");
  {
    std::ofstream f(cfg);
    f << R"({"n_layer": 1, "d-model": 32, "n_head": 2, "block_size": 16, )"
         R"("steps": 3, "batch_size": 4})";
  }
  auto log = temp_path("cfglog");
  auto r = run_command({bin("train_gpt"), "--config", cfg, "--steps", "2", "--log-jsonl", log});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 layers, d_model 32"), std::string::npos) << r.output;
  EXPECT_EQ(read_jsonl(log).size(), 2u);  // --steps 2 on the command line wins over the file's 3
  std::remove(cfg.c_str());
  std::remove(log.c_str());
}

TEST(TrainGpt, ConfigFileTurnsSwitchesOnAndRejectsOtherTypes) {
  auto cfg = temp_path("cfgsw");
  char dir_tmpl[] = "/tmp/fsdp_cfgck_XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl);
  {
    std::ofstream f(cfg);
    f << R"({"steps": 2, "n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16, )"
         R"("batch_size": 4,
             "cpu_offload": true, "resume": false, "save_dir": ")"
      << dir << R"("})";
  }
  auto r = run_command({bin("train_gpt"), "--config", cfg});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("resumed"), std::string::npos)
      << "resume: false must leave the switch off";
  EXPECT_NE(r.output.find("saved checkpoint " + dir + "/step_00000002"), std::string::npos)
      << r.output;
  {
    std::ofstream f(cfg);
    f << R"({"steps": [1, 2]})";
  }
  auto bad = run_command({bin("train_gpt"), "--config", cfg});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("key 'steps' must be a number, a string or true/false"),
            std::string::npos)
      << bad.output;
  std::remove(cfg.c_str());
}

}  // namespace

namespace {
TEST(SmallExamples, MlpAndSequentialTrainOnTwoRanks) {
  for (const char* name : {"train_mlp", "train_sequential"}) {
    auto r = run_command({bin("fsdp-run"), "--nproc", "2", "--", bin(name)}, {}, 120);
    EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
    EXPECT_NE(r.output.find("step 80 loss"), std::string::npos) << name << ":\n" << r.output;
  }
}
}  // namespace

// ---- train_llama (examples/llama): the shared trainer with the Llama ------------------

namespace {

// A Hugging Face model directory holding only a config.json (the flags are checked
// against it before any weight is read).
std::string hf_dir_with(const std::string& config_json) {
  const std::string dir = temp_path("hfcfg");
  std::remove(dir.c_str());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config_json;
  return dir;
}

const std::string kLlamaConfig =
    R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0})";

TEST(TrainLlama, BadInputIsRefusedNamingTheValueAndTheFix) {
  const std::string ok = hf_dir_with(kLlamaConfig + "}");
  const std::string gpt2 = hf_dir_with(R"({"model_type": "gpt2"})");
  const std::string scaled = hf_dir_with(
      R"({"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2}})");
  const std::string biased = hf_dir_with(R"({"model_type": "llama", "attention_bias": true})");
  expect_usage_error({bin("train_gpt"), "--init-from", ok},
                     "train_gpt: error: --init-from " + ok +
                         " is a Hugging Face model directory (it holds config.json); train_gpt "
                         "starts only from its own files (consolidated HDF5 or safetensors): use "
                         "train_llama for Llama models");
  expect_usage_error({bin("train_llama"), "--n-kv-head", "3"},
                     "train_llama: error: --n-kv-head 3 must divide --n-head 4 (each key/value "
                     "head serves n_head / n_kv_head query heads)");
  expect_usage_error({bin("train_llama"), "--export-dtype", "fp8"},
                     "train_llama: error: --export-dtype fp8 is unknown; use fp32, bf16 or fp16");
  expect_usage_error(
      {bin("train_llama"), "--init-from", gpt2},
      "train_llama: error: " + gpt2 +
          "/config.json: model_type \"gpt2\"; train_llama and generate_llama build Llama models "
          "(model_type \"llama\", LlamaForCausalLM)");
  expect_usage_error({bin("train_llama"), "--init-from", scaled},
                     "train_llama: error: " + scaled +
                         "/config.json: rope_type \"linear\" (rope scaling) is not implemented "
                         "here; this example computes default rotary positions only");
  expect_usage_error({bin("train_llama"), "--init-from", biased},
                     "train_llama: error: " + biased +
                         "/config.json: attention_bias true; this Llama has no biases");
  expect_usage_error({bin("train_llama"), "--init-from", ok, "--n-layer", "3"},
                     "train_llama: error: --n-layer 3 but " + ok +
                         "/config.json has num_hidden_layers 2; leave the flag out to take the "
                         "file's, or give another file");
  expect_usage_error({bin("train_llama"), "--init-from", ok, "--block-size", "100"},
                     "train_llama: error: --block-size 100 is past " + ok +
                         "/config.json's max_position_embeddings 64; use a --block-size of at "
                         "most that");
  std::filesystem::remove_all(ok);
  std::filesystem::remove_all(gpt2);
  std::filesystem::remove_all(scaled);
  std::filesystem::remove_all(biased);
}

// The rest of the Llama's refusals: shapes the model cannot have, config.json fields of the
// wrong kind or value, flags that disagree with the file, --eval-text and --export-hf
// places that cannot work, and a file of the other family.
TEST(TrainLlama, EveryOtherRefusalNamesTheValueAndTheFix) {
  auto config_with = [](const std::string& from, const std::string& to) {
    std::string c = kLlamaConfig + "}";
    const size_t at = c.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return hf_dir_with(c.replace(at, from.size(), to));
  };
  const std::string ok = hf_dir_with(kLlamaConfig + "}");
  const std::string small_vocab = config_with(R"("vocab_size": 256)", R"("vocab_size": 100)");
  const std::string gelu =
      config_with(R"("hidden_size": 64)", R"("hidden_size": 64, "hidden_act": "gelu")");
  const std::string head_dim =
      config_with(R"("hidden_size": 64)", R"("hidden_size": 64, "head_dim": 32)");
  const std::string text_layers =
      config_with(R"("num_hidden_layers": 2)", R"("num_hidden_layers": "two")");
  const std::string not_json = hf_dir_with("{\"model_type\": ");
  expect_usage_error({bin("train_llama"), "--d-model", "36", "--n-head", "4"},
                     "train_llama: error: --d-model / --n-head = 9 must be even: rotary positions "
                     "rotate pairs of a head's dimensions");
  expect_usage_error({bin("train_llama"), "--init-from", small_vocab},
                     "train_llama: error: vocab_size 100 is below 256: the training data are bytes "
                     "(token ids 0-255)");
  expect_usage_error({bin("train_llama"), "--init-from", ok, "--tie-embeddings"},
                     "train_llama: error: --tie-embeddings but " + ok +
                         "/config.json has tie_word_embeddings false; leave the flag out to take "
                         "the file's");
  expect_usage_error({bin("train_llama"), "--init-from", gelu},
                     "train_llama: error: " + gelu +
                         "/config.json: hidden_act \"gelu\"; the Llama MLP here is SwiGLU (silu)");
  expect_usage_error({bin("train_llama"), "--init-from", head_dim},
                     "train_llama: error: " + head_dim +
                         "/config.json: head_dim 32 differs from hidden_size / num_attention_heads "
                         "= 16; not implemented here");
  expect_usage_error({bin("train_llama"), "--init-from", text_layers},
                     "train_llama: error: " + text_layers +
                         "/config.json: num_hidden_layers is \"two\", not an integer");
  expect_usage_error({bin("train_llama"), "--init-from", not_json},
                     "train_llama: error: " + not_json + "/config.json: not valid JSON (");
  expect_usage_error({bin("train_llama"), "--steps", "1", "--eval-text", "/nonexistent/e.txt"},
                     "train_llama: error: --eval-text /nonexistent/e.txt: cannot open the file");
  const std::string short_text = temp_path("evt");
  std::ofstream(short_text) << "abcde";
  expect_usage_error({bin("train_llama"), "--steps", "1", "--eval-text", short_text},
                     "train_llama: error: --eval-text " + short_text +
                         " holds 5 bytes, fewer than one row of --block-size + 1 = 33");
  expect_usage_error({bin("train_llama"), "--steps", "1", "--export-hf", "/nonexistent/dir/out"},
                     "train_llama: error: --export-hf /nonexistent/dir/out: the directory "
                     "/nonexistent/dir does not exist");
  // A Llama's safetensors file (its metadata names the arch) given to train_gpt.
  const std::string exported = temp_path("llexp");
  std::remove(exported.c_str());
  auto r = run_command(
      {bin("train_llama"), "--steps", "1", "--batch-size", "2", "--export-hf", exported});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_usage_error({bin("train_gpt"), "--init-from", exported + "/model.safetensors"},
                     "train_gpt: error: --init-from " + exported +
                         "/model.safetensors holds a llama model, and train_gpt trains gpt models; "
                         "use train_llama for it");
  for (const auto& d : {ok, small_vocab, gelu, head_dim, text_layers, not_json, exported})
    std::filesystem::remove_all(d);
  std::remove(short_text.c_str());
}

// A config.json whose shapes the weights do not have: the import names the parameter
// and both shapes. train_llama exports d_model 64 with intermediate_size 176; the
// config then says 192.
TEST(TrainLlama, WeightsThatDoNotFitTheConfigAreNamedWithBothShapes) {
  const std::string dir = temp_path("hfexp");
  std::remove(dir.c_str());
  auto r = run_command({bin("train_llama"), "--steps", "1", "--batch-size", "2", "--export-hf", dir,
                        "--intermediate-size", "176"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto cfg = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  EXPECT_EQ(cfg.at("architectures"), nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(cfg.at("num_key_value_heads").get<int64_t>(), 2);
  cfg["intermediate_size"] = 192;
  std::ofstream(dir + "/config.json") << cfg.dump();
  r = run_command({bin("train_llama"), "--steps", "1", "--batch-size", "2", "--init-from", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("does not match this model: shapes differ for "
                          "model.layers.0.mlp.gate_proj.weight (file [176, 64], model [192, 64]), "
                          "model.layers.0.mlp.up_proj.weight (file [176, 64], model [192, 64]), "
                          "model.layers.0.mlp.down_proj.weight (file [64, 176], model [64, 192])"),
            std::string::npos)
      << r.output;
  std::filesystem::remove_all(dir);
}

// The shared trainer's features run for the Llama too: world 2 gives world 1's losses, and
// a run stopped and resumed gives the uninterrupted run's losses.
TEST(TrainLlama, WorldTwoAndAResumedRunGiveTheSameLosses) {
  auto run = [&](const std::string& log, int world, std::vector<std::string> extra) {
    std::vector<std::string> cmd = {
        bin("fsdp-run"), "--nproc", std::to_string(world), "--", bin("train_llama"), "--steps", "6",
        "--batch-size",  "4",       "--log-jsonl",         log,  "--tie-embeddings"};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r;
  };
  const std::string one = temp_path("ll1"), two = temp_path("ll2"), part = temp_path("ll3"),
                    rest = temp_path("ll4"), dir = temp_path("llck");
  std::remove(dir.c_str());
  run(one, 1, {});
  run(two, 2, {});
  const auto a = losses(one), b = losses(two);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << i;
  run(part, 2, {"--save-dir", dir, "--stop-at", "3"});
  run(rest, 2, {"--save-dir", dir, "--resume"});
  auto c = losses(part), d = losses(rest);
  c.insert(c.end(), d.begin(), d.end());
  EXPECT_EQ(c, b) << "stopped at 3 and resumed: the uninterrupted run's losses";
  std::filesystem::remove_all(dir);
}

}  // namespace

// The one-file program (examples/minimal/minimal_gpt.cpp): at most 200 lines including
// only <fsdp/...>, LibTorch and the standard library; at 2 ranks it learns, and a run
// stopped at step 10 and resumed from its checkpoint ends with the straight run's loss.
TEST(MinimalGpt, TrainsAtTwoRanksAndResumesWhereItStopped) {
  const std::string src = std::string(FSDP_SOURCE_DIR) + "/examples/minimal/minimal_gpt.cpp";
  std::ifstream in(src);
  ASSERT_TRUE(in) << src;
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    if (line.rfind("#include", 0) != 0) continue;
    const bool ok = line.find("<fsdp/") != std::string::npos ||
                    line.find("<torch/") != std::string::npos ||
                    (line.find('<') != std::string::npos && line.find('/') == std::string::npos);
    EXPECT_TRUE(ok) << "includes more than <fsdp/...>, LibTorch and std: " << line;
  }
  EXPECT_LE(lines, 200);
  auto run = [&](const std::string& ckpt, int steps) {
    auto r = run_command({bin("fsdp-run"), "--nproc", "2", "--", bin("minimal_gpt"), "--device",
                          "cpu", "--steps", std::to_string(steps), "--ckpt", ckpt});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  auto loss_at = [](const std::string& out, int step) {
    const std::string key = "step " + std::to_string(step) + " loss ";
    const size_t at = out.find(key);
    return at == std::string::npos
               ? std::string()
               : out.substr(at + key.size(), out.find('\n', at) - at - key.size());
  };
  // Directories beside temp_path's files (a checkpoint directory must not exist yet).
  auto dir_path = [](const std::string& stem) {
    const std::string file = temp_path(stem);
    std::remove(file.c_str());
    return file + ".ckpt";
  };
  const std::string straight = dir_path("mg_straight"), resumed = dir_path("mg_resumed");
  const std::string a = run(straight, 20);
  const std::string first = run(resumed, 10);
  const std::string second = run(resumed, 20);
  // The newest checkpoint in the directory (fsdp::ckpt::latest_checkpoint), named by its path.
  const size_t said = second.find("resumed from " + resumed + "/");
  ASSERT_NE(said, std::string::npos) << second;
  EXPECT_NE(second.substr(said, second.find('\n', said) - said).find(" at step 10"),
            std::string::npos)
      << second;
  EXPECT_NE(first.find("saved "), std::string::npos) << first;
  ASSERT_FALSE(loss_at(a, 19).empty()) << a;
  EXPECT_EQ(loss_at(a, 19), loss_at(second, 19)) << a << second;
  EXPECT_LT(std::stod(loss_at(a, 19)), std::stod(loss_at(a, 0)) - 1.0) << a;
  std::filesystem::remove_all(straight);
  std::filesystem::remove_all(resumed);
}

}  // namespace test_examples_cases
