// Process group: launch environment, rendezvous errors, and the collectives.
#include "support/counting_allocator.h"
#include "support/multirank.h"

#include <fsdp/process_group.h>

#include <gtest/gtest.h>

#include "../src/comm/route.h"  // the interface Gloo binds to

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <optional>

#include <cstdlib>
#include <map>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_process_group_cases {

namespace {

const char* kLaunchVars[] = {"RANK",
                             "WORLD_SIZE",
                             "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE",
                             "MASTER_ADDR",
                             "MASTER_PORT",
                             "SLURM_PROCID",
                             "SLURM_NTASKS",
                             "SLURM_LOCALID",
                             "SLURM_JOB_NODELIST",
                             "OMPI_COMM_WORLD_RANK",
                             "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK",
                             "FSDP_TIMEOUT_S"};

// Sets exactly `vars` among the launch variables for the test's lifetime.
class ScopedLaunchEnv {
 public:
  explicit ScopedLaunchEnv(const std::map<std::string, std::string>& vars) {
    for (const char* k : kLaunchVars) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      unsetenv(k);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedLaunchEnv() {
    for (const char* k : kLaunchVars) unsetenv(k);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// Note [Gloo's interface]: without GLOO_SOCKET_IFNAME, Gloo binds to the local address
// that reaches MASTER_ADDR.
TEST(GlooInterface, AMasterOnLoopbackIsReachedFromLoopback) {
  EXPECT_EQ(fsdp::detail::local_address_toward("127.0.0.1", "MASTER_ADDR"), "127.0.0.1");
}

// Rank 0 on a cluster: MASTER_ADDR is its own link address, which it must bind to (not
// to the 127.0.1.1 its host name resolves to on Debian). Every IPv4 address of this
// host, loopback included, reaches itself from itself.
TEST(GlooInterface, EachAddressOfThisHostIsReachedFromItself) {
  ifaddrs* ifs = nullptr;
  ASSERT_EQ(getifaddrs(&ifs), 0);
  int checked = 0;
  for (const ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    // An address of a down interface has no local route: not this host's to reach.
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP))
      continue;
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, ip,
              sizeof(ip));
    EXPECT_EQ(fsdp::detail::local_address_toward(ip, "MASTER_ADDR"), ip) << i->ifa_name;
    ++checked;
  }
  freeifaddrs(ifs);
  EXPECT_GE(checked, 1);  // loopback at least
}

// Runs `fn` in a child process inside a new network namespace, which has only a loopback
// that is down: no route reaches anything and no name server answers. Returns the message
// of the c10::Error `fn` threw ("" if none), or nullopt where this process may not make a
// namespace (not root).
std::optional<std::string> error_without_a_network(const std::function<void()>& fn) {
  int fds[2];
  if (pipe(fds) != 0) return std::nullopt;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::string msg = "\x01";  // no namespace
    if (unshare(CLONE_NEWNET) == 0) {
      msg.clear();
      try {
        fn();
      } catch (const c10::Error& e) {
        msg = e.what_without_backtrace();
      }
    }
    (void)!write(fds[1], msg.data(), msg.size());
    _exit(0);
  }
  close(fds[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) msg.append(buf, n);
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  if (msg == "\x01") return std::nullopt;
  return msg;
}

const char* kInterfaceFix =
    "; set GLOO_SOCKET_IFNAME to the network interface that reaches it (e.g. "
    "GLOO_SOCKET_IFNAME=eth0), or fix MASTER_ADDR";

TEST(GlooInterface, AMasterNoRouteReachesIsNamedWithTheFix) {
  const auto msg = error_without_a_network(
      [] { fsdp::detail::local_address_toward("10.9.9.9", "MASTER_ADDR"); });
  if (!msg) GTEST_SKIP() << "needs root to make a network namespace";
  EXPECT_EQ(*msg, std::string("no route from this host reaches MASTER_ADDR=10.9.9.9 (") +
                      std::strerror(ENETUNREACH) + ")" + kInterfaceFix);
}

TEST(GlooInterface, AMasterThatDoesNotResolveIsNamedWithTheFix) {
  const auto msg = error_without_a_network(
      [] { fsdp::detail::local_address_toward("no-such-host.invalid", "MASTER_ADDR"); });
  if (!msg) GTEST_SKIP() << "needs root to make a network namespace";
  const std::string head = "MASTER_ADDR=no-such-host.invalid does not resolve (";
  const std::string tail =
      "), so no network interface can be chosen for it" + std::string(kInterfaceFix);
  EXPECT_EQ(msg->substr(0, head.size()), head) << *msg;  // then the resolver's own words
  ASSERT_GE(msg->size(), head.size() + tail.size()) << *msg;
  EXPECT_EQ(msg->substr(msg->size() - tail.size()), tail) << *msg;
}

// A MASTER_ADDR other than the literal loopback names takes Note [Gloo's interface]'s path
// (with GLOO_SOCKET_IFNAME unset), and the ranks meet.
TEST(GlooInterface, RanksMeetAtAMasterAddressThatIsNotLiterallyLoopback) {
  run_ranks(2,
            [](const ProcessGroup& pg) {
              auto t = torch::tensor({static_cast<double>(pg.rank() + 1)});
              pg.all_reduce_sum(t);
              EXPECT_EQ(t.item<double>(), 3.0);
            },
            120, {"MASTER_ADDR=127.0.0.2", "GLOO_SOCKET_IFNAME="});
}

TEST(LaunchEnv, NoVariablesMeansOneProcess) {
  ScopedLaunchEnv env({});
  auto e = read_launch_env();
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.source, "single-process");
  EXPECT_EQ(init_process_group().size(), 1);
}

TEST(LaunchEnv, TorchrunVariablesAreRead) {
  ScopedLaunchEnv env({{"RANK", "2"},
                       {"WORLD_SIZE", "4"},
                       {"LOCAL_RANK", "0"},
                       {"MASTER_ADDR", "10.0.0.7"},
                       {"MASTER_PORT", "29511"}});
  auto e = read_launch_env();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 29511);
}

TEST(LaunchEnv, SlurmVariablesAreReadAndTheFirstNodeIsTheMaster) {
  ScopedLaunchEnv env({{"SLURM_PROCID", "5"},
                       {"SLURM_NTASKS", "8"},
                       {"SLURM_LOCALID", "1"},
                       {"SLURM_JOB_NODELIST", "gpu[07-08],cpu1"},
                       {"MASTER_PORT", "29600"}});
  auto e = read_launch_env();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu07");
  EXPECT_EQ(e.master_port, 29600);
}

TEST(LaunchEnv, OpenMpiVariablesAreRead) {
  ScopedLaunchEnv env({{"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "2"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                       {"MASTER_ADDR", "127.0.0.1"}});
  auto e = read_launch_env();
  EXPECT_EQ(e.source, "openmpi");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_rank, 1);
}

TEST(LaunchEnv, MissingWorldSizeNamesTheVariable) {
  ScopedLaunchEnv env(std::map<std::string, std::string>{{"RANK", "0"}});
  EXPECT_EQ(error_of([] { read_launch_env(); }),
            "WORLD_SIZE is not set, but other torchrun variables are. Set it, or launch with "
            "fsdp-run / torchrun, which set them all. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT.");
}

TEST(LaunchEnv, MissingMasterAddrNamesTheVariable) {
  ScopedLaunchEnv env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(error_of([] { read_launch_env(); }),
            "MASTER_ADDR is not set: ranks need the rendezvous host (rank 0's address). Set it, "
            "e.g. MASTER_ADDR=127.0.0.1 for one machine. torchrun sets RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT.");
}

TEST(LaunchEnv, RankAtWorldSizeIsRejected) {
  ScopedLaunchEnv env(
      {{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(error_of([] { read_launch_env(); }),
            "rank 4 is not below world size 4 (from torchrun); ranks run from 0 to 3. torchrun "
            "sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.");
}

TEST(LaunchEnv, NonIntegerRankIsRejected) {
  ScopedLaunchEnv env({{"RANK", "one"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(error_of([] { read_launch_env(); }),
            "RANK='one' is not an integer. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT.");
}

TEST(Rendezvous, PortAlreadyInUseIsReportedWithTheFix) {
  // Hold a listening socket on a port, then ask rank 0 to serve on it.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string port = std::to_string(ntohs(a.sin_port));
  ScopedLaunchEnv env({{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", port},
                       {"FSDP_TIMEOUT_S", "5"}});
  EXPECT_EQ(error_of([] { init_process_group(); }),
            "rank 0 cannot serve the rendezvous: port " + port +
                " on 127.0.0.1 is already in use. Pick a free port (MASTER_PORT, or fsdp-run "
                "--master-port) or stop the process holding it.");
  close(fd);
}

TEST(Rendezvous, PeersThatNeverArriveAreNamedAfterTheTimeout) {
  const std::string port = std::to_string(free_port());
  ScopedLaunchEnv env({{"RANK", "0"},
                       {"WORLD_SIZE", "3"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", port},
                       {"FSDP_TIMEOUT_S", "1"}});
  EXPECT_EQ(error_of([] { init_process_group(); }),
            "rendezvous at 127.0.0.1:" + port +
                " timed out after 1 s: 2 of 3 ranks never arrived; missing ranks: [1, 2]. Start "
                "every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise the "
                "timeout (FSDP_TIMEOUT_S).");
}

// torchrun hands its workers rank 0's node name as MASTER_ADDR; where that resolves to
// loopback, each host meets at its own: the timeout says so (LOCAL_WORLD_SIZE < WORLD_SIZE).
TEST(Rendezvous, ALoopbackMasterForAJobThatSpansHostsIsNamedAfterTheTimeout) {
  const std::string port = std::to_string(free_port());
  ScopedLaunchEnv env({{"RANK", "0"},
                       {"WORLD_SIZE", "3"},
                       {"LOCAL_WORLD_SIZE", "1"},
                       {"MASTER_ADDR", "localhost"},
                       {"MASTER_PORT", port},
                       {"FSDP_TIMEOUT_S", "1"}});
  const std::string err = error_of([] { init_process_group(); });
  EXPECT_NE(err.find("missing ranks: [1, 2]. "), std::string::npos) << err;
  EXPECT_NE(err.find(" MASTER_ADDR=localhost is loopback but the job spans hosts "
                     "(LOCAL_WORLD_SIZE=1, WORLD_SIZE=3): each host reaches only its own "
                     "loopback. Set MASTER_ADDR to rank 0's host's address; under torchrun, pass "
                     "--local-addr with each node's address (or --master-addr)."),
            std::string::npos)
      << err;
}

TEST(Rendezvous, AMissingMasterIsNamedAfterTheTimeout) {
  const std::string port = std::to_string(free_port());
  ScopedLaunchEnv env({{"RANK", "1"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"},
                       {"MASTER_PORT", port},
                       {"FSDP_TIMEOUT_S", "1"}});
  EXPECT_EQ(error_of([] { init_process_group(); }),
            "rank 1 could not reach the rendezvous at 127.0.0.1:" + port +
                " within 1 s; missing ranks: [0]. Rank 0 serves the rendezvous: check that it is "
                "running and that MASTER_ADDR/MASTER_PORT point at it, or raise the timeout "
                "(FSDP_TIMEOUT_S).");
}

TEST(Rendezvous, BadTimeoutValueIsRejected) {
  ScopedLaunchEnv env(std::map<std::string, std::string>{{"FSDP_TIMEOUT_S", "soon"}});
  EXPECT_EQ(error_of([] { init_process_group(); }),
            "FSDP_TIMEOUT_S='soon' is not a positive number of seconds");
}

void every_collective_at_world_three(const ProcessGroup& pg) {
  const int r = pg.rank();
  auto shard = torch::full({2}, static_cast<float>(r + 1));
  auto full = torch::empty({6});
  pg.all_gather(full, shard);
  EXPECT_TRUE(torch::equal(full, torch::tensor({1.f, 1.f, 2.f, 2.f, 3.f, 3.f})));

  auto grads = torch::arange(6, torch::kFloat) * (r + 1);  // sum over ranks: 6 * arange
  auto mine = torch::empty({2});
  pg.reduce_scatter_sum(grads, mine);
  EXPECT_TRUE(torch::equal(mine, torch::tensor({6.f * (2 * r), 6.f * (2 * r + 1)})));

  auto t = torch::tensor({static_cast<double>(r)});
  pg.all_reduce_sum(t);
  EXPECT_EQ(t.item<double>(), 3.0);
  auto m = torch::tensor({static_cast<float>(r)});
  pg.all_reduce_max(m);
  EXPECT_EQ(m.item<float>(), 2.f);

  auto b = torch::full({3}, static_cast<float>(r)).to(torch::kBFloat16);
  pg.broadcast(b, 2);
  EXPECT_TRUE(torch::equal(b.to(torch::kFloat), torch::full({3}, 2.f)));
  pg.barrier();
}

TEST(Collectives, GatherReduceScatterAllReduceBroadcastAtWorldThree) {
  run_ranks(3, every_collective_at_world_three);
}

// Rank r's integer-valued gradient: small enough that any sum over 4 ranks is exact in
// bf16 (|sum| < 256), with negatives, different on every rank and element.
torch::Tensor integer_grad(int r, int64_t numel, torch::ScalarType dtype) {
  return (torch::arange(numel, torch::kLong).remainder(13) + 3 * r - 5).to(dtype);
}

// Every rank's chunk of the sum, from the ranks' gradients rebuilt here.
void expect_exact_reduce_scatter(const ProcessGroup& pg, int64_t per_rank,
                                 torch::ScalarType dtype) {
  const int n = pg.size();
  const int64_t numel = per_rank * n;
  auto sum = torch::zeros({numel}, torch::kLong);
  for (int q = 0; q < n; ++q) sum += integer_grad(q, numel, torch::kLong);
  auto full = integer_grad(pg.rank(), numel, dtype);
  auto mine = torch::full({per_rank}, 999, dtype);
  pg.reduce_scatter_sum(full, mine);
  auto want = sum.narrow(0, pg.rank() * per_rank, per_rank).to(dtype);
  EXPECT_TRUE(torch::equal(mine, want))
      << "world " << n << ", " << per_rank << " per rank, " << dtype << ": rank " << pg.rank()
      << " got " << mine.narrow(0, 0, std::min<int64_t>(per_rank, 8)) << " want "
      << want.narrow(0, 0, std::min<int64_t>(per_rank, 8));
}

// Note [Gloo reduce-scatter]: the chunks each rank receives, summed in rank order, equal
// the integer sum exactly; world 3 with odd chunk sizes, and one element per rank.
TEST(Collectives, ReduceScatterIsTheExactSumAtWorldThreeForFp32AndBf16) {
  run_ranks(3, [](const ProcessGroup& pg) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      for (int64_t per_rank : {1, 2, 7, 1001}) expect_exact_reduce_scatter(pg, per_rank, dtype);
    }
  });
}

TEST(Collectives, ReduceScatterIsTheExactSumAtWorldFourWithOneElementPerRank) {
  run_ranks(4, [](const ProcessGroup& pg) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) expect_exact_reduce_scatter(pg, 1, dtype);
  });
}

// Note [Gloo with CUDA tensors]: CUDA tensors go through host buffers; with
// FSDP_GLOO_STAGE_THROUGH_HOST=1 CPU tensors take the same path, so these run it without a
// GPU: every collective, and the exact reduce-scatter of both algorithms, in fp32 and bf16.
TEST(Collectives, StagedThroughHostBuffersEveryCollectiveGivesTheSameResults) {
  for (const char* algorithm : {"direct", "allreduce"}) {
    SCOPED_TRACE(algorithm);
    run_ranks(
        3,
        [](const ProcessGroup& pg) {
          every_collective_at_world_three(pg);
          for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
            for (int64_t per_rank : {1, 7, 1001}) expect_exact_reduce_scatter(pg, per_rank, dtype);
          }
        },
        300,
        {"FSDP_GLOO_STAGE_THROUGH_HOST=1", std::string("FSDP_GLOO_REDUCE_SCATTER=") + algorithm});
  }
}

// ... and the staging is real: with FSDP_GLOO_STAGE_THROUGH_HOST=1 (read when a group is
// made: here by split()), a reduce-scatter allocates a host copy of the whole input
// besides what the unstaged one allocates (the N-1 received parts).
TEST(Collectives, StagingThroughHostBuffersCopiesTheWholeInputOnTheHost) {
  run_ranks(3, [](const ProcessGroup& pg) {
    auto& counter = CountingCpuAllocator::install();
    constexpr int64_t kNumel = 3 << 16;
    auto peak_of_one_reduce_scatter = [&](const ProcessGroup& g) {
      auto full = integer_grad(g.rank(), kNumel, torch::kFloat);
      auto mine = torch::empty({kNumel / 3});
      g.barrier();
      const int64_t before = counter.live();
      counter.reset_peak();
      g.reduce_scatter_sum(full, mine);
      return counter.peak() - before;
    };
    const int64_t unstaged = peak_of_one_reduce_scatter(pg);
    setenv("FSDP_GLOO_STAGE_THROUGH_HOST", "1", 1);
    const ProcessGroup staged_group = pg.split({{0, 1, 2}});
    unsetenv("FSDP_GLOO_STAGE_THROUGH_HOST");
    const int64_t staged = peak_of_one_reduce_scatter(staged_group);
    EXPECT_GE(unstaged, 2 * kNumel / 3 * 4) << "the two received parts";
    EXPECT_GE(staged - unstaged, kNumel * 4)
        << "rank " << pg.rank() << ": unstaged peak " << unstaged << " bytes, staged " << staged;
  });
}

// Bytes this process wrote to its sockets (and anything else) so far: /proc/self/io's
// wchar, which counts every write/writev of all its threads (Gloo's transport writes with
// writev). -1 where the kernel keeps no such count.
int64_t bytes_written() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

// What one reduce-scatter of `numel` elements of `dtype` writes on this rank, after a
// barrier (so no other collective is in flight).
int64_t bytes_of_one_reduce_scatter(const ProcessGroup& pg, int64_t numel,
                                    torch::ScalarType dtype) {
  auto full = integer_grad(pg.rank(), numel, dtype);
  auto mine = torch::empty({numel / pg.size()}, dtype);
  pg.barrier();
  const int64_t before = bytes_written();
  pg.reduce_scatter_sum(full, mine);
  const int64_t after = bytes_written();
  return before < 0 || after < 0 ? -1 : after - before;
}

// Each rank puts (N-1)/N of the flat gradient on the wire, in its own dtype (bf16 stays
// bf16), plus Gloo's few headers; FSDP_GLOO_REDUCE_SCATTER=allreduce, the former path,
// writes 2(N-1)/N (Gloo's ring all-reduce), which shows the count sees the wire.
TEST(Collectives, ReduceScatterSendsNMinusOneNthsOfTheGradientPerRank) {
  constexpr int kWorld = 3;
  constexpr int64_t kNumel = int64_t{3} << 18;  // 3 MiB of fp32
  constexpr int64_t kSlack = 64 << 10;          // headers and notifications
  auto expect_bytes = [](const ProcessGroup& pg, torch::ScalarType dtype, double fraction) {
    const int64_t flat = kNumel * static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t sent = bytes_of_one_reduce_scatter(pg, kNumel, dtype);
    if (sent < 0) return;
    const auto want = static_cast<int64_t>(fraction * static_cast<double>(flat));
    EXPECT_GE(sent, want) << dtype << ": rank " << pg.rank() << " wrote " << sent << " bytes for a "
                          << flat << "-byte gradient";
    EXPECT_LE(sent, want + kSlack) << dtype << ": rank " << pg.rank() << " wrote " << sent
                                   << " bytes for a " << flat << "-byte gradient";
  };
  if (bytes_written() < 0) GTEST_SKIP() << "this kernel keeps no /proc/self/io write count";
  run_ranks(kWorld, [&](const ProcessGroup& pg) {
    expect_bytes(pg, torch::kFloat, (kWorld - 1.0) / kWorld);
    expect_bytes(pg, torch::kBFloat16, (kWorld - 1.0) / kWorld);
  });
  run_ranks(
      kWorld,
      [&](const ProcessGroup& pg) { expect_bytes(pg, torch::kFloat, 2 * (kWorld - 1.0) / kWorld); },
      300, {"FSDP_GLOO_REDUCE_SCATTER=allreduce"});
}

TEST(Collectives, AnUnknownGlooReduceScatterAlgorithmIsNamed) {
  run_ranks(2, [](const ProcessGroup& pg) {
    setenv("FSDP_GLOO_REDUCE_SCATTER", "ring", 1);
    const std::string what = error_of([&] { pg.split({{0, 1}}); });
    unsetenv("FSDP_GLOO_REDUCE_SCATTER");
    EXPECT_NE(what.find("FSDP_GLOO_REDUCE_SCATTER='ring' is not an algorithm: use direct"),
              std::string::npos)
        << what;
  });
}

TEST(Collectives, SplitMakesDisjointSubgroups) {
  run_ranks(4, [](const ProcessGroup& pg) {
    auto sub = pg.split({{0, 2}, {1, 3}});
    EXPECT_EQ(sub.size(), 2);
    EXPECT_EQ(sub.rank(), pg.rank() / 2);
    auto t = torch::tensor({static_cast<float>(pg.rank())});
    sub.all_reduce_sum(t);
    EXPECT_EQ(t.item<float>(), pg.rank() % 2 == 0 ? 2.f : 4.f);
    EXPECT_EQ(error_of([&] {
                pg.split({{0, 1}, {1, 2, 3}});
              }),
              "ProcessGroup::split: rank 1 is listed in two groups; the groups must be disjoint");
  });
}

}  // namespace

}  // namespace test_process_group_cases
