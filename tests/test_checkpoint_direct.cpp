// Note [Direct I/O]: a checkpoint's large datasets written and read past the page cache,
// at their places in an ordinary HDF5 file, whatever their sizes; a full disk named.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"

#include "../checkpoint/h5/h5.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <random>

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

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
  const std::string step = save_sharded_checkpoint(dir, model);
  const std::string file = step + "/rank_00000.h5";
  const int64_t pages = resident_pages(file, 0, fs::file_size(file));
  const int64_t total = static_cast<int64_t>((fs::file_size(file) + 4095) / 4096);
  EXPECT_LT(pages, total / 10) << pages << " of " << total << " pages are in the page cache";
  torch::manual_seed(1);
  auto other = fully_shard(MlpNet(1024, 1024, 3));
  load_sharded_checkpoint(step, other);
  const auto loaded = full_state_dict(other);
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;
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

}  // namespace
