// What keeps checkpoint files whole and checked: the block checksum (CRC32C) and the one
// atomic-publish helper every writer uses.
#include "support/checkpoint_helpers.h"

#include "../checkpoint/format/crc32c.h"
#include "../checkpoint/format/publish.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_integrity_cases {

namespace {

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
  // Arriving in pieces of every length (Note [Direct I/O] checksums bytes as it copies
  // them): the same value as at once.
  std::uniform_int_distribution<size_t> cut(0, 100);
  for (size_t n : {size_t{0}, size_t{31}, size_t{33}, size_t{4099}, data.size()}) {
    h5::BlockCrc crc;
    for (size_t at = 0; at < n;) {
      const size_t k = std::min(n - at, cut(rng));
      crc.update(data.data() + at, k);
      at += k;
    }
    EXPECT_EQ(crc.value(), h5::crc_block(data.data(), n)) << n << " bytes in pieces";
  }
  const uint32_t before = h5::crc_block(data.data(), data.size());
  data[5000] ^= 1;
  EXPECT_NE(h5::crc_block(data.data(), data.size()), before) << "a flipped bit went unnoticed";
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

}  // namespace

}  // namespace test_checkpoint_integrity_cases
