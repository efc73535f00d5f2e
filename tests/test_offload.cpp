// CPU offload: training with cpu_offload equals training without it (world 1 and 2,
// fp32 and bf16), its transit buffers are counted and returned, and the host-memory
// check refuses a model larger than the machine before allocating anything; shards in host
// memory use fsdp's block allocator (Note [Host heap]).
#include <fsdp/fused_adamw.h>

#include "support/counting_allocator.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include "../src/engine/host_heap.h"        // the block allocator's counters
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_offload_cases {

namespace {

void offload_parity(const ProcessGroup& pg, bool bf16) {
  auto options = [&](bool offload) {
    ShardingOptions o;
    o.process_group = pg;
    o.offload_optimizer.device = o.offload_param.device =
        offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
    if (bf16) {
      o.mixed_precision.param_dtype = torch::kBFloat16;
      o.mixed_precision.reduce_dtype = torch::kBFloat16;
    }
    return o;
  };
  torch::manual_seed(0);
  auto plain = fully_shard(gpt::GPT(small_gpt_config()), options(false));
  torch::manual_seed(0);
  auto off = fully_shard(gpt::GPT(small_gpt_config()), options(true));
  FusedAdamW opt_plain(plain.sharded_parameters(),
                       torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  FusedAdamW opt_off(off.sharded_parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  for (auto& p : off.sharded_parameters()) EXPECT_TRUE(p.is_cpu());
  int64_t largest_shard = 0, trainable_shard_bytes = 0;
  for (const auto& f : fsdp::detail::flat_params(off)) {
    largest_shard = std::max(largest_shard, f.shard_numel);
    if (f.requires_grad) trainable_shard_bytes += 4 * f.shard_numel;
  }
  for (int64_t s = 0; s < 5; ++s) {
    auto rows = my_rows(gpt_batch(s, 8, small_gpt_config().block_size), pg);
    auto lp = gpt::loss_on(plain, rows), lo = gpt::loss_on(off, rows);
    EXPECT_EQ(lp.item<double>(), lo.item<double>()) << "step " << s;
    lp.backward();
    lo.backward();
    opt_plain.step();
    opt_off.step();
    opt_plain.zero_grad();
    opt_off.zero_grad();
    auto m = off.memory_stats();
    EXPECT_EQ(m.offload_buffers.current, 0) << "transit buffers must be returned";
    // Shards in transit to their gathers (param_dtype; prefetch may have two in flight)
    // and, once gradients exist (zero_grad keeps them), gradient shards back from the
    // device that wait to be added, at most two units' (Note [Offload transfers]).
    const int64_t elem = bf16 ? 2 : 4;
    EXPECT_GE(m.offload_buffers.peak, largest_shard * elem);
    EXPECT_LE(m.offload_buffers.peak, 2 * largest_shard * elem + 2 * largest_shard * 4);
    EXPECT_EQ(plain.memory_stats().offload_buffers.peak, 0);
    EXPECT_EQ(m.sharded_params.current, plain.memory_stats().sharded_params.current);
    // The copies themselves: every gather's input went to the device (a shard in
    // param_dtype, one per all-gather), every fp32 gradient shard came back once.
    const auto c = off.comm_stats().step;
    EXPECT_EQ(c.offload_to_host_bytes, trainable_shard_bytes) << "step " << s;
    EXPECT_GT(c.offload_to_device_bytes, 0);
    if (pg.size() > 1)
      EXPECT_EQ(c.offload_to_device_bytes * pg.size(), c.all_gather_bytes) << "step " << s;
    EXPECT_EQ(plain.comm_stats().total.offload_to_device_bytes +
                  plain.comm_stats().total.offload_to_host_bytes,
              0);
  }
  auto a = full_state_dict(plain), b = full_state_dict(off);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
}

class OffloadAtWorld : public ::testing::TestWithParam<int> {};
TEST_P(OffloadAtWorld, TrainsExactlyLikeWithoutOffloadFp32) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { offload_parity(pg, false); });
}
TEST_P(OffloadAtWorld, TrainsExactlyLikeWithoutOffloadBf16) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { offload_parity(pg, true); });
}
INSTANTIATE_TEST_SUITE_P(World, OffloadAtWorld, ::testing::Values(1, 2),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

// Gradients accumulated over micro-batches with offload: every micro-batch after the
// first adds its gradient shard into the one on the host once its copy has landed, with
// and without no_sync. The same training as without offload, bit for bit.
void offload_accumulation(const ProcessGroup& pg, bool no_sync) {
  auto options = [&](bool offload) {
    ShardingOptions o;
    o.process_group = pg;
    o.offload_optimizer.device = o.offload_param.device =
        offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
    return o;
  };
  torch::manual_seed(0);
  auto plain = fully_shard(gpt::GPT(small_gpt_config()), options(false));
  torch::manual_seed(0);
  auto off = fully_shard(gpt::GPT(small_gpt_config()), options(true));
  // set_to_none-style zero_grad: the first micro-batch sets the gradient, later ones add.
  auto zero_grad = [](auto& model) {
    for (auto& p : model.sharded_parameters()) p.mutable_grad() = torch::Tensor();
  };
  torch::optim::AdamW opt_plain(plain.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW opt_off(off.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  int64_t largest_shard = 0;
  for (const auto& f : fsdp::detail::flat_params(off))
    largest_shard = std::max(largest_shard, f.shard_numel);
  const int micro = 3;
  for (int64_t s = 0; s < 3; ++s) {
    zero_grad(plain);
    zero_grad(off);
    for (int k = 0; k < micro; ++k) {
      auto rows = my_rows(gpt_batch(10 * s + k, 4, small_gpt_config().block_size), pg);
      auto backward = [&](auto& model) {
        if (no_sync && k + 1 < micro) {
          NoSyncScope scope(model);
          (gpt::loss_on(model, rows) / micro).backward();
        } else {
          (gpt::loss_on(model, rows) / micro).backward();
        }
      };
      backward(plain);
      backward(off);
      EXPECT_EQ(off.memory_stats().offload_buffers.current, 0)
          << "step " << s << " micro-batch " << k;
    }
    const auto a = plain.sharded_parameters(), b = off.sharded_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(b[i].grad().defined());
      EXPECT_TRUE(torch::equal(a[i].grad(), b[i].grad())) << "step " << s << " gradient " << i;
    }
    opt_plain.step();
    opt_off.step();
  }
  const auto peak = off.memory_stats().offload_buffers.peak;
  // Without no_sync every micro-batch after the first lands an added copy.
  if (!no_sync) EXPECT_GE(peak, largest_shard * 4);
  EXPECT_LE(peak, 2 * largest_shard * 4 + 2 * largest_shard * 4);
  auto fa = full_state_dict(plain), fb = full_state_dict(off);
  for (size_t i = 0; i < fa.size(); ++i)
    EXPECT_TRUE(torch::equal(fa[i].second, fb[i].second)) << fa[i].first;
}

TEST_P(OffloadAtWorld, AccumulatesGradientsExactlyLikeWithoutOffload) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { offload_accumulation(pg, false); });
}
TEST_P(OffloadAtWorld, AccumulatesUnderNoSyncExactlyLikeWithoutOffload) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { offload_accumulation(pg, true); });
}

// FusedAdamW writes the bf16 copy of each shard in its update pass and the next gathers
// send it instead of casting (FusedAdamW's constructor over the model): the same training, bit for
// bit, and a shard changed behind the optimizer's back is never served from a stale copy.
void copy_out_parity(const ProcessGroup& pg, bool offload) {
  ShardingOptions o;
  o.process_group = pg;
  o.offload_optimizer.device = o.offload_param.device =
      offload ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.reduce_dtype = torch::kBFloat16;
  torch::manual_seed(0);
  auto a = fully_shard(gpt::GPT(small_gpt_config()), o);
  torch::manual_seed(0);
  auto b = fully_shard(gpt::GPT(small_gpt_config()), o);
  FusedAdamW opt_a(a.sharded_parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  // Over the model: the constructor attaches the copy-out (over a tensor list it does not).
  FusedAdamW opt_b(b, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  auto step = [&](int64_t s) {
    auto rows = my_rows(gpt_batch(s, 8, small_gpt_config().block_size), pg);
    auto la = gpt::loss_on(a, rows), lb = gpt::loss_on(b, rows);
    EXPECT_EQ(la.item<double>(), lb.item<double>()) << "step " << s;
    la.backward();
    lb.backward();
    opt_a.step();
    opt_b.step();
    opt_a.zero_grad();
    opt_b.zero_grad();
  };
  step(0);
  EXPECT_EQ(fsdp::detail::copy_out_gathers(b), 0)
      << "no copy exists before the first optimizer step";
  int64_t last = 0;
  for (int64_t s = 1; s < 4; ++s) {
    step(s);
    EXPECT_GT(fsdp::detail::copy_out_gathers(b), last)
        << "step " << s << " did not use the optimizer's copy";
    last = fsdp::detail::copy_out_gathers(b);
  }
  EXPECT_EQ(fsdp::detail::copy_out_gathers(a), 0);
  // Shards changed outside the optimizer: the copies are stale and must not be used.
  {
    torch::NoGradGuard g;
    for (auto* m : {&a, &b}) {
      for (auto& p : m->sharded_parameters()) p.mul_(0.5);
    }
  }
  auto rows = my_rows(gpt_batch(9, 8, small_gpt_config().block_size), pg);
  torch::NoGradGuard g;
  EXPECT_EQ(gpt::loss_on(a, rows).item<double>(), gpt::loss_on(b, rows).item<double>());
  EXPECT_EQ(fsdp::detail::copy_out_gathers(b), last) << "a stale copy was gathered";
}

TEST_P(OffloadAtWorld, OptimizerCopyOutFeedsTheGathersExactly) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { copy_out_parity(pg, false); });
}
TEST_P(OffloadAtWorld, OptimizerCopyOutFeedsTheOffloadedGathersExactly) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { copy_out_parity(pg, true); });
}

// ShardingOptions::cpu_offload is deprecated for one release: it must still mean
// offload_optimizer and offload_param on the host, exactly, under every strategy it was
// allowed with (offload_param = cpu included, where it means no device copy of the shard).

namespace {
// fully_shard's message for a small GPT under `o` ("<no error>" if it shards).
std::string shard_error(const ShardingOptions& o) {
  try {
    fully_shard(gpt::GPT(small_gpt_config()), o);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}
}  // namespace

TEST(DeprecatedCpuOffload, TrainsBitForBitLikeBothOffloadsOnTheHost) {
  for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                              ShardingStrategy::kNoShard, ShardingStrategy::kZero2}) {
    SCOPED_TRACE("strategy " + std::to_string(static_cast<int>(strategy)));
    auto train = [&](bool deprecated) {
      ShardingOptions o;
      o.strategy = strategy;
      o.mixed_precision.param_dtype = torch::kBFloat16;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
      if (deprecated) o.cpu_offload = true;
#pragma GCC diagnostic pop
      if (!deprecated) o.offload_optimizer.device = o.offload_param.device = OffloadDevice::kCpu;
      torch::manual_seed(0);
      auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
      FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
      std::vector<double> losses;
      for (int64_t s = 0; s < 3; ++s) {
        auto loss = gpt::loss_on(model, gpt_batch(s, 4, small_gpt_config().block_size));
        losses.push_back(loss.item<double>());
        loss.backward();
        opt.step();
        opt.zero_grad();
      }
      const auto m = model.memory_stats();
      return std::tuple{losses, m.offload_buffers.peak, m.device_param_shards.peak,
                        model.comm_stats().total.offload_to_device_bytes};
    };
    const auto [old_losses, old_transit, old_copies, old_bytes] = train(true);
    const auto [losses, transit, copies, bytes] = train(false);
    EXPECT_EQ(old_losses, losses);
    EXPECT_EQ(old_transit, transit);
    EXPECT_EQ(old_copies, 0) << "offload_param on the host keeps no device copy";
    EXPECT_EQ(copies, 0);
    EXPECT_GT(old_bytes, 0);
    EXPECT_EQ(old_bytes, bytes);
  }
  // With an NVMe offload it contradicts itself, and says so.
  ShardingOptions o;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  o.cpu_offload = true;
#pragma GCC diagnostic pop
  o.offload_optimizer.device = OffloadDevice::kNvme;
  EXPECT_EQ(shard_error(o),
            "ShardingOptions::cpu_offload (everything to host memory) contradicts "
            "ShardingOptions::offload_optimizer.device=nvme and "
            "ShardingOptions::offload_param.device=none; use one or the other "
            "(ShardingOptions::cpu_offload means both offloads on the host)");
}

#ifndef USE_C10D_NCCL
// A CPU-only LibTorch cannot offload to a GPU: fully_shard says so and how to fix it.
TEST(OffloadErrors, ToAGpuWithACpuOnlyLibTorch) {
  ShardingOptions o;
  o.device = torch::Device(torch::kCUDA, 0);
  o.offload_optimizer.device = o.offload_param.device = fsdp::OffloadDevice::kCpu;
  EXPECT_EQ(shard_error(o),
            "fsdp was built against a CPU-only LibTorch, so it cannot offload to cuda:0; rebuild "
            "against a "
            "CUDA LibTorch (cmake -DCMAKE_PREFIX_PATH=<libtorch with CUDA>).");
}
#endif

// A parameter whose memory is reserved but never touched (torch::empty of many GB costs
// address space, not RAM), so the test can ask for more than the machine has.
struct HugeImpl : torch::nn::Module {
  explicit HugeImpl(int64_t n) { register_parameter("w", torch::empty({n})); }
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Huge);

int64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoll(line.substr(13)) * 1024;
  }
  return -1;
}

TEST(HostMemoryCheck, RefusesAModelThatNeedsMoreThanTheMachineHas) {
  const int64_t avail = mem_available();
  ASSERT_GT(avail, 0);
  // Needs 16 bytes per element: twice what is available.
  const int64_t n = avail / 8;
  ShardingOptions o;
  o.offload_optimizer.device = o.offload_param.device = fsdp::OffloadDevice::kCpu;
  try {
    fully_shard(Huge(n), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("fully_shard: not enough host memory. " + std::to_string(n) +
                       " parameters sharded over 1 ranks need"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("is available (MemAvailable)"), std::string::npos) << msg;
    // Built in full before sharding: the message says what that held and names the way out.
    EXPECT_NE(msg.find("This model was constructed in full on every rank ("), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("fsdp::make_sharded constructs it already sharded."), std::string::npos)
        << msg;
  }
  // A model that fits passes the same check.
  o.offload_optimizer.device = o.offload_param.device = fsdp::OffloadDevice::kCpu;
  EXPECT_NO_THROW(fully_shard(gpt::GPT(small_gpt_config()), o));
}

// Note [Host heap]: where the shards live in host memory, fully_shard makes fsdp's block
// allocator LibTorch's CPU allocator: blocks of 64 KiB and more are mapped for themselves,
// freed ones are kept for reuse by the same size, and live + kept bytes never exceed the
// most that was ever live. Each case runs in a process of its own (run_ranks at world 1):
// the allocator is the process's.

// A GPT of width 16 and one block: every tensor of its sharding is below 64 KiB, so the
// block allocator starts the cases below with nothing counted.
void shard_small_model_on_the_cpu(const ProcessGroup& pg) {
  ShardingOptions o;
  o.process_group = pg;
  gpt::Config c = small_gpt_config();
  c.n_layer = 1;
  c.d_model = 16;
  torch::manual_seed(0);
  fully_shard(gpt::GPT(c), o);
}

torch::Tensor mib(int64_t m) { return torch::empty({m << 18}); }  // m MiB of fp32

void expect_stats(int64_t live, int64_t cached, int64_t peak, int64_t mapped, int64_t reused,
                  int64_t unmapped, const char* when) {
  const fsdp::detail::HostBlockStats s = fsdp::detail::host_block_stats();
  EXPECT_EQ(s.live_bytes, live) << when;
  EXPECT_EQ(s.cached_bytes, cached) << when;
  EXPECT_EQ(s.peak_live_bytes, peak) << when;
  EXPECT_EQ(s.mapped, mapped) << when;
  EXPECT_EQ(s.reused, reused) << when;
  EXPECT_EQ(s.unmapped, unmapped) << when;
  EXPECT_LE(s.live_bytes + s.cached_bytes, s.peak_live_bytes) << when;
}

TEST(HostHeap, ShardsInHostMemoryUseTheBlockAllocatorWhichKeepsWithinThePeak) {
  run_ranks(1, [](const ProcessGroup& pg) {
    EXPECT_EQ(c10::GetCPUAllocator(), c10::GetDefaultCPUAllocator());
    EXPECT_FALSE(fsdp::detail::host_blocks_installed());
    shard_small_model_on_the_cpu(pg);
    EXPECT_NE(c10::GetCPUAllocator(), c10::GetDefaultCPUAllocator());
    EXPECT_TRUE(fsdp::detail::host_blocks_installed());
    constexpr int64_t M = int64_t{1} << 20;
    expect_stats(0, 0, 0, 0, 0, 0, "after sharding the small GPT");
    { auto small = torch::empty({1000}); }  // 4000 bytes: glibc's
    expect_stats(0, 0, 0, 0, 0, 0, "after a block below 64 KiB");
    void* a_block = nullptr;
    {
      auto a = mib(4), b = mib(4);
      a_block = a.data_ptr();
      expect_stats(8 * M, 0, 8 * M, 2, 0, 0, "two blocks of 4 MiB");
    }  // freed b, then a: both kept
    expect_stats(0, 8 * M, 8 * M, 2, 0, 0, "both freed");
    {
      // A new size: 2 MiB live leaves room for 6 kept, so the oldest kept (b) goes.
      auto c = mib(2);
      expect_stats(2 * M, 4 * M, 8 * M, 3, 0, 1, "a block of 2 MiB");
      auto d = mib(4);  // a, reused: no mapping
      EXPECT_EQ(d.data_ptr(), a_block);
      expect_stats(6 * M, 0, 8 * M, 3, 1, 1, "4 MiB again");
      auto e = mib(4);  // a new peak of 10 MiB, nothing kept to reuse
      expect_stats(10 * M, 0, 10 * M, 4, 1, 1, "a third block of 4 MiB");
    }  // kept, oldest first: e, d, c
    expect_stats(0, 10 * M, 10 * M, 4, 1, 1, "all freed");
    const int64_t page = sysconf(_SC_PAGESIZE);
    const int64_t odd = (100000 + page - 1) / page * page;  // 100000 bytes, page-rounded
    auto f = torch::empty({25000});
    // Room for 10 MiB - odd kept: the oldest (e, 4 MiB) goes.
    expect_stats(odd, 6 * M, 10 * M, 5, 1, 2, "a block of 100000 bytes");
    // A block no machine has (2^58 bytes): LibTorch's out-of-memory error, every kept block
    // unmapped on the way (d, c), and the peak it would have raised taken back.
    try {
      torch::empty({int64_t{1} << 58}, torch::kByte);
      ADD_FAILURE() << "a block of 2^58 bytes was mapped";
    } catch (const c10::OutOfMemoryError& e) {
      // The message names the size asked, what is live, mmap's reason and the way out.
      const std::string msg = e.what_without_backtrace();
      const std::string want = "fsdp's host block allocator: out of memory: tried to allocate " +
                               std::to_string(int64_t{1} << 58) + " bytes with " +
                               std::to_string(odd) + " bytes in live blocks (mmap: ";
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
      EXPECT_NE(msg.find("; FSDP_HOST_ALLOCATOR=glibc uses LibTorch's own)"), std::string::npos)
          << msg;
    }
    expect_stats(odd, 0, 10 * M, 5, 1, 4, "after a block too large for the machine");
  });
}

TEST(HostHeap, TheUsersChoicesWin) {
  // A CPU allocator the program installed.
  run_ranks(1, [](const ProcessGroup& pg) {
    auto& counting = CountingCpuAllocator::install();
    shard_small_model_on_the_cpu(pg);
    EXPECT_EQ(c10::GetCPUAllocator(), &counting);
    EXPECT_FALSE(fsdp::detail::host_blocks_installed());
    const int64_t before = counting.live();
    auto a = mib(4);
    EXPECT_EQ(counting.live() - before, 4 << 20);  // the program's allocator served it
    EXPECT_EQ(fsdp::detail::host_block_stats().live_bytes, 0);
  });
  // glibc tuned through its variable, or LibTorch's and glibc's defaults asked for.
  for (const char* env : {"MALLOC_MMAP_THRESHOLD_=4194304", "FSDP_HOST_ALLOCATOR=glibc"}) {
    run_ranks(1,
              [env](const ProcessGroup& pg) {
                shard_small_model_on_the_cpu(pg);
                EXPECT_EQ(c10::GetCPUAllocator(), c10::GetDefaultCPUAllocator()) << env;
                EXPECT_FALSE(fsdp::detail::host_blocks_installed()) << env;
                auto a = mib(4);
                EXPECT_EQ(fsdp::detail::host_block_stats().live_bytes, 0) << env;
              },
              300, {env});
  }
}

TEST(HostHeap, ABadFsdpHostAllocatorIsRefusedByName) {
  run_ranks(1,
            [](const ProcessGroup& pg) {
              try {
                shard_small_model_on_the_cpu(pg);
                ADD_FAILURE() << "FSDP_HOST_ALLOCATOR=jemalloc was accepted";
              } catch (const c10::Error& e) {
                const std::string msg = e.what_without_backtrace();
                EXPECT_NE(msg.find("FSDP_HOST_ALLOCATOR='jemalloc' is neither blocks (the default: "
                                   "fsdp's block allocator for host memory) nor glibc"),
                          std::string::npos)
                    << msg;
              }
            },
            300, {"FSDP_HOST_ALLOCATOR=jemalloc"});
}

}  // namespace

}  // namespace test_offload_cases
