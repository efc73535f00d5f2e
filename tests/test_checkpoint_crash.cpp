// Crash safety: a save, synchronous or asynchronous, killed at any moment leaves the
// previous checkpoint loadable, whole.
#include <fsdp/checkpoint.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <ostream>
#include <random>
#include <thread>
#include "../src/internal/sharded_model.h"  // set_save_hook

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_crash_cases {

namespace {

// The child process of the crash tests (main() runs it when FSDP_CRASH_SAVER_DIR is
// set): saves checkpoints step after step until killed.
void crash_saver(const char* dir) {
  auto model = fully_shard(MlpNet(64, 512, 8, 64));
  int64_t step = 0;
  if (ckpt::latest_checkpoint(dir)) {
    ckpt::TrainingState st;
    ckpt::load_sharded_checkpoint(dir, model, nullptr, &st);
    step = st.step;
  }
  const int64_t stop = std::getenv("FSDP_CRASH_SAVER_ONCE") ? step + 1 : INT64_MAX;
  const bool async = std::getenv("FSDP_CRASH_SAVER_ASYNC") != nullptr;
  if (const char* flag = std::getenv("FSDP_CRASH_SAVER_SIGNAL")) {
    // Each save announces the write of its rank file and lingers in it (in the background
    // thread for an asynchronous one), so that the test's kill lands inside one on purpose.
    const std::string path = flag;
    fsdp::detail::set_save_hook(model, [path](const std::string& step, const std::string&) {
      if (step != "write") return;
      std::ofstream(path) << "writing\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
  }
  ckpt::SaveOptions so;
  so.keep_last = 2;
  ckpt::AsyncSave pending;
  const char* progress = std::getenv("FSDP_CRASH_SAVER_PROGRESS");
  int64_t returned = 0;
  while (step < stop) {
    ++step;
    fill_with(model, step);
    if (async) {
      pending = ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(step), so);
      fill_with(model, -step);  // training goes on: the save must hold `step` regardless
    } else {
      ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(step), so);
    }
    std::cout << "saved " << step << std::endl;
    // How many save calls have returned (an asynchronous one returns before its write).
    if (progress != nullptr) std::ofstream(std::string(progress) + ".tmp") << ++returned << "\n";
    if (progress != nullptr) fs::rename(std::string(progress) + ".tmp", progress);
  }
}

pid_t start_saver(const std::string& dir, bool once, bool async = false,
                  const std::string& signal = "", const std::string& progress = "") {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("FSDP_CRASH_SAVER_DIR", dir.c_str(), 1);
    if (!progress.empty()) setenv("FSDP_CRASH_SAVER_PROGRESS", progress.c_str(), 1);
    if (once) setenv("FSDP_CRASH_SAVER_ONCE", "1", 1);
    if (async) setenv("FSDP_CRASH_SAVER_ASYNC", "1", 1);
    if (!signal.empty()) setenv("FSDP_CRASH_SAVER_SIGNAL", signal.c_str(), 1);
    const std::string self = bin_dir() + "/test_checkpoint";  // this binary
    int devnull = ::open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    execl(self.c_str(), self.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

// Waits up to two minutes until the saver's progress file counts `n` returned saves.
bool wait_for_saves(const std::string& progress, int64_t n) {
  for (int i = 0; i < 60000; ++i) {
    std::ifstream f(progress);
    int64_t k = 0;
    if (f >> k && k >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// The two kinds of save the crash test kills.
struct CrashCase {
  const char* name;     ///< "Sync" or "Async": the test's name ends in it
  bool async;           ///< save_sharded_checkpoint_async, else save_sharded_checkpoint
  const char* tag;      ///< the scratch directory's
  uint32_t seed;        ///< of the kill times
  int64_t saves_first;  ///< returned saves before a kill at a random moment
  const char* write;    ///< what an aimed kill lands in
};
// Names the case in test listings (ctest shows it).
void PrintTo(const CrashCase& c, std::ostream* os) { *os << c.name; }

class CrashSafety : public ::testing::TestWithParam<CrashCase> {};

// Half the kills are aimed into the write of a rank file (the saver announces it; for an
// asynchronous save, its background thread), half land at random moments of the save
// loop (after its first `saves_first` saves returned, so that each such round makes
// progress however slow the machine: it may run under sanitizers): after each, the
// newest complete checkpoint `latest` names loads, whole, with the values of its own step
// (for an asynchronous save, the staging copy, not what training wrote after).
TEST_P(CrashSafety, KilledSavesNeverBreakThePreviousCheckpoint) {
  const CrashCase& c = GetParam();
  const std::string dir = scratch_dir(c.tag);
  const std::string signal = dir + ".writing";
  int status = 0;
  pid_t first = start_saver(dir, /*once=*/true, c.async);
  waitpid(first, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::mt19937 rng(c.seed);
  auto model = fully_shard(MlpNet(64, 512, 8, 64));
  int64_t last_step = 1, aimed = 0, killed_writing = 0;
  for (int round = 0; round < 20; ++round) {
    fs::remove(signal);
    const bool aim = round % 2 == 0;
    const std::string progress = dir + ".progress";
    fs::remove(progress);
    pid_t pid = start_saver(dir, false, c.async, aim ? signal : "", progress);
    if (aim) {
      // The first write is announced after start-up, a load and (async) one snapshot.
      for (int i = 0; i < 30000 && !fs::exists(signal); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_TRUE(fs::exists(signal)) << "round " << round << ": no " << c.write << " began";
      // Well inside the 300 ms the write lingers, even on a loaded machine.
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 50)(rng)));
      ++aimed;
    } else {
      // Asynchronous: two returned calls, since the second waited for the first's write,
      // now complete.
      ASSERT_TRUE(wait_for_saves(progress, c.saves_first))
          << "round " << round << ": no save returned";
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "round " << round << ": the saver ended before the kill";
    // A kill inside a write leaves its temporary directory behind (the next save removes it).
    bool tmp_left = false;
    for (const auto& e : fs::directory_iterator(dir))
      tmp_left |= e.path().filename().string().rfind(".tmp-", 0) == 0;
    killed_writing += aim && tmp_left ? 1 : 0;
    // The previous complete checkpoint loads, whole and consistent.
    ckpt::TrainingState st;
    ASSERT_NO_THROW(ckpt::load_sharded_checkpoint(dir, model, nullptr, &st)) << "round " << round;
    EXPECT_GE(st.step, last_step) << "latest went backwards";
    last_step = st.step;
    for (auto& p : model.sharded_parameters()) {
      ASSERT_TRUE(torch::all(p == static_cast<float>(st.step)).item<bool>())
          << "round " << round << ": checkpoint " << st.step
          << " does not hold its own step's values (files of two checkpoints mixed?)";
    }
    EXPECT_NE(ckpt::inspect_checkpoint(dir).find("verified"), std::string::npos);
  }
  EXPECT_EQ(killed_writing, aimed) << "an aimed kill missed the " << c.write;
  EXPECT_GT(last_step, 1)
      << "no save ever completed: the kill times are too short to test anything";
  fs::remove(signal);
}

INSTANTIATE_TEST_SUITE_P(
    SaveKinds, CrashSafety,
    ::testing::Values(CrashCase{"Sync", false, "crash", 12345, 1, "write"},
                      CrashCase{"Async", true, "crash_async", 2024, 2, "background write"}),
    [](const ::testing::TestParamInfo<CrashCase>& info) { return std::string(info.param.name); });

}  // namespace

}  // namespace test_checkpoint_crash_cases

int main(int argc, char** argv) {
  if (const char* dir = std::getenv("FSDP_CRASH_SAVER_DIR")) {
    test_checkpoint_crash_cases::crash_saver(dir);
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
