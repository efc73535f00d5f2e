// Note [Direct I/O]: a checkpoint's large datasets written and read past the page cache,
// at their places in an ordinary HDF5 file, whatever their sizes; a full disk named.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>
#include <fsdp/param_groups.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"
#include "support/multirank.h"

#include "../checkpoint/format/h5/h5.h"
#include "../src/internal/optim_key.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_direct_cases {

namespace {

// Whether `dir`'s file system takes O_DIRECT (tmpfs does not; the code then writes
// through the page cache, which these tests cannot tell apart).
bool takes_o_direct(const std::string& dir) {
  const std::string probe = dir + "/.o_direct_probe";
  const int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_DIRECT, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

// Pages of bytes [from, to) of `path` in the page cache (mincore).
int64_t resident_pages(const std::string& path, uint64_t from, uint64_t to) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0) << path;
  struct stat st {};
  ::fstat(fd, &st);
  void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  EXPECT_NE(map, MAP_FAILED);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((static_cast<size_t>(st.st_size) + page - 1) / page);
  ::mincore(map, static_cast<size_t>(st.st_size), in.data());
  ::munmap(map, static_cast<size_t>(st.st_size));
  int64_t n = 0;
  for (uint64_t p = from / page; p < (to + page - 1) / page && p < in.size(); ++p) n += in[p] & 1;
  return n;
}

// Sizes around every boundary the writer has: a page, a checksum block (4 MiB), a staging
// buffer (8 MiB) and all four of them (32 MiB), the smallest direct dataset (1 MiB).
const std::vector<int64_t> kAwkwardNumels = {
    (int64_t{1} << 18),         // 1 MiB exactly
    (int64_t{1} << 18) + 1,     // a tail of 4 bytes
    (int64_t{2} << 20) - 3,     // 8 MiB less 12 bytes: ends inside the first buffer's last page
    (int64_t{2} << 20),         // one staging buffer exactly
    (int64_t{9} << 20) + 1023,  // more than the four buffers: each reused
    (int64_t{1} << 18) - 1,     // under 1 MiB: written through HDF5
};

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-3, 3);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// Datasets of every awkward size, with an HDF5-written one between: their bytes are in
// the file, at page-aligned places, every range of them reads back (edges inside pages
// too), whole-file verification passes, and none of their pages but the tails went
// through the page cache.
TEST(DirectIo, AwkwardSizesLandAtTheirPlacesPastThePageCache) {
  const std::string dir = scratch_dir("direct_sizes");
  fs::create_directories(dir);
  const std::string path = dir + "/f.h5";
  std::vector<std::vector<float>> data;
  for (size_t i = 0; i < kAwkwardNumels.size(); ++i)
    data.push_back(random_floats(kAwkwardNumels[i], static_cast<uint32_t>(i + 1)));
  {
    h5::Obj f = h5::create_file(path);
    h5::DirectDatasets direct;
    for (size_t i = 0; i < data.size(); ++i) {
      const std::string name = "d" + std::to_string(i);
      const int64_t n = kAwkwardNumels[i];
      if (n * 4 >= h5::kDirectMinBytes) {
        direct.add(f, name, data[i].data(), h5::Elem::kF32, {n}, path);
      } else {
        h5::write(f, name, data[i].data(), h5::Elem::kF32, h5::Elem::kF32, {n}, path);
      }
      if (i == 1) h5::write_i64(f, "between", {1, 2, 3}, path);
    }
    const int64_t bytes = direct.write_all(path);
    int64_t expected = 0;
    for (int64_t n : kAwkwardNumels) expected += n * 4 >= h5::kDirectMinBytes ? n * 4 : 0;
    EXPECT_EQ(bytes, expected);
    h5::flush_and_sync(f, path);
    // Before anything reads the file (the kernel's read-ahead of its metadata could
    // bring neighbouring pages in): the direct datasets' whole pages never went through
    // the page cache; the tail page may have. Each starts on a page.
    for (size_t i = 0; i < data.size(); ++i) {
      const int64_t n = kAwkwardNumels[i];
      if (n * 4 < h5::kDirectMinBytes) continue;
      h5::Obj ds(H5Dopen2(f, ("d" + std::to_string(i)).c_str(), H5P_DEFAULT), H5Dclose);
      const haddr_t at = H5Dget_offset(ds);
      EXPECT_EQ(at % 4096, 0u) << "d" << i << " starts on a page";
      if (takes_o_direct(dir)) {
        EXPECT_LE(resident_pages(path, at, at + static_cast<uint64_t>(n) * 4), 1)
            << "d" << i << " went through the page cache";
      }
    }
  }
  h5::Obj f = h5::open_file(path);
  for (size_t i = 0; i < data.size(); ++i) {
    const std::string name = "d" + std::to_string(i);
    const int64_t n = kAwkwardNumels[i];
    SCOPED_TRACE(name + ": " + std::to_string(n) + " floats");
    std::vector<float> back(static_cast<size_t>(n));
    h5::read_range(f, name, 0, n, back.data(), h5::Elem::kF32, path);
    EXPECT_EQ(back, data[i]);
    // A range with both ends inside pages and inside checksum blocks.
    const int64_t a = n / 3 + 5, b = n - n / 5 - 7;
    std::vector<float> part(static_cast<size_t>(b - a));
    h5::read_range(f, name, a, b - a, part.data(), h5::Elem::kF32, path);
    EXPECT_TRUE(std::equal(part.begin(), part.end(), data[i].begin() + a));
    EXPECT_TRUE(h5::verify(f, name, path));
  }
  EXPECT_EQ(h5::read_i64(f, "between", path), (std::vector<int64_t>{1, 2, 3}));
  fs::remove_all(dir);
}

// A sharded checkpoint's rank file: its flat datasets bypass the page cache, and it loads
// back bit for bit.
TEST(DirectIo, ShardedSavesBypassThePageCacheAndLoadBack) {
  const std::string dir = scratch_dir("direct_save");
  fs::create_directories(dir);
  if (!takes_o_direct(dir)) GTEST_SKIP() << dir << " does not take O_DIRECT";
  torch::manual_seed(0);
  // Units of about 4 MB each: every flat parameter is a direct dataset.
  auto model = fully_shard(MlpNet(1024, 1024, 3));
  const auto saved = full_state_dict(model);
  const std::string step = ckpt::save_sharded_checkpoint(dir, model);
  const std::string file = step + "/rank_00000.h5";
  const int64_t pages = resident_pages(file, 0, fs::file_size(file));
  const int64_t total = static_cast<int64_t>((fs::file_size(file) + 4095) / 4096);
  EXPECT_LT(pages, total / 10) << pages << " of " << total << " pages are in the page cache";
  // h5py reads every dataset of the file as this library does (where h5py is installed).
  const std::string py =
      "import sys\n"
      "try:\n import h5py\nexcept ImportError:\n print('no h5py'); sys.exit(0)\n"
      "f = h5py.File(sys.argv[1], 'r')\n"
      "names = []\n"
      "f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)\n"
      "for i, n in enumerate(sorted(names)):\n"
      " open(sys.argv[2] + '/' + str(i) + '.bin', 'wb').write(f[n][()].tobytes())\n"
      " print(n)\n";
  const auto r = run_command({FSDP_PYTHON, "-c", py, file, dir});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (r.output.find("no h5py") == std::string::npos) {
    h5::Obj f = h5::open_file(file);
    std::istringstream names(r.output);
    int checked = 0;
    for (std::string name; std::getline(names, name); ++checked) {
      if (h5::elem_of(f, name, file) != h5::Elem::kF32) continue;
      const auto shape = h5::shape_of(f, name, file);
      const int64_t n = h5::numel_of(shape, file, name);
      std::vector<float> ours(static_cast<size_t>(n)), theirs(static_cast<size_t>(n));
      h5::read_range(f, name, 0, n, ours.data(), h5::Elem::kF32, file);
      std::ifstream in(dir + "/" + std::to_string(checked) + ".bin", std::ios::binary);
      in.read(reinterpret_cast<char*>(theirs.data()), static_cast<std::streamsize>(n * 4));
      EXPECT_EQ(ours, theirs) << name << ": h5py reads other values";
    }
    EXPECT_GT(checked, 10) << r.output;
  }
  torch::manual_seed(1);
  auto other = fully_shard(MlpNet(1024, 1024, 3));
  ckpt::load_sharded_checkpoint(step, other);
  const auto loaded = full_state_dict(other);
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;
  fs::remove_all(dir);
}

// All of a rank file's datasets, read back as bytes by name (HDF5's C API).
std::map<std::string, std::vector<float>> float_datasets(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  h5::Obj f = h5::open_file(path);
  const int64_t n = h5::get_int(f, "num_flats", path);
  for (int64_t k = 0; k < n; ++k) {
    char g[32];
    std::snprintf(g, sizeof(g), "flats/%05lld", static_cast<long long>(k));
    for (const std::string d : {"param", "optim/exp_avg", "optim/exp_avg_sq"}) {
      const std::string name = std::string(g) + "/" + d;
      if (!h5::exists(f, name)) continue;
      const auto shape = h5::shape_of(f, name, path);
      std::vector<float> v(static_cast<size_t>(shape.empty() ? 1 : shape[0]));
      h5::read_range(f, name, 0, static_cast<int64_t>(v.size()), v.data(), h5::Elem::kF32, path);
      out[name] = std::move(v);
    }
  }
  return out;
}

// An optimizer over fsdp::ShardParamGroups holds a shard's state as several tensors, one
// per view (weights decay, biases do not, so they alternate): a synchronous save writes
// them as parts of one dataset, zeros where no view covers the shard (padding), an
// asynchronous one stages them put together. At 2 ranks (views cut at the shards'
// boundary) both files hold the same bytes, and a load gives the state back.
TEST(DirectIo, OptimizerStateInPartsIsWrittenAsOneDataset) {
  const std::string dir = scratch_dir("direct_parts");
  run_ranks(2, [&](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(0);
    auto model = fully_shard(MlpNet(1000, 1000, 2, 8), o);  // units of 4 MB: direct datasets
    ShardParamGroups groups(model, no_decay_groups(0.1));
    torch::optim::AdamW opt(groups.param_groups(torch::optim::AdamWOptions(1e-2)));
    for (int step = 0; step < 2; ++step) {
      auto x = torch::randn({4, 1000});
      model->forward(x).pow(2).mean().backward();
      opt.step();
      opt.zero_grad();
    }
    ckpt::TrainingState st;
    st.step = 2;
    const std::string sync = ckpt::save_sharded_checkpoint(dir, model, &opt, st);
    const std::string async = ckpt::save_sharded_checkpoint_async(dir, model, &opt, st).wait();
    const std::string file = "/rank_0000" + std::to_string(pg.rank()) + ".h5";
    const auto a = float_datasets(sync + file), b = float_datasets(async + file);
    EXPECT_EQ(a.size(), b.size());
    EXPECT_GE(a.size(), 9u) << "param, exp_avg and exp_avg_sq of 3 units";
    for (const auto& [name, v] : a) EXPECT_EQ(v, b.at(name)) << name << " differs";
    // Loaded into another optimizer over the same groups: the same state, view by view.
    torch::optim::AdamW opt2(groups.param_groups(torch::optim::AdamWOptions(1.0)));
    ckpt::load_sharded_checkpoint(sync, model, &opt2);
    for (size_t g = 0; g < opt.param_groups().size(); ++g) {
      for (size_t i = 0; i < opt.param_groups()[g].params().size(); ++i) {
        const auto& p1 = opt.param_groups()[g].params()[i];
        const auto& p2 = opt2.param_groups()[g].params()[i];
        auto& s1 = static_cast<torch::optim::AdamWParamState&>(
            *opt.state().at(fsdp::detail::optim_state_key(opt.state(), p1)));
        auto& s2 = static_cast<torch::optim::AdamWParamState&>(
            *opt2.state().at(fsdp::detail::optim_state_key(opt2.state(), p2)));
        EXPECT_TRUE(torch::equal(s1.exp_avg(), s2.exp_avg())) << "group " << g << " view " << i;
        EXPECT_TRUE(torch::equal(s1.exp_avg_sq(), s2.exp_avg_sq()))
            << "group " << g << " view " << i;
      }
    }
  });
  fs::remove_all(dir);
}

// A write that fails part way (here the process's file size limit, as a full disk would)
// names the file and the cause, and asks about the disk.
TEST(DirectIo, AFailedWriteNamesTheFileAndTheCause) {
  const std::string dir = scratch_dir("direct_full");
  fs::create_directories(dir);
  const std::string path = dir + "/f.h5";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG
    const rlimit limit{20 << 20, 20 << 20};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const auto data = random_floats(int64_t{8} << 20, 1);  // 32 MiB
    std::string msg;
    try {
      h5::Obj f = h5::create_file(path);
      h5::DirectDatasets direct;
      direct.add(f, "big", data.data(), h5::Elem::kF32, {static_cast<int64_t>(data.size())}, path);
      direct.write_all(path);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    const bool ok = msg.find("cannot write " + path + " at byte ") != std::string::npos &&
                    msg.find("File too large") != std::string::npos &&
                    msg.find("Is the disk full?") != std::string::npos;
    if (!ok) std::fprintf(stderr, "message: %s\n", msg.c_str());
    std::_Exit(ok ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "see the message above";
  fs::remove_all(dir);
}

// A rank file cut short while a load reads it (another host truncating it on a shared
// file system, say): HDF5 checked the file's end when it opened it, so the direct reads
// are what must notice. A read that goes on into the next dataset finds the file ending
// under it; a read that starts afresh finds the new end first. Each names the dataset,
// the file and the byte.
TEST(DirectIo, AFileCutShortUnderALoadSaysWhereItEnds) {
  const std::string dir = scratch_dir("direct_cut");
  fs::create_directories(dir);
  const std::string path = dir + "/f.h5";
  // 24 MiB each: the read of `a` may read ahead one 8 MiB buffer past it, into `b`, and
  // the cut comes after that.
  const int64_t n = int64_t{6} << 20;
  const auto a = random_floats(n, 1), b = random_floats(n, 2), c = random_floats(n, 3);
  {
    h5::Obj f = h5::create_file(path);
    h5::DirectDatasets direct;
    direct.add(f, "a", a.data(), h5::Elem::kF32, {n}, path);
    direct.add(f, "b", b.data(), h5::Elem::kF32, {n}, path);
    direct.add(f, "c", c.data(), h5::Elem::kF32, {n}, path);
    direct.write_all(path);
    h5::flush_and_sync(f, path);
  }
  h5::Obj f = h5::open_file(path);
  auto offset_of = [&](const char* name) {
    h5::Obj ds(H5Dopen2(f, name, H5P_DEFAULT), H5Dclose);
    return static_cast<uint64_t>(H5Dget_offset(ds));
  };
  const uint64_t at_b = offset_of("b"), at_c = offset_of("c");
  ASSERT_LT(at_b, at_c);
  std::vector<float> back(static_cast<size_t>(n));
  h5::read_range(f, "a", 0, n, back.data(), h5::Elem::kF32, path);
  EXPECT_EQ(back, a);
  const uint64_t cut = at_b + (uint64_t{12} << 20);  // 12 MiB into b
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(cut)), 0);
  const std::string going_on =
      error_of([&] { h5::read_range(f, "b", 0, n, back.data(), h5::Elem::kF32, path); });
  EXPECT_NE(going_on.find(path + ": cannot read dataset 'b': the file is truncated or corrupted"),
            std::string::npos)
      << going_on;
  EXPECT_NE(going_on.find("cannot read " + path + " at byte "), std::string::npos) << going_on;
  EXPECT_NE(going_on.find("the file ends there (truncated?)"), std::string::npos) << going_on;
  h5::end_read_ahead();
  const std::string afresh =
      error_of([&] { h5::read_range(f, "c", 0, n, back.data(), h5::Elem::kF32, path); });
  EXPECT_NE(afresh.find(path + ": cannot read dataset 'c'"), std::string::npos) << afresh;
  EXPECT_NE(afresh.find("cannot read " + path + " at byte " + std::to_string(at_c) +
                        ": the file ends at byte " + std::to_string(cut) + " (truncated?)"),
            std::string::npos)
      << afresh;
  fs::remove_all(dir);
}

}  // namespace

}  // namespace test_checkpoint_direct_cases
