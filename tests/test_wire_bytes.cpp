// Note [Wire bytes] (src/comm/wire.cpp): what each collective sends, counted by the
// backend's algorithm, checked two ways: against the closed forms written out here, and
// against what the kernel says this process sent on its TCP sockets (the figure plus Gloo's
// per-message header). Worlds 2 to 4, 1 element per rank as an edge, fp32 and bf16, every
// root of a broadcast, the quantized collectives; and the engine's CommStats over a
// training step on each path (bf16, qwZ, qgZ, hpZ, hybrid).
#include "../src/comm/backend.h"
#include "../src/comm/quantize.h"
#include "../src/comm/wire.h"
#include "../src/internal/sharded_model.h"  // flat-parameter sizes
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/fsdp.h>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <dirent.h>
#include <fcntl.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_wire_bytes_cases {

using fsdp::detail::Backend;
using fsdp::detail::quantized_bytes;
using fsdp::detail::WireOp;
using fsdp::testing::run_ranks;

namespace {

// The payload bytes a TCP socket has been given to send: tcp_info's bytes sent, less those
// sent again (retransmissions), plus those written but not sent yet (a loaded machine may
// not have sent them when the collective's wait returned). Linux 4.19 and newer.
// kNotTcp when `fd` is no TCP socket; kNoCounters when the kernel lacks the fields.
constexpr int64_t kNotTcp = -1, kNoCounters = -2;
int64_t socket_bytes(int fd) {
  int type = 0;
  socklen_t len = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return kNotTcp;
  tcp_info info{};
  len = sizeof info;
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return kNotTcp;
  if (len < offsetof(tcp_info, tcpi_bytes_retrans) + sizeof info.tcpi_bytes_retrans)
    return kNoCounters;
  return static_cast<int64_t>(info.tcpi_bytes_sent) -
         static_cast<int64_t>(info.tcpi_bytes_retrans) +
         static_cast<int64_t>(info.tcpi_notsent_bytes);
}

// What this process has written to all its TCP sockets, framing included, counted so that
// a socket closed between two counts keeps its bytes: each socket seen is held open by a
// duplicate descriptor of this object's (keyed by its inode), and counted through it. Gloo
// closes a pair's descriptor now and then in the middle of a test (seen on a loaded
// machine: a split group's socket, its bytes for the step written, gone before the count
// after the step), which took its bytes out of the total.
class SocketBytes {
 public:
  SocketBytes() = default;
  SocketBytes(const SocketBytes&) = delete;
  SocketBytes& operator=(const SocketBytes&) = delete;
  ~SocketBytes() {
    for (const auto& [inode, fd] : held_) close(fd);
  }
  // The total now, over every socket open now or seen open before; -1 where it cannot be
  // counted.
  int64_t total() {
    DIR* d = opendir("/proc/self/fd");
    if (d == nullptr) return -1;
    std::vector<int> fds;
    while (dirent* e = readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd > 2 && fd != dirfd(d)) fds.push_back(fd);
    }
    closedir(d);
    for (int fd : fds) {
      const int64_t b = socket_bytes(fd);
      if (b == kNoCounters) return -1;
      struct stat st {};
      if (b == kNotTcp || fstat(fd, &st) != 0 || held_.count(st.st_ino) != 0) continue;
      const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);
      if (copy >= 0) held_[st.st_ino] = copy;
    }
    int64_t sum = 0;
    for (const auto& [inode, fd] : held_) {
      const int64_t b = socket_bytes(fd);
      if (b < 0) return -1;
      sum += b;
    }
    return sum;
  }

 private:
  std::map<ino_t, int> held_;  ///< a socket's inode, and this object's descriptor of it
};

Backend& backend(const fsdp::ProcessGroup& pg) { return *fsdp::detail::GroupAccess::backend(pg); }

// Runs `op` (a collective that waits), then a barrier, and returns the bytes the kernel saw
// this process send for it, less a barrier's own (measured alone just before).
template <class Op>
int64_t measured(Backend& group, Op&& op) {
  SocketBytes sockets;
  group.barrier();
  const int64_t a = sockets.total();
  group.barrier();
  const int64_t b = sockets.total();
  op();
  group.barrier();
  const int64_t c = sockets.total();
  return (c - b) - (b - a);
}

// `counted` matches the kernel's count within Gloo's framing: at most `messages` headers of
// kHeader bytes (and the barrier's jitter).
constexpr int64_t kHeader = 128;
void expect_kernel_agrees(int64_t counted, int64_t kernel, int64_t messages,
                          const std::string& what) {
  EXPECT_GE(kernel, counted - 64) << what;
  EXPECT_LE(kernel, counted + kHeader * messages + 256) << what;
  std::printf("[report] %-58s counted %9lld  kernel %9lld\n", what.c_str(),
              static_cast<long long>(counted), static_cast<long long>(kernel));
  std::fflush(stdout);
}

}  // namespace

TEST(WireBytes, TheKernelCanCountThisProcesssTcpBytes) {
  ASSERT_GE(SocketBytes().total(), 0) << "tcp_info has no tcpi_bytes_sent on this kernel";
}

// Each collective of the Gloo backend: the closed form, and the kernel's count.
TEST(WireBytes, EachCollectiveSendsWhatItsAlgorithmSays) {
  for (int n : {2, 3, 4}) {
    run_ranks(n, [n](const fsdp::ProcessGroup& pg) {
      Backend& g = backend(pg);
      const int me = pg.rank();
      for (int64_t e : {int64_t{1}, int64_t{50000}}) {
        for (auto dtype : {at::kFloat, at::kBFloat16}) {
          const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
          const auto opts = torch::TensorOptions().dtype(dtype);
          const std::string tag = std::to_string(n) + " ranks, " + std::to_string(e) +
                                  " elements/rank, " + c10::toString(dtype) + ", rank " +
                                  std::to_string(me);
          const int64_t full = n * e * es;

          // All-gather: a ring, (n - 1) parts leave each rank.
          EXPECT_EQ(g.wire_bytes(WireOp::kAllGather, full, dtype, 0), (n - 1) * e * es);
          auto out = torch::empty({n * e}, opts);
          auto part = torch::full({e}, me, opts);
          expect_kernel_agrees(g.wire_bytes(WireOp::kAllGather, full, dtype, 0),
                               measured(g, [&] { g.all_gather(out, part)->wait(); }), 2 * n,
                               "all-gather, " + tag);

          // Reduce-scatter: direct, (n - 1) chunks in their own dtype.
          EXPECT_EQ(g.wire_bytes(WireOp::kReduceScatter, full, dtype, 0), (n - 1) * e * es);
          auto in = torch::ones({n * e}, opts);
          auto mine = torch::empty({e}, opts);
          expect_kernel_agrees(g.wire_bytes(WireOp::kReduceScatter, full, dtype, 0),
                               measured(g, [&] { g.reduce_scatter_sum(in, mine)->wait(); }), n,
                               "reduce-scatter, " + tag);

          // All-reduce: Gloo's ring over fp32 (bf16 widened), 2(n - 1)/n of it for
          // buffers that split evenly.
          const int64_t ar_bytes = n * e * 4;
          if ((n * e) % (2 * n) == 0)
            EXPECT_EQ(g.wire_bytes(WireOp::kAllReduce, n * e * es, dtype, 0),
                      2 * (n - 1) * ar_bytes / n);
          auto t = torch::ones({n * e}, opts);
          expect_kernel_agrees(
              g.wire_bytes(WireOp::kAllReduce, n * e * es, dtype, 0),
              measured(g, [&] { g.all_reduce(t, fsdp::detail::ReduceKind::kSum)->wait(); }), 4 * n,
              "all-reduce, " + tag);

          // Broadcast from every root: a binomial tree.
          for (int root = 0; root < n; ++root) {
            auto b = torch::ones({e}, opts);
            const int64_t counted = g.wire_bytes(WireOp::kBroadcast, e * es, dtype, root);
            expect_kernel_agrees(counted, measured(g, [&] { g.broadcast(b, root); }), n,
                                 "broadcast from " + std::to_string(root) + ", " + tag);
          }

          // All-to-all: direct, (n - 1) chunks.
          EXPECT_EQ(g.wire_bytes(WireOp::kAllToAll, full, dtype, 0), (n - 1) * e * es);
          auto a2a = torch::empty({n * e}, opts);
          expect_kernel_agrees(g.wire_bytes(WireOp::kAllToAll, full, dtype, 0),
                               measured(g, [&] { g.all_to_all(a2a, in)->wait(); }), 2 * n,
                               "all-to-all, " + tag);
        }
        // The quantized collectives: int8 and int4 data with fp32 scales per 64 elements.
        for (int bits : {8, 4}) {
          const fsdp::detail::QuantizeSpec spec{64, bits, at::kFloat};
          const std::string tag = std::to_string(n) + " ranks, " + std::to_string(e) +
                                  " elements/rank, int" + std::to_string(bits) + ", rank " +
                                  std::to_string(me);
          auto full = torch::empty({n * e});
          auto shard = torch::randn({e});
          int64_t counted = -1;
          const int64_t kernel = measured(g, [&] {
            fsdp::detail::quantized_all_gather(g, full, shard, spec, &counted)->wait();
          });
          EXPECT_EQ(counted, (n - 1) * quantized_bytes(e, 64, bits));
          expect_kernel_agrees(counted, kernel, 2 * n, "quantized all-gather, " + tag);
          auto grad = torch::randn({n * e});
          const int64_t kernel_rs = measured(g, [&] {
            fsdp::detail::quantized_reduce_scatter(g, grad, shard, spec, &counted)->wait();
          });
          EXPECT_EQ(counted, (n - 1) * quantized_bytes(e, 64, bits));
          expect_kernel_agrees(counted, kernel_rs, 2 * n, "quantized reduce-scatter, " + tag);
        }
      }
    });
  }
}

// The Gloo ring all-reduce's figure for buffers that do not split evenly, and the binomial
// broadcast's per root, against their algorithms worked by hand.
TEST(WireBytes, UnevenRingsAndBroadcastTreesByHand) {
  // 4 ranks, 3 fp32 elements (12 bytes): segments of 4 bytes (ceil(12/8) rounded up to an
  // element), 8 segments, 6 sends per phase; rank r's reduce-scatter sends segments
  // (r+1)*2+i, i < 6, mod 8, of which those below 3 hold data; its all-gather r*2+i.
  // Rank 0: reduce-scatter 2,3,4,5,6,7 -> segment 2 (4 bytes); all-gather 0..5 -> 0,1,2.
  EXPECT_EQ(fsdp::detail::gloo_ring_all_reduce_bytes(12, 4, 4, 0), 4 + 12);
  // Rank 3: reduce-scatter 0,1,2,3,4,5 -> 12; all-gather 6,7,0,1,2,3 -> 12.
  EXPECT_EQ(fsdp::detail::gloo_ring_all_reduce_bytes(12, 4, 4, 3), 24);
  // Even: 2 ranks, 16 bytes: 2 of 4 segments of 4 bytes each way.
  EXPECT_EQ(fsdp::detail::gloo_ring_all_reduce_bytes(16, 4, 2, 1), 16);
  // Binomial broadcast over 4 from 0: round 0, 0 -> 1; round 1, 0 -> 2 and 1 -> 3.
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 4, 0, 0), 20);
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 4, 1, 0), 10);
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 4, 2, 0), 0);
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 4, 3, 0), 0);
  // Over 3 from root 2: virtual ranks 0 (rank 2) -> 1 (rank 0) and 0 -> 2 (rank 1).
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 3, 2, 2), 20);
  EXPECT_EQ(fsdp::detail::gloo_broadcast_bytes(10, 3, 0, 2), 0);
  EXPECT_EQ(fsdp::detail::ring_share_bytes(12, 1), 0);
}

// ---- The engine's CommStats over one training step, per path -------------------------

namespace {

struct EnginePath {
  const char* name;
  int world;
  fsdp::ShardingStrategy strategy;
  int hybrid = 0;  ///< hybrid_group_size
  int hpz = 0;     ///< reshard_after_forward_group_size
  bool qw = false, qg = false;
};
void PrintTo(const EnginePath& p, std::ostream* os) { *os << p.name; }

constexpr int64_t kBlock = 64;

int64_t q8(int64_t numel) { return quantized_bytes(numel, kBlock, 8); }

class EngineWireBytes : public ::testing::TestWithParam<EnginePath> {};

}  // namespace

// One forward and backward of MlpNet in bf16 (parameters and reduction): every unit is
// gathered in forward and every unit but the root again in backward, and every unit's
// gradient reduced once. The step's wire figures equal the sum, over the flat parameters,
// of each collective's closed form, and the kernel's count agrees with their total.
TEST_P(EngineWireBytes, TheStepSendsWhatEachCollectiveSays) {
  const EnginePath c = GetParam();
  run_ranks(c.world, [c](const fsdp::ProcessGroup& pg) {
    fsdp::ShardingOptions o;
    o.process_group = pg;
    o.strategy = c.strategy;
    o.hybrid_group_size = c.hybrid;
    o.reshard_after_forward_group_size = c.hpz;
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
    o.quantized_communication.weights = c.qw;
    o.quantized_communication.gradients = c.qg;
    o.quantized_communication.block_size = kBlock;
    torch::manual_seed(3);
    auto model = fsdp::fully_shard(fsdp::testing::MlpNet(), o);
    const int n = c.world;
    const int g = c.hybrid > 0 ? c.hybrid : n;  // shard group
    const int reps = n / g;                     // replicas of each shard
    int64_t ag = 0, rs = 0, ar = 0, in_group = 0, outer = 0, calls_q_ag = 0, calls_q_rs = 0;
    for (const auto& f : fsdp::detail::flat_params(model)) {
      const int64_t padded = f.padded_numel, shard = padded / g;
      const int gathers = f.unit_fqn.empty() ? 1 : 2;  // the root stays gathered
      for (int i = 0; i < gathers; ++i) {
        const bool from_slice = i == 1 && c.hpz > 0;
        if (from_slice) {  // the hpZ group's slices, unquantized bf16
          ag += (c.hpz - 1) * 2 * padded / c.hpz;
          in_group += (c.hpz - 1) * 2 * padded / c.hpz;
        } else if (c.qw) {
          ag += (g - 1) * q8(shard);
          ++calls_q_ag;
        } else {
          ag += (g - 1) * 2 * shard;
        }
      }
      if (c.qg && c.hpz > 0) {  // hierarchical: inside k, then across m
        const int k = c.hpz, m = n / k;
        rs += (k - 1) * q8(m * shard) + (m - 1) * q8(shard);
        outer += (m - 1) * q8(shard);
        ++calls_q_rs;
      } else if (c.qg) {
        rs += (g - 1) * q8(shard);
        ++calls_q_rs;
      } else {
        rs += (g - 1) * 2 * shard;
      }
      if (reps > 1) {  // the replicas' all-reduce of the fp32 (qgZ) or bf16 shard
        if (c.qg) {
          const int64_t part = (shard + reps - 1) / reps;
          ar += 2 * (reps - 1) * q8(part);
        } else {
          ar += fsdp::detail::gloo_ring_all_reduce_bytes(shard * 4, 4, reps, pg.rank() / g);
        }
      }
    }
    Backend& world = backend(pg);
    auto [x, y] = fsdp::testing::mlp_batch(0, 8);
    x = fsdp::testing::my_rows(x, pg);
    y = fsdp::testing::my_rows(y, pg);
    const int64_t kernel = measured(world, [&] {
      auto loss = torch::mse_loss(model(x).to(torch::kFloat), y);
      loss.backward();
    });
    const fsdp::stats::CommStats& s = model.comm_stats().step;
    EXPECT_EQ(s.all_gather_wire_bytes, ag);
    EXPECT_EQ(s.reshard_group_all_gather_wire_bytes, in_group);
    EXPECT_EQ(s.reduce_scatter_wire_bytes, rs);
    EXPECT_EQ(s.hierarchical_outer_wire_bytes, outer);
    EXPECT_EQ(s.all_reduce_wire_bytes, ar);
    EXPECT_EQ(s.quantized_all_gather_calls, calls_q_ag);
    EXPECT_EQ(s.quantized_reduce_scatter_calls, calls_q_rs);
    EXPECT_EQ(s.broadcast_wire_bytes, 0);
    const int64_t calls = s.all_gather_calls + s.reduce_scatter_calls + s.all_reduce_calls;
    expect_kernel_agrees(s.wire_bytes(), kernel, 4 * n * calls,
                         std::string(c.name) + ", rank " + std::to_string(pg.rank()));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Paths, EngineWireBytes,
    ::testing::Values(
        EnginePath{"FullShardBf16World2", 2, fsdp::ShardingStrategy::kFullShard},
        EnginePath{"FullShardBf16World3", 3, fsdp::ShardingStrategy::kFullShard},
        EnginePath{"FullShardBf16World4", 4, fsdp::ShardingStrategy::kFullShard},
        EnginePath{"QwzWorld2", 2, fsdp::ShardingStrategy::kFullShard, 0, 0, true},
        EnginePath{"QwzQgzWorld3", 3, fsdp::ShardingStrategy::kFullShard, 0, 0, true, true},
        EnginePath{"QgzWorld4", 4, fsdp::ShardingStrategy::kFullShard, 0, 0, false, true},
        EnginePath{"QwzQgzHpzWorld4", 4, fsdp::ShardingStrategy::kFullShard, 0, 2, true, true},
        EnginePath{"HybridBf16World4", 4, fsdp::ShardingStrategy::kHybridShard, 2},
        EnginePath{"HybridQwzQgzWorld4", 4, fsdp::ShardingStrategy::kHybridShard, 2, 0, true,
                   true}),
    [](const ::testing::TestParamInfo<EnginePath>& i) { return std::string(i.param.name); });

}  // namespace test_wire_bytes_cases
