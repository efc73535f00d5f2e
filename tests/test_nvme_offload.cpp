// NVMe offload (offload_optimizer with OffloadDevice::kNvme): training with the optimizer
// state in files equals in-memory training bit for bit (world 1 and 2, fp32 and bf16,
// io_uring and the thread pool), and a bad nvme_path (empty, missing, a file, read-only,
// too full) is refused before training with the figures and the fix.
#include <fsdp/fused_adamw.h>

#include "support/models.h"
#include "support/multirank.h"
#include "support/temp_dir.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include "../src/internal/optim_key.h"      // the state map's key
#include "../src/internal/sharded_model.h"  // shard sizes for the expected bytes
#include "../src/nvme/state_file.h"         // StateFile::page_access

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_nvme_offload_cases {

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

ShardingOptions nvme_options(const ProcessGroup& pg, const std::string& dir, bool bf16) {
  ShardingOptions o;
  o.process_group = pg;
  o.offload_optimizer.device = OffloadDevice::kNvme;
  o.offload_optimizer.nvme_path = dir;
  // Three slots of 1024-element chunks: every parameter spans several chunks and chunks
  // of consecutive parameters share the pipeline.
  o.offload_optimizer.buffer_bytes = 24 * 1024;
  if (bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  return o;
}

torch::optim::AdamWParamState& state_of(FusedAdamW& opt, const torch::Tensor& p) {
  auto& st = opt.state();
  return static_cast<torch::optim::AdamWParamState&>(*st.at(fsdp::detail::optim_state_key(st, p)));
}

// Trains `plain` and `nvme` on the same batches for `steps` steps: equal losses at every
// step and equal parameters after.
template <class Model>
void train_side_by_side(const ProcessGroup& pg, Model& plain, Model& nvme, FusedAdamW& opt_plain,
                        FusedAdamW& opt_nvme, int64_t steps) {
  for (int64_t s = 0; s < steps; ++s) {
    auto rows = my_rows(gpt_batch(s, 8, small_gpt_config().block_size), pg);
    torch::Tensor lp = gpt::loss_on(plain, rows), ln = gpt::loss_on(nvme, rows);
    EXPECT_EQ(lp.item<double>(), ln.item<double>()) << "step " << s;
    lp.backward();
    ln.backward();
    opt_plain.step();
    opt_nvme.step();
    opt_plain.zero_grad();
    opt_nvme.zero_grad();
  }
  auto a = full_state_dict(plain), b = full_state_dict(nvme);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
}

void nvme_parity(const ProcessGroup& pg, bool bf16, const char* io) {
  setenv("FSDP_NVME_IO", io, 1);
  TempDir dir;
  ShardingOptions plain_opts = nvme_options(pg, dir.path, bf16);
  plain_opts.offload_optimizer = {};
  torch::manual_seed(0);
  auto plain = fully_shard(gpt::GPT(small_gpt_config()), plain_opts);
  torch::manual_seed(0);
  auto nvme = fully_shard(gpt::GPT(small_gpt_config()), nvme_options(pg, dir.path, bf16));
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  FusedAdamW opt_plain(plain, adamw), opt_nvme(nvme, adamw);
  ASSERT_FALSE(opt_plain.state_offloaded());
  ASSERT_TRUE(opt_nvme.state_offloaded());
  for (auto& p : nvme.sharded_parameters()) EXPECT_TRUE(p.is_cpu());
  train_side_by_side(pg, plain, nvme, opt_plain, opt_nvme, 4);
  // The state, read through its views of the file, equals the in-memory state.
  auto pp = plain.sharded_parameters(), pn = nvme.sharded_parameters();
  for (size_t i = 0; i < pp.size(); ++i) {
    if (!pp[i].requires_grad()) continue;
    auto &sp = state_of(opt_plain, pp[i]), &sn = state_of(opt_nvme, pn[i]);
    EXPECT_EQ(sp.step(), sn.step());
    EXPECT_TRUE(torch::equal(sp.exp_avg(), sn.exp_avg())) << "exp_avg of shard " << i;
    EXPECT_TRUE(torch::equal(sp.exp_avg_sq(), sn.exp_avg_sq())) << "exp_avg_sq of shard " << i;
  }
  unsetenv("FSDP_NVME_IO");
}

// Whether FSDP_NVME_IO=io_uring works here (a build with liburing, a kernel and seccomp
// policy that allow io_uring); else `why` says what refused it.
bool io_uring_usable(std::string* why) {
  TempDir dir;
  setenv("FSDP_NVME_IO", "io_uring", 1);
  FusedAdamW opt({torch::zeros({1024})});
  OffloadConfig cfg;
  cfg.device = OffloadDevice::kNvme;
  cfg.nvme_path = dir.path;
  *why = error_of([&] { opt.offload_state(cfg); });
  unsetenv("FSDP_NVME_IO");
  return *why == "<no error>";
}

}  // namespace

class NvmeAtWorld : public ::testing::TestWithParam<int> {};
TEST_P(NvmeAtWorld, TrainsBitIdenticallyToInMemoryStateFp32) {
  std::string why;
  if (!is_rank_process() && !io_uring_usable(&why)) GTEST_SKIP() << why;
  run_ranks(GetParam(), [](const ProcessGroup& pg) { nvme_parity(pg, false, "io_uring"); });
}
TEST_P(NvmeAtWorld, TrainsBitIdenticallyToInMemoryStateBf16WithThreadPool) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { nvme_parity(pg, true, "threads"); });
}
INSTANTIATE_TEST_SUITE_P(World, NvmeAtWorld, ::testing::Values(1, 2));

// offload_state on plain tensors: sizes that end mid-chunk and mid-vector, several steps,
// both I/O engines; the same bits as in-memory state.
TEST(NvmeOffload, OffloadStateStepsPlainTensorsExactly) {
  std::string why;
  const bool uring = io_uring_usable(&why);
  if (!uring) std::printf("io_uring skipped: %s\n", why.c_str());
  for (const char* io : {"io_uring", "threads"}) {
    if (!uring && std::string(io) == "io_uring") continue;
    setenv("FSDP_NVME_IO", io, 1);
    TempDir dir;
    std::vector<torch::Tensor> a, b;
    torch::manual_seed(1);
    for (int64_t n : {5000, 3, 1024, 70001}) {
      a.push_back(torch::randn({n}).requires_grad_());
      b.push_back(a.back().detach().clone().requires_grad_());
    }
    const auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
    FusedAdamW mem(a, o), nvme(b, o);
    OffloadConfig cfg;
    cfg.device = OffloadDevice::kNvme;
    cfg.nvme_path = dir.path;
    cfg.buffer_bytes = 24 * 1024;
    nvme.offload_state(cfg);
    const std::string info = nvme.state_offload_info();
    EXPECT_EQ(info.rfind(io, 0), 0u) << info;
    EXPECT_EQ(info.substr(info.size() - 23), "chunks of 1024 elements") << info;
    for (int s = 0; s < 3; ++s) {
      for (size_t i = 0; i < a.size(); ++i) {
        auto g = torch::randn_like(a[i]);
        a[i].mutable_grad() = g;
        b[i].mutable_grad() = g.clone();
      }
      mem.step();
      nvme.step();
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << io << " tensor " << i;
      EXPECT_TRUE(torch::equal(state_of(mem, a[i]).exp_avg_sq(), state_of(nvme, b[i]).exp_avg_sq()))
          << io << " tensor " << i;
    }
    unsetenv("FSDP_NVME_IO");
  }
}

// A state replaced from outside (as a checkpoint load does) is written to the file at
// the next step and replaced by views of it, and stepping goes on from its values.
TEST(NvmeOffload, LoadedStateIsAdoptedIntoTheFile) {
  TempDir dir;
  auto a = torch::randn({3000}).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  FusedAdamW mem({a}), nvme({b});
  OffloadConfig cfg;
  cfg.device = OffloadDevice::kNvme;
  cfg.nvme_path = dir.path;
  cfg.buffer_bytes = 24 * 1024;
  nvme.offload_state(cfg);
  auto g = torch::randn({3000});
  a.mutable_grad() = g;
  b.mutable_grad() = g.clone();
  mem.step();
  nvme.step();
  const void* view = state_of(nvme, b).exp_avg().data_ptr();
  auto m = torch::randn({3000}), v = torch::rand({3000});
  state_of(mem, a).exp_avg(m.clone());
  state_of(mem, a).exp_avg_sq(v.clone());
  state_of(nvme, b).exp_avg(m.clone());
  state_of(nvme, b).exp_avg_sq(v.clone());
  mem.step();
  nvme.step();
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_EQ(state_of(nvme, b).exp_avg().data_ptr(), view) << "the view of the file again";
  EXPECT_TRUE(torch::equal(state_of(mem, a).exp_avg(), state_of(nvme, b).exp_avg()));
}

TEST(NvmeOffload, EmptyPathIsRefusedBeforeSharding) {
  ShardingOptions o = nvme_options(ProcessGroup(), "", false);
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_optimizer.nvme_path is empty: set it to a directory on "
            "the NVMe disk (e.g. /local_nvme/fsdp), in which each rank makes its own files");
}

TEST(NvmeOffload, MissingPathIsRefusedBeforeSharding) {
  ShardingOptions o = nvme_options(ProcessGroup(), "/nonexistent/fsdp_nvme", false);
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_optimizer.nvme_path='/nonexistent/fsdp_nvme' cannot be "
            "used: No such file or directory. Create it (mkdir -p /nonexistent/fsdp_nvme) or "
            "point it at an existing directory on the NVMe disk");
}

TEST(NvmeOffload, PathThatIsAFileIsRefused) {
  TempDir dir;
  const std::string file = dir.path + "/plain_file";
  std::ofstream(file) << "x";
  ShardingOptions o = nvme_options(ProcessGroup(), file, false);
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_optimizer.nvme_path='" + file +
                "' is not a directory; point it at a directory on the NVMe disk, in which each "
                "rank makes its own files");
  unlink(file.c_str());
}

TEST(NvmeOffload, UnwritablePathIsRefused) {
  TempDir dir;
  if (!dir.mount_tmpfs("64k", "ro")) {
    if (geteuid() == 0)
      GTEST_SKIP() << "mount -t tmpfs -o ro failed (" << std::strerror(errno)
                   << "): root without CAP_SYS_ADMIN cannot make a read-only directory";
    ASSERT_EQ(chmod(dir.path.c_str(), 0555), 0);
  }
  ShardingOptions o = nvme_options(ProcessGroup(), dir.path, false);
  const std::string why = dir.mounted ? "Read-only file system" : "Permission denied";
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_optimizer.nvme_path='" + dir.path +
                "' is not writable: creating a file there failed: " + why +
                ". Make the directory writable by this user (chmod, chown, or remount it "
                "read-write), or choose another one");
}

TEST(NvmeOffload, FullDiskIsRefusedWithBytesNeededAndAvailable) {
  TempDir dir;
  if (!dir.mount_tmpfs("64k"))
    GTEST_SKIP() << "mount -t tmpfs failed (" << std::strerror(errno)
                 << "): a full disk needs root to mount a small tmpfs";
  auto model =
      fully_shard(gpt::GPT(small_gpt_config()), nvme_options(ProcessGroup(), dir.path, false));
  int64_t need = 0, elements = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    if (!f.requires_grad) continue;
    need += 2 * ((4 * f.shard_numel + 4095) / 4096 * 4096);
    elements += f.shard_numel;
  }
  struct statvfs vfs {};
  ASSERT_EQ(statvfs(dir.path.c_str(), &vfs), 0);
  const int64_t avail = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
  ASSERT_GT(need, avail) << "the small GPT must not fit in 64 KiB";
  auto mib = [](int64_t b) {
    std::ostringstream os;
    os.precision(3);
    os << static_cast<double>(b) / (1 << 20) << " MiB";
    return os.str();
  };
  EXPECT_EQ(error_of([&] { FusedAdamW opt(model); }),
            "not enough free space in ShardingOptions::offload_optimizer.nvme_path='" + dir.path +
                "': the optimizer state of this rank (exp_avg and exp_avg_sq, 8 bytes for each "
                "of its " +
                std::to_string(elements) +
                " trainable shard elements, each tensor aligned to 4096 bytes) needs " +
                std::to_string(need) + " bytes (" + mib(need) + ") but only " +
                std::to_string(avail) + " bytes (" + mib(avail) +
                ") are available there. Free space on that disk, point nvme_path at a larger "
                "one, or shard over more ranks");
}

// Note [Shared NVMe disk]: two ranks on one disk whose free space holds one rank's
// optimizer state but not both. Each rank alone would pass its own check (and the second
// to reserve its file would fail with ENOSPC); checked together, both refuse at once,
// naming the two ranks, the bytes they need together and the bytes free.
TEST(NvmeOffload, RanksSharingADiskAreCheckedTogetherNamingTheirBytesAndTheFreeSpace) {
  std::unique_ptr<TempDir> dir;
  int64_t per_rank = 0;  // the state of one rank at world 2: 8 bytes per shard element
  if (!is_rank_process()) {
    auto one = fully_shard(gpt::GPT(small_gpt_config()), ShardingOptions());
    for (const auto& f : fsdp::detail::flat_params(one)) {
      if (!f.requires_grad) continue;
      per_rank += 2 * ((4 * ((f.shard_numel + 1) / 2) + 4095) / 4096 * 4096);
    }
    dir = std::make_unique<TempDir>();
    // Room for one rank's state and a half: not for two.
    const int64_t kib = (per_rank + per_rank / 2) / 1024;
    if (!dir->mount_tmpfs(std::to_string(kib) + "k"))
      GTEST_SKIP() << "mount -t tmpfs failed (" << std::strerror(errno)
                   << "): a small shared disk needs root to mount a tmpfs";
    struct statvfs vfs {};
    ASSERT_EQ(statvfs(dir->path.c_str(), &vfs), 0);
    const int64_t avail = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
    ASSERT_GE(avail, per_rank) << "one rank's state must fit";
    ASSERT_LT(avail, 2 * per_rank) << "two ranks' states must not";
  }
  run_ranks(2,
            [](const ProcessGroup& pg) {
              const std::string path = std::getenv("FSDP_TEST_SHARED_DISK");
              auto model = fully_shard(gpt::GPT(small_gpt_config()), nvme_options(pg, path, false));
              const std::string what = error_of([&] { FusedAdamW opt(model); });
              EXPECT_EQ(what.rfind("not enough free space in ShardingOptions::offload_optimizer."
                                   "nvme_path='" +
                                       path +
                                       "' on the disk that ranks 0, 1 share (one machine, one file "
                                       "system): together they need ",
                                   0),
                        0u)
                  << what;
              EXPECT_NE(what.find(", each rank its optimizer state (exp_avg and exp_avg_sq"),
                        std::string::npos)
                  << what;
              EXPECT_NE(
                  what.find(") are available there. Free space on that disk, point nvme_path at "
                            "a larger one (or give each rank a disk of its own), or shard over "
                            "more ranks"),
                  std::string::npos)
                  << what;
              // Nothing was reserved: the disk is as empty as before.
              struct statvfs vfs {};
              ASSERT_EQ(statvfs(path.c_str(), &vfs), 0);
              EXPECT_EQ(vfs.f_bfree, vfs.f_blocks) << "a rank reserved its file before the check";
            },
            300, {"FSDP_TEST_SHARED_DISK=" + (dir ? dir->path : std::string())});
}

TEST(NvmeOffload, TooSmallBufferIsRefused) {
  TempDir dir;
  ShardingOptions o = nvme_options(ProcessGroup(), dir.path, false);
  o.offload_optimizer.buffer_bytes = 4096;
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  EXPECT_EQ(error_of([&] { FusedAdamW opt(model); }),
            "ShardingOptions::offload_optimizer.buffer_bytes=4096 is too small: the optimizer "
            "streams three chunks of exp_avg and exp_avg_sq through it, at least 1024 elements "
            "each (24576 bytes); use 64 MiB (the default)");
}

// Pages of a StateFile in the page cache, of `bytes` from its start (mincore on the
// file's pages: their residency, whichever mapping faulted them in).
int64_t cached_pages(const fsdp::detail::nvme::StateFile& f) {
  const int64_t n = f.bytes() / 4096;
  std::vector<unsigned char> v(static_cast<size_t>(n));
  EXPECT_EQ(mincore(f.page_access(0), static_cast<size_t>(f.bytes()), v.data()), 0);
  int64_t r = 0;
  for (unsigned char c : v) r += c & 1;
  return r;
}

// Note [NVMe parameters]: the pages that the optimizer moves through a mapping (a
// segment's edges) must not pull the device's read-ahead window into the page cache
// (megabytes per edge, charged to the job's memory: 0.6 GB of a 1.7 GB peak before).
TEST(NvmeOffload, PageAccessReadsOnlyThePagesItTouches) {
  TempDir dir;
  struct statfs fs {};
  ASSERT_EQ(statfs(dir.path.c_str(), &fs), 0);
  if (fs.f_type == 0x01021994)  // TMPFS_MAGIC: memory pages, no device and no read-ahead
    GTEST_SKIP() << dir.path << " is on tmpfs, whose pages are memory: nothing to read around";
  constexpr int64_t kBytes = 16 << 20, kPage = 4096;
  fsdp::detail::nvme::StateFile f(dir.path, kBytes, "test", "parameters");
  // Written by O_DIRECT (real blocks on the disk, nothing cached), a distinct byte per page.
  fsdp::detail::nvme::AlignedBuffer buf(kBytes);
  for (int64_t p = 0; p < kBytes / kPage; ++p)
    std::memset(buf.data() + p * kPage, static_cast<int>(p % 251) + 1, kPage);
  ASSERT_EQ(pwrite(f.fd(), buf.data(), kBytes, 0), kBytes);
  ASSERT_EQ(posix_fadvise(f.fd(), 0, kBytes, POSIX_FADV_DONTNEED), 0);
  ASSERT_EQ(cached_pages(f), 0);

  const int64_t a = 2048 * kPage + 100, b = 3000 * kPage + 7;  // 8 MiB and 11.7 MiB in
  EXPECT_EQ(f.page_access(a)[0], static_cast<char>(2048 % 251 + 1));
  EXPECT_EQ(cached_pages(f), 1) << "a read through page_access read more than its page";
  f.page_access(b)[0] = 42;
  EXPECT_EQ(cached_pages(f), 2) << "a write through page_access read more than its page";
  // The O_DIRECT descriptor sees the write (the kernel writes the dirty page back first).
  fsdp::detail::nvme::AlignedBuffer page(kPage);
  ASSERT_EQ(pread(f.fd(), page.data(), kPage, b / kPage * kPage), kPage);
  EXPECT_EQ(page.data()[b % kPage], 42);
  EXPECT_EQ(page.data()[0], static_cast<char>(3000 % 251 + 1));
}

namespace {

// Per-parameter groups (ShardParamGroups, train_gpt's default no-decay recipe) keep their
// state in the model's NVMe files too, and train exactly like in memory.
TEST(NvmeOffload, ParameterGroupsOverTheShardsUseTheFilesAndTrainExactly) {
  run_ranks(2, [](const ProcessGroup& pg) {
    setenv("FSDP_NVME_IO", "threads", 1);
    TempDir dir;
    ShardingOptions plain_opts = nvme_options(pg, dir.path, false);
    plain_opts.offload_optimizer = {};
    torch::manual_seed(0);
    auto plain = fully_shard(gpt::GPT(small_gpt_config()), plain_opts);
    torch::manual_seed(0);
    auto nvme = fully_shard(gpt::GPT(small_gpt_config()), nvme_options(pg, dir.path, false));
    const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
    ShardParamGroups gp(plain, no_decay_groups(0.1)), gn(nvme, no_decay_groups(0.1));
    FusedAdamW opt_plain(gp, adamw), opt_nvme(gn, adamw);
    ASSERT_FALSE(opt_plain.state_offloaded());
    ASSERT_TRUE(opt_nvme.state_offloaded());
    train_side_by_side(pg, plain, nvme, opt_plain, opt_nvme, 3);
    unsetenv("FSDP_NVME_IO");
  });
}

}  // namespace

}  // namespace test_nvme_offload_cases
