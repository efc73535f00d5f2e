// GPU checks for a machine with CUDA LibTorch and a GPU; skipped elsewhere. (The example
// programs on the GPU: Cuda.*_CUDA in test_examples.cpp.) One GPU
// allows one NCCL rank (NCCL refuses two ranks on one device), so these run at world 1
// and compare with plain LibTorch on the same GPU.
#include <fsdp/checkpoint.h>
#include <fsdp/fused_adamw.h>

#include "support/models.h"
#include "support/multirank.h"
#include "support/temp_dir.h"

#include <gtest/gtest.h>
#include "../src/internal/optim_key.h"
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_cuda_cases {

namespace {

#define SKIP_WITHOUT_CUDA()                                                          \
  if (!torch::cuda::is_available())                                                  \
  GTEST_SKIP() << "no CUDA device visible (torch::cuda::device_count() = "           \
               << static_cast<int>(torch::cuda::device_count())                      \
               << "; this LibTorch or machine has none); run on a GPU machine with " \
                  "scripts/gpu/gpu-check.sh"

ShardingOptions gpu_options(const ProcessGroup& pg) {
  ShardingOptions o;
  o.process_group = pg;
  o.device = torch::Device(torch::kCUDA, 0);
  return o;
}

TEST(Cuda, ShardedGptTrainsLikePlainLibTorchOnTheGpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  // NCCL by name: at world 1 "auto" takes the in-process backend, and this test is the
  // one that runs the NCCL backend's collectives on a single GPU.
  run_ranks(
      1,
      [](const ProcessGroup& pg) {
        EXPECT_EQ(pg.backend_name(), "nccl");
        const auto cfg = small_gpt_config();
        torch::manual_seed(0);
        gpt::GPT ref(cfg);
        ref->to(torch::kCUDA);
        torch::manual_seed(0);
        auto model = fully_shard(gpt::GPT(cfg), gpu_options(pg));
        for (auto& p : model.sharded_parameters()) EXPECT_TRUE(p.is_cuda());
        torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-6));
        torch::optim::AdamW opt(model.sharded_parameters(),
                                torch::optim::AdamWOptions(1e-3).eps(1e-6));
        for (int64_t s = 0; s < 5; ++s) {
          auto rows = gpt_batch(s, 8, cfg.block_size).to(torch::kCUDA);
          auto lr = gpt::loss_on(ref, rows), lm = gpt::loss_on(model, rows);
          EXPECT_NEAR(lm.item<double>(), lr.item<double>(), 1e-5 * lr.item<double>())
              << "step " << s;
          lr.backward();
          lm.backward();
          opt_ref.step();
          opt.step();
          opt_ref.zero_grad();
          opt.zero_grad();
        }
        ref->to(torch::kCPU);
        expect_params_match(full_state_dict(model, {false, /*offload_to_cpu=*/true}), *ref, 1e-4);
      },
      300, {"FSDP_TEST_BACKEND=nccl"});
}

TEST(Cuda, CpuOffloadOnTheGpuTrainsLikeWithoutAndKeepsShardsPinnedOnTheHost_CUDA) {
  SKIP_WITHOUT_CUDA();
  run_ranks(1, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    auto on = gpu_options(pg), off = gpu_options(pg);
    on.offload_optimizer.device = on.offload_param.device = fsdp::OffloadDevice::kCpu;
    for (auto* o : {&on, &off}) {
      o->mixed_precision.param_dtype = torch::kBFloat16;
      o->mixed_precision.reduce_dtype = torch::kBFloat16;
    }
    torch::manual_seed(0);
    auto a = fully_shard(gpt::GPT(cfg), off);
    torch::manual_seed(0);
    auto b = fully_shard(gpt::GPT(cfg), on);
    for (auto& p : b.sharded_parameters()) {
      EXPECT_TRUE(p.is_cpu());
      EXPECT_TRUE(p.is_pinned());
    }
    torch::optim::AdamW opt_a(a.sharded_parameters(), torch::optim::AdamWOptions(1e-3).eps(1e-6));
    FusedAdamW opt_b(b, torch::optim::AdamWOptions(1e-3).eps(1e-6));
    for (int64_t s = 0; s < 5; ++s) {
      auto rows = gpt_batch(s, 8, cfg.block_size).to(torch::kCUDA);
      auto la = gpt::loss_on(a, rows), lb = gpt::loss_on(b, rows);
      EXPECT_NEAR(lb.item<double>(), la.item<double>(), 1e-3 * la.item<double>()) << "step " << s;
      la.backward();
      lb.backward();
      opt_a.step();
      opt_b.step();
      opt_a.zero_grad();
      opt_b.zero_grad();
    }
    EXPECT_EQ(b.memory_stats().offload_buffers.current, 0);
    EXPECT_GT(fsdp::detail::copy_out_gathers(b), 0);
  });
}

// Note [NVMe parameters] on a GPU: disk -> pinned host -> device for the gathers, device ->
// pinned host -> disk for the gradients, the host buffers dropped while their copies may
// still run (the transfers keep them). The same host arithmetic as parameters on the host
// with the optimizer state in files: equal bit for bit.
TEST(Cuda, NvmeParametersOnTheGpuTrainLikeParametersOnTheHost_CUDA) {
  SKIP_WITHOUT_CUDA();
  run_ranks(1, [](const ProcessGroup& pg) {
    TempDir dir;
    gpt::Config cfg = small_gpt_config();
    cfg.n_layer = 4;  // beyond the two units prefetch gathers, a third reads ahead
    auto host = gpu_options(pg), files = gpu_options(pg);
    for (auto* o : {&host, &files}) {
      o->auto_wrap_policy = wrap::module_type_policy<gpt::Block>();
      o->offload_optimizer.device = fsdp::OffloadDevice::kNvme;
      o->offload_optimizer.nvme_path = dir.path;
      o->mixed_precision.param_dtype = torch::kBFloat16;
      o->mixed_precision.reduce_dtype = torch::kBFloat16;
    }
    files.offload_param.device = fsdp::OffloadDevice::kNvme;
    files.offload_param.nvme_path = dir.path;
    torch::manual_seed(0);
    auto a = fully_shard(gpt::GPT(cfg), host);
    torch::manual_seed(0);
    auto b = fully_shard(gpt::GPT(cfg), files);
    const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
    FusedAdamW opt_a(a, adamw), opt_b(b, adamw);
    for (int64_t s = 0; s < 4; ++s) {
      auto rows = gpt_batch(s, 8, cfg.block_size).to(torch::kCUDA);
      auto la = gpt::loss_on(a, rows), lb = gpt::loss_on(b, rows);
      EXPECT_EQ(la.item<double>(), lb.item<double>()) << "step " << s;
      la.backward();
      lb.backward();
      opt_a.step();
      opt_b.step();
      opt_a.zero_grad();
      opt_b.zero_grad();
    }
    auto pa = full_state_dict(a), pb = full_state_dict(b);
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(torch::equal(pa[i].second.cpu(), pb[i].second.cpu())) << pa[i].first;
    const stats::CommStats c = b.comm_stats().total;
    EXPECT_GT(c.nvme_reads_ahead, 0);
    EXPECT_GT(c.nvme_read_bytes, 0);
    EXPECT_EQ(b.memory_stats().sharded_params.peak, 0);
  });
}

TEST(Cuda, CheckpointRoundTripOnTheGpuRestoresParametersAndTheCudaRng_CUDA) {
  SKIP_WITHOUT_CUDA();
  char tmpl[] = "/tmp/fsdp_cuda_ckpt_XXXXXX";
  static const std::string dir =
      std::getenv("FSDP_CUDA_DIR") ? std::getenv("FSDP_CUDA_DIR") : mkdtemp(tmpl);
  setenv("FSDP_CUDA_DIR", dir.c_str(), 1);
  run_ranks(1, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), gpu_options(pg));
    torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
    gpt::loss_on(model, gpt_batch(0, 4, small_gpt_config().block_size).to(torch::kCUDA)).backward();
    opt.step();
    ckpt::TrainingState st;
    st.step = 1;
    ckpt::save_sharded_checkpoint(dir, model, &opt, st);
    const auto after_save = torch::rand({4}, torch::kCUDA);
    auto saved = full_state_dict(model, {false, true});
    torch::manual_seed(7);
    auto other = fully_shard(gpt::GPT(small_gpt_config()), gpu_options(pg));
    torch::optim::AdamW opt2(other.sharded_parameters(), torch::optim::AdamWOptions(1.0));
    ckpt::load_sharded_checkpoint(dir, other, &opt2, nullptr);
    EXPECT_TRUE(torch::equal(torch::rand({4}, torch::kCUDA), after_save))
        << "CUDA RNG not restored";
    auto loaded = full_state_dict(other, {false, true});
    for (size_t i = 0; i < saved.size(); ++i)
      EXPECT_TRUE(torch::equal(saved[i].second, loaded[i].second)) << saved[i].first;
  });
}

// FusedAdamW on CUDA parameters steps them with at::_fused_adamw_ (its default kernel
// choice), like torch::optim::AdamW on the same GPU, its state AdamW's and on the GPU.
TEST(Cuda, FusedAdamWOnTheGpuMatchesTorchAdamW_CUDA) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(0);
  std::vector<torch::Tensor> ref = {torch::randn({100003}, torch::kCUDA),
                                    torch::randn({17}, torch::kCUDA)},
                             got;
  for (auto& t : ref) {
    t.requires_grad_(true);
    got.push_back(t.detach().clone().requires_grad_(true));
  }
  const auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.9, 0.95});
  torch::optim::AdamW torch_opt(ref, o);
  FusedAdamW fused(got, o);
  EXPECT_EQ(fused.kernel(), FusedAdamW::Kernel::kAuto);
  double worst = 0;
  for (int step = 0; step < 20; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn(ref[i].sizes(), torch::kCUDA);
      ref[i].mutable_grad() = g.clone();
      got[i].mutable_grad() = g.clone();
    }
    torch_opt.step();
    fused.step();
    for (size_t i = 0; i < ref.size(); ++i) {
      const auto d = ((got[i] - ref[i]).abs().max() / ref[i].abs().max()).item<double>();
      worst = std::max(worst, d);
    }
  }
  std::cout << "[ aten fused cuda ] max relative difference after 20 steps: " << worst << std::endl;
  EXPECT_LE(worst, 1e-5);
  for (auto& p : got) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(
        *fused.state().at(fsdp::detail::optim_state_key(fused.state(), p)));
    EXPECT_EQ(st.step(), 20);
    EXPECT_TRUE(st.exp_avg().is_cuda());
    EXPECT_TRUE(st.exp_avg_sq().is_cuda());
  }
}

}  // namespace

namespace {

// fsdp::device_memory reads the CUDA caching allocator; a CPU device has none, and a
// CPU-only build has no allocator at all: each says so.
TEST(Cuda, DeviceMemoryOfTheCpuIsRefusedNamingTheDevice) {
  try {
    fsdp::stats::device_memory(torch::kCPU);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (FSDP_TEST_HAVE_CUDA) {
      EXPECT_EQ(what,
                "device_memory: cpu is not a CUDA device; the caching allocator's figures exist "
                "for cuda:N only (for host memory read the process's peak RSS)");
    } else {
      EXPECT_EQ(what,
                "device_memory(cpu): fsdp was built against a CPU-only LibTorch, which has no "
                "CUDA caching allocator; rebuild against a CUDA LibTorch");
    }
  }
}

// Activation offload on a GPU (Note [Activation offload]): the device bytes a forward
// leaves for backward drop by exactly the checkpointed blocks' inputs, one (rows, T, d)
// fp32 tensor per block (sizes multiples of the caching allocator's 512-byte blocks).
TEST(Cuda, ActivationOffloadDropsTheDeviceBytesOfTheBlockInputs_CUDA) {
  SKIP_WITHOUT_CUDA();
  auto allocated = []() {
    torch::cuda::synchronize();
    return fsdp::stats::device_memory(torch::Device(torch::kCUDA, 0)).allocated;
  };
  auto cfg = small_gpt_config();
  cfg.n_layer = 4;
  const int64_t rows = 8, T = cfg.block_size, d = cfg.d_model;
  {
    // The first matmul on a stream makes cuBLAS allocate its workspace (32 MiB on an
    // H200) through the caching allocator, and keep it: a forward and backward before the
    // measured ones, so that neither counts it (the first run on a GPU measured 32 MiB
    // more for the run without offload).
    torch::manual_seed(0);
    auto warm = fully_shard(gpt::GPT(cfg), gpu_options(ProcessGroup()));
    gpt::loss_on(warm, gpt_batch(0, rows, T).to(torch::kCUDA)).backward();
  }
  int64_t held[2] = {0, 0};
  std::vector<float> losses[2];
  for (int off = 0; off < 2; ++off) {
    ShardingOptions o = gpu_options(ProcessGroup());
    o.checkpoint_policy = wrap::module_type_policy<gpt::Block>();
    o.offload_activations = off == 1;
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(cfg), o);
    auto batch = gpt_batch(0, rows, T).to(torch::kCUDA);
    const int64_t before = allocated();
    auto loss = gpt::loss_on(model, batch);
    held[off] = allocated() - before;
    loss.backward();
    losses[off].push_back(loss.item<float>());
    EXPECT_EQ(model.memory_stats().offloaded_activations.peak,
              off ? cfg.n_layer * rows * T * d * 4 : 0);
  }
  EXPECT_EQ(held[0] - held[1], cfg.n_layer * rows * T * d * 4);
  EXPECT_EQ(losses[0], losses[1]);
  const fsdp::stats::DeviceMemory m = fsdp::stats::device_memory(torch::Device(torch::kCUDA, 0));
  EXPECT_GE(m.peak_allocated, m.allocated);
  EXPECT_GE(m.reserved, m.allocated);
}

// The example GPT's fused attention on the GPU (flash or memory-efficient kernels): its
// logits within bf16 rounding of the explicit softmax's, and dropout through the kernel
// (its Philox offset from the CUDA generator) redrawn exactly when activation
// checkpointing recomputes the block: the same gradients and the same generator state
// after backward.
TEST(Cuda, FusedAttentionMatchesTheMathPathAndCheckpointingRedrawsItsDropout_CUDA) {
  SKIP_WITHOUT_CUDA();
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(dtype);
    auto cfg = small_gpt_config();
    cfg.attention = examples::AttentionKernel::kSdpa;
    torch::manual_seed(51);
    gpt::GPT fused(cfg);
    cfg.attention = examples::AttentionKernel::kMath;
    torch::manual_seed(51);
    gpt::GPT math(cfg);
    fused->to(torch::kCUDA, dtype);
    math->to(torch::kCUDA, dtype);
    fused->eval();
    math->eval();
    torch::NoGradGuard g;
    auto x = gpt_batch(0, 4, cfg.block_size).narrow(1, 0, cfg.block_size).to(torch::kCUDA);
    auto a = fused->forward(x).to(torch::kFloat), b = math->forward(x).to(torch::kFloat);
    const double rel = ((a - b).abs().max() / b.abs().max()).item<double>();
    EXPECT_LE(rel, dtype == torch::kFloat ? 1e-5 : 2e-2);
  }
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(dtype);
    auto cfg = small_gpt_config();
    cfg.dropout = 0.1;
    torch::manual_seed(52);
    gpt::Block block(cfg);
    block->to(torch::kCUDA, dtype);
    auto x0 = torch::randn({2, cfg.block_size, cfg.d_model},
                           torch::TensorOptions().device(torch::kCUDA).dtype(dtype));
    auto run = [&](bool ckpt) {
      block->zero_grad();
      auto x = x0.clone().requires_grad_(true);
      torch::manual_seed(5);  // seeds the CUDA generator too
      auto y = ckpt ? activation_checkpoint([&](const torch::Tensor& t) { return block(t); }, x)
                    : block(x);
      y.to(torch::kFloat).pow(2).sum().backward();
      std::vector<torch::Tensor> out;
      for (auto& p : block->parameters()) out.push_back(p.grad().clone());
      out.push_back(x.grad().clone());
      out.push_back(torch::rand({4}, torch::TensorOptions().device(torch::kCUDA)));
      return out;
    };
    auto plain = run(false), ckpt = run(true);
    ASSERT_EQ(plain.size(), ckpt.size());
    // The fused backward kernels may accumulate in another order from run to run
    // (atomics), so gradients agree to rounding, not bit for bit; a different mask would
    // change them by far more (a tenth of the probabilities dropped elsewhere).
    const double tol = dtype == torch::kFloat ? 1e-4 : 2e-2;
    for (size_t i = 0; i + 1 < plain.size(); ++i) {
      const double rel = ((plain[i].to(torch::kFloat) - ckpt[i].to(torch::kFloat)).abs().max() /
                          plain[i].to(torch::kFloat).abs().max().clamp_min(1e-30))
                             .item<double>();
      EXPECT_LE(rel, tol) << "tensor " << i;
    }
    EXPECT_TRUE(torch::equal(plain.back(), ckpt.back())) << "the CUDA generator after backward";
  }
}

}  // namespace

// ZeRO++ on CUDA tensors (Note [Quantized training]: ATen ops, the collectives' buffers on
// the tensors' device): two ranks share the GPU over Gloo (its CUDA tensors staged through
// pinned host memory), qwZ and qgZ under FULL_SHARD (no hpZ), against the same run on the
// CPU. Quantization is deterministic, but the GPU's matmuls round differently, so the
// losses agree to 1e-3, not bit for bit.
TEST(Cuda, QuantizedCommunicationOnCudaTensorsTrainsLikeOnTheCpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  run_ranks(2,
            [](const ProcessGroup& pg) {
              auto losses = [&](torch::Device device) {
                ShardingOptions o;
                o.process_group = pg;
                o.device = device;
                o.mixed_precision.param_dtype = torch::kBFloat16;
                o.mixed_precision.reduce_dtype = torch::kBFloat16;
                o.quantized_communication.weights = true;
                o.quantized_communication.gradients = true;
                o.quantized_communication.block_size = 64;
                torch::manual_seed(3);
                auto model = fully_shard(MlpNet(), o);
                torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.05));
                std::vector<double> out;
                for (int step = 0; step < 6; ++step) {
                  auto [x, y] = mlp_batch(step, 8);
                  auto loss = torch::mse_loss(model(my_rows(x, pg).to(device)).to(torch::kFloat),
                                              my_rows(y, pg).to(device));
                  loss.backward();
                  opt.step();
                  opt.zero_grad();
                  out.push_back(loss.item<double>());
                }
                EXPECT_EQ(model.comm_stats().total.quantized_reduce_scatter_calls,
                          6 * static_cast<int64_t>(fsdp::detail::flat_params(model).size()));
                return out;
              };
              const auto gpu = losses(torch::Device(torch::kCUDA, 0));
              const auto cpu = losses(torch::kCPU);
              for (size_t i = 0; i < gpu.size(); ++i)
                EXPECT_NEAR(gpu[i], cpu[i], 1e-3 * cpu[i]) << i;
            },
            300, {"FSDP_TEST_BACKEND=gloo"});
}

}  // namespace test_cuda_cases
