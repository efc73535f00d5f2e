// The collective ring (Note [Collective ring]): ranks that run different collectives
// fail with errors that say where they parted: at once under FSDP_DEBUG=desync, at the
// timeout with this rank's recent collectives without it.
#include "support/multirank.h"

#include <fsdp/fsdp.h>

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

namespace fsdp::testing {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Two units of the same size, so that one rank's gather of `a` and another's gather of
// `b` match in Gloo's eyes: nothing but the trace can tell them apart. Linear(8, 8) has
// 64 + 8 = 72 fp32 elements, 288 bytes gathered.
class TwoImpl : public torch::nn::Module {
 public:
  TwoImpl()
      : a(register_module("a", FullyShardedModule<torch::nn::Linear>(torch::nn::Linear(8, 8)))),
        b(register_module("b", FullyShardedModule<torch::nn::Linear>(torch::nn::Linear(8, 8)))) {}
  torch::Tensor forward(const torch::Tensor& x, bool skip_a) { return b(skip_a ? x : a(x)); }
  FullyShardedModule<torch::nn::Linear> a;
  FullyShardedModule<torch::nn::Linear> b;
};
TORCH_MODULE(Two);

ShardingOptions on(const ProcessGroup& pg) {
  ShardingOptions o;
  o.process_group = pg;
  return o;
}

// Rank 1 skips unit 'a'. Under FSDP_DEBUG=desync both ranks compare their next
// collective before running it and fail at once (the timeout is 60 s), each naming
// both sides.
TEST(Desync, ARankSkippingAUnitFailsAtOnceOnEveryRankUnderFsdpDebugDesync) {
  run_ranks(
      2,
      [](const ProcessGroup& pg) {
        auto m = fully_shard(Two(), on(pg));
        for (int train = 0; train < 2; ++train) {
          torch::GradMode::set_enabled(train == 1);
          auto t0 = std::chrono::steady_clock::now();
          const std::string err = error_of([&] { m(torch::ones({2, 8}), pg.rank() == 1); });
          EXPECT_LT(seconds_since(t0), 20.0) << "the ranks waited for the timeout";
          EXPECT_NE(
              err.find("collectives out of step on world (FSDP_DEBUG=desync): the ranks were about "
                       "to run different collectives:"),
              std::string::npos)
              << err;
          EXPECT_NE(err.find("\n  rank 0: all_gather for unit 'a', 288 B (#"), std::string::npos)
              << err;
          EXPECT_NE(err.find("\n  rank 1: all_gather for unit 'b', 288 B (#"), std::string::npos)
              << err;
          EXPECT_NE(err.find("call the same wrapped units, in the same order, on every rank"),
                    std::string::npos)
              << err;
          if (train == 0) {
            // The check runs before the collective: the ranks stay in step and can go on.
            m(torch::ones({2, 8}), false);
          }
        }
        torch::GradMode::set_enabled(true);
      },
      180, {"FSDP_DEBUG=desync", "FSDP_TIMEOUT_S=60"});
}

// The same skip without the check: rank 0's gather of 'a' meets rank 1's gather of 'b'
// (same size), and rank 0's gather of 'b' then has no partner. It fails at the timeout
// (4 s), naming that collective and the ones before it.
TEST(Desync, WithoutTheCheckTheRankLeftWaitingFailsAtTheTimeoutWithItsRecentCollectives) {
  run_ranks(
      2,
      [](const ProcessGroup& pg) {
        auto m = fully_shard(Two(), on(pg));
        torch::NoGradGuard eval;
        skip_final_barrier();  // the timeout closes the group
        if (pg.rank() == 1) {
          m(torch::ones({2, 8}), true);
          std::this_thread::sleep_for(std::chrono::seconds(8));  // alive past rank 0's timeout
          return;
        }
        auto t0 = std::chrono::steady_clock::now();
        const std::string err = error_of([&] { m(torch::ones({2, 8}), false); });
        const double secs = seconds_since(t0);
        EXPECT_GT(secs, 3.5);
        EXPECT_LT(secs, 7.5);
        const std::string head = "rank 0: collective #";
        ASSERT_EQ(err.rfind(head, 0), 0u) << err;
        EXPECT_NE(
            err.find(" on world (2 ranks), all_gather for unit 'b', 288 B, did not complete: "),
            std::string::npos)
            << err;
        // Note [Peer probe]: rank 1 is alive (asleep), so its host answers.
        EXPECT_NE(err.find("\nEvery other rank of this group still answers a probe"),
                  std::string::npos)
            << err;
        const size_t list = err.find("\nThis rank's recent collectives, oldest first:\n");
        ASSERT_NE(list, std::string::npos) << err;
        const size_t a = err.find(": all_gather for unit 'a', 288 B (completed)\n", list);
        const size_t b = err.find(": all_gather for unit 'b', 288 B (failed)\n", list);
        EXPECT_NE(a, std::string::npos) << err;
        EXPECT_NE(b, std::string::npos) << err;
        EXPECT_LT(a, b) << err;
        EXPECT_NE(
            err.find("run with FSDP_DEBUG=desync to stop at the first collective that differs"),
            std::string::npos)
            << err;
      },
      180, {"FSDP_TIMEOUT_S=4"});
}

// Checked before the rendezvous, also in a single process: a typo is not silently ignored.
TEST(Desync, AnUnknownFsdpDebugModeIsRejectedByName) {
  setenv("FSDP_DEBUG", "desync,verbose", 1);
  const std::string err = error_of([] { init_process_group(); });
  unsetenv("FSDP_DEBUG");
  EXPECT_EQ(
      err,
      "FSDP_DEBUG='desync,verbose' lists 'verbose', which is not a debug mode; the modes are: "
      "desync (compare every collective across ranks before it runs)");
}

}  // namespace
}  // namespace fsdp::testing
