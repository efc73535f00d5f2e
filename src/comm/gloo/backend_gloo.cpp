// Gloo backend: collectives through c10d::ProcessGroupGloo (see Note [Backend adaptor]), on
// host memory; CUDA tensors are staged through pinned host buffers (Note [Gloo with CUDA
// tensors]).
#include "comm/backend.h"
#include "comm/route.h"
#include "comm/wire.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <atomic>
#include <cstdlib>
#include <future>
#include <sstream>
#include <thread>

namespace fsdp::detail {
namespace {

class C10dWork : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then = {})
      : work_(std::move(work)), then_(std::move(then)) {}
  void wait() override {
    work_->wait();
    if (then_) {
      then_();
      then_ = {};
    }
  }
  void on_completion(std::function<void()> f) override {
    // Gloo completes its work on its own threads and marks the work's future then.
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    try {
      fut = work_->getFuture();
    } catch (const std::exception&) {
      return;  // no future: the span ends at the wait
    }
    if (fut) fut->addCallback([f = std::move(f)](c10::ivalue::Future&) { f(); });
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;  ///< finishes the emulated collective (e.g. takes a chunk)
};

// Note [Gloo reduce-scatter]
// Neither LibTorch's ProcessGroupGloo reduce-scatters: 2.6's _reduce_scatter_base and
// 2.15's reduce_scatter_single call reduce_scatter_tensor_coalesced /
// reduce_scatter_single_coalesced, which all-reduce the whole input (Gloo's ring: 2(N-1)/N
// of it leaves each rank) and copy out the rank's chunk; 2.6's list reduce_scatter throws.
// So the backend moves the chunks itself over ProcessGroupGloo's send/recv, which every
// supported version has: at issue, each rank posts, for every other rank j, a send of its
// chunk j of `full` to j and a receive of j's chunk of its own; Gloo's transport moves them
// while the caller computes. wait() sums the N parts of this rank's chunk in rank order
// (rank 0's + rank 1's + ...), in fp32 for bf16/fp16, and rounds once into `shard`. Each
// rank sends (N-1)/N of `full`, in its own dtype, in one round (no partial sums travel, so
// bf16 need not widen on the wire), and receives as much into N-1 buffers of a chunk each,
// freed by wait(). Every element of a chunk is summed in the same order on every run; only
// the chunk's owner computes it, so no two ranks need to agree. Tags: one per call, counted
// alike on every rank (send/recv slots do not meet the collectives' prefixed ones).
enum class RsAlgorithm { kDirect, kAllReduce };

RsAlgorithm reduce_scatter_algorithm() {
  const char* v = std::getenv("FSDP_GLOO_REDUCE_SCATTER");
  if (v == nullptr || *v == '\0' || std::string(v) == "direct") return RsAlgorithm::kDirect;
  TORCH_CHECK(std::string(v) == "allreduce", "FSDP_GLOO_REDUCE_SCATTER='", v,
              "' is not an algorithm: use direct (the default: each rank sends (N-1)/N of the "
              "gradient) or allreduce (a SUM all-reduce, then the rank's chunk; 2(N-1)/N)");
  return RsAlgorithm::kAllReduce;
}

class GlooReduceScatter : public Work {
 public:
  GlooReduceScatter(std::vector<c10::intrusive_ptr<c10d::Work>> recvs,
                    std::vector<c10::intrusive_ptr<c10d::Work>> sends,
                    std::vector<at::Tensor> parts, at::Tensor shard)
      : recvs_(std::move(recvs)),
        sends_(std::move(sends)),
        parts_(std::move(parts)),
        shard_(std::move(shard)) {}
  void wait() override {
    if (parts_.empty()) return;
    for (auto& w : recvs_) w->wait();
    {
      at::NoGradGuard g;
      const auto t = parts_[0].scalar_type();
      const bool widen = t == at::kBFloat16 || t == at::kHalf;
      bool in_place = !widen && shard_.scalar_type() == t;
      for (const auto& p : parts_) in_place = in_place && !shard_.is_alias_of(p);
      at::Tensor acc = widen      ? parts_[0].to(at::kFloat)
                       : in_place ? shard_.copy_(parts_[0])
                                  : parts_[0].clone();
      for (size_t i = 1; i < parts_.size(); ++i) acc.add_(parts_[i]);
      if (!in_place) shard_.copy_(acc);
    }
    for (auto& w : sends_) w->wait();
    recvs_.clear();
    sends_.clear();
    parts_.clear();
  }
  /// Once every part has arrived (the sum is wait()'s, on the caller's thread).
  void on_completion(std::function<void()> f) override {
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    try {
      for (auto& w : recvs_) futures.push_back(w->getFuture());
    } catch (const std::exception&) {
      return;  // no futures: the span ends at the wait
    }
    auto left = std::make_shared<std::atomic<size_t>>(futures.size());
    auto done = std::make_shared<std::function<void()>>(std::move(f));
    if (futures.empty()) (*done)();
    for (auto& fut : futures) {
      fut->addCallback([left, done](c10::ivalue::Future&) {
        if (left->fetch_sub(1) == 1) (*done)();
      });
    }
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
  std::vector<at::Tensor> parts_;  ///< rank i's contribution to this rank's chunk, at i
  at::Tensor shard_;
};

// Other dtypes (bfloat16) are reduced in fp32: Gloo's bf16 sum differs between LibTorch
// versions, and an fp32 sum rounds once, at the end.
bool gloo_reduces(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kInt || t == at::kLong;
}

// Note [Gloo with CUDA tensors]
// Gloo's transports move host memory: ProcessGroupGloo's send and recv hand the tensor's
// data pointer to the socket whatever its device, and its CUDA paths for the collectives
// differ between LibTorch versions. So this backend never gives Gloo a CUDA tensor: each
// collective stages its CUDA operands through host buffers (pinned, so the copies are
// DMA), runs the host collective, and copies the result back in wait(). The device-to-host
// copy at issue is ordered after the work already issued on the current stream (the copy
// waits for it), and the copy back at wait() completes before wait() returns, so the
// engine's streams see the same contract as NCCL's Work::wait(). That lets several ranks
// share one GPU (ProcessGroupOptions::backend = "gloo" with a CUDA device, which NCCL
// refuses): everything but NCCL itself runs. FSDP_GLOO_STAGE_THROUGH_HOST=1 stages CPU
// tensors too (through plain host buffers), so the CPU tests run the staging path.
bool stage_all_through_host() {
  const char* v = std::getenv("FSDP_GLOO_STAGE_THROUGH_HOST");
  return v != nullptr && std::string(v) == "1";
}

// Note [Gloo connection deadline]
// Gloo's connectFullMesh waits for each peer's address, then connects to each peer,
// retrying refused connects, each wait bounded by the timeout on its own: a rank whose
// peers cannot be reached gave up only after several timeouts (about 5x FSDP_TIMEOUT_S
// with four ranks). The connection set-up runs on a helper thread and the rank waits for
// it at most the timeout, then fails naming the peers it was connecting to and the
// address each advertised (keys "<prefix>/addr/<rank>", written before connecting). A
// helper left behind ends with Gloo's own retries, or with the process.
using GlooGroup = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

GlooGroup connect_within(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& opts,
                         std::chrono::milliseconds timeout) {
  auto done = std::make_shared<std::promise<GlooGroup>>();
  std::future<GlooGroup> result = done->get_future();
  std::thread([done, store, rank, size, opts]() {
    try {
      done->set_value(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts));
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (result.wait_for(timeout) == std::future_status::timeout) return GlooGroup();
  return result.get();  // rethrows Gloo's own failure
}

// "rank 2 on 10.9.0.2, rank 3 on 10.9.0.2" for every peer of `init`'s member, from the
// addresses the ranks advertised in `store` ("advertised no address" for a rank that never
// wrote one); when the store no longer answers (rank 0, which serves it, has stopped),
// just the ranks.
std::string peers_and_addresses(c10d::Store& store, const BackendInit& init) {
  std::ostringstream s;
  std::ostringstream ranks;
  bool first = true;
  bool store_lost = false;
  for (int r = 0; r < init.size; ++r) {
    if (r == init.rank) continue;
    std::string addr = "(advertised no address)";
    if (!store_lost) {
      try {
        const std::string key = "addr/" + std::to_string(r);
        if (store.check({key})) {
          auto v = store.get(key);
          addr = "on " + std::string(v.begin(), v.end());
        }
      } catch (const std::exception&) {
        store_lost = true;
      }
    }
    s << (first ? "" : ", ") << "rank " << global_rank_of(init, r) << " " << addr;
    ranks << (first ? "" : ", ") << global_rank_of(init, r);
    first = false;
  }
  if (store_lost) {
    return "ranks " + ranks.str() +
           " (their addresses are unknown: the rendezvous store, served by rank 0, no longer "
           "answers; see rank 0's error)";
  }
  return s.str();
}

class GlooBackend : public C10dBackend<GlooBackend, c10d::ProcessGroupGloo> {
 public:
  GlooBackend(const BackendInit& init, std::string prefix) : C10dBackend(init, std::move(prefix)) {
    auto opts = c10d::ProcessGroupGloo::Options::create(init.timeout);
    std::string bound;       // which address the ranks' sockets use, and why (for errors)
    std::string advertised;  // the address alone, for the peers' errors
    const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
    if (iface != nullptr && *iface != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      bound = std::string("interface ") + iface + " (GLOO_SOCKET_IFNAME)";
      advertised = std::string("interface ") + iface;
    } else if (init.master_addr == "127.0.0.1" || init.master_addr == "localhost" ||
               init.master_addr == "::1") {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      bound = "127.0.0.1 (MASTER_ADDR=" + init.master_addr + " is loopback)";
      advertised = "127.0.0.1";
    } else {
      // Note [Gloo's interface]: the address that reaches the rendezvous host, not the
      // one this host's name resolves to (127.0.1.1 on Debian).
      const std::string local = local_address_toward(init.master_addr, "MASTER_ADDR");
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
      bound = local + " (the address that reaches MASTER_ADDR=" + init.master_addr + ")";
      advertised = local;
    }
    opts->threads = 2;
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix_, init.store);
    const std::string fix =
        "Ranks on several hosts must advertise an address their peers can reach: set "
        "GLOO_SOCKET_IFNAME to the interface that links the hosts (e.g. eth0) on every rank, "
        "or check that every host reaches MASTER_ADDR.";
    const std::string who = "rank " + std::to_string(global_rank_of(init, init.rank));
    store->set("addr/" + std::to_string(init.rank),
               std::vector<uint8_t>(advertised.begin(), advertised.end()));
    // Note [Peer probe]: a socket on the advertised address, for peers to probe.
    const std::string numeric =
        iface != nullptr && *iface != '\0' ? interface_address(iface) : advertised;
    probe_ = std::make_shared<ProbeListener>(numeric);
    const std::string probe = numeric + " " + std::to_string(probe_->port());
    store->set("probe/" + std::to_string(init.rank),
               std::vector<uint8_t>(probe.begin(), probe.end()));
    try {
      pg_ = connect_within(store, init.rank, init.size, opts, init.timeout);
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(false, who, " could not connect to the other ranks over Gloo from ", bound, ": ",
                  what.substr(0, what.find('\n')), ". ", fix);
    }
    // Note [Gloo connection deadline]
    TORCH_CHECK(pg_, who, " could not connect to the other ranks over Gloo from ", bound,
                " within ", timeout_s(), " s (FSDP_TIMEOUT_S): it was connecting to ",
                peers_and_addresses(*store, init), ". ", fix,
                " A slow network may need a larger FSDP_TIMEOUT_S.");
    // Every peer wrote its probe key before connecting, so all are there now.
    for (int r = 0; r < init.size; ++r) {
      if (r == init.rank) continue;
      ProbePeer p;
      p.rank = global_rank_of(init, r);
      auto v = store->get("probe/" + std::to_string(r));
      std::istringstream text(std::string(v.begin(), v.end()));
      text >> p.address >> p.port;
      peers_.push_back(p);
    }
  }

  std::function<std::string()> peer_report() const override {
    return [peers = peers_]() { return probe_peers(peers, std::chrono::milliseconds(500)); };
  }

  std::string name() const override { return "gloo"; }

  std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) override {
    // Note [Gloo with CUDA tensors]
    const at::Tensor host_shard = to_host(shard);
    const at::Tensor host_full = host_buffer(full);
    // Gathering moves bytes, so any dtype travels as bytes; the list form (in every
    // LibTorch 2.x) writes into chunks of the flat output.
    std::vector<at::Tensor> inputs{host_shard.view(at::kByte)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0] = host_full.view(at::kByte).chunk(init_.size);
    return std::make_shared<C10dWork>(pg_->allgather(outputs, inputs), copy_back(host_full, full));
  }

  std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                           const at::Tensor& shard) override {
    // Note [Gloo with CUDA tensors]
    const at::Tensor host_full = to_host(full);
    const at::Tensor host_shard = host_buffer(shard);
    auto work = rs_algorithm_ == RsAlgorithm::kAllReduce
                    ? all_reduce_then_chunk(host_full, host_shard)
                    : direct_reduce_scatter(host_full, host_shard);
    if (host_shard.is_same(shard)) return work;
    return std::make_shared<ThenWork>(std::move(work), copy_back(host_shard, shard));
  }

  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, ReduceKind kind) override {
    // On the host, in a dtype Gloo sums (Note [Gloo with CUDA tensors]).
    const bool widen = !gloo_reduces(tensor.scalar_type());
    auto buf = widen ? tensor.to(at::kCPU, at::kFloat) : staged(tensor) ? to_host(tensor) : tensor;
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = kind == ReduceKind::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    auto work = pg_->allreduce(ts, o);
    if (buf.is_same(tensor)) return std::make_shared<C10dWork>(work);
    return std::make_shared<C10dWork>(work, copy_back(buf, tensor));
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    const at::Tensor host = to_host(tensor);  // Note [Gloo with CUDA tensors]
    std::vector<at::Tensor> ts{host.view(at::kByte)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg_->broadcast(ts, o)->wait();
    if (auto back = copy_back(host, tensor)) back();
  }

  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in) override {
    // Note [Gloo with CUDA tensors]; bytes travel as bytes, in equal chunks.
    at::Tensor host_in = to_host(in).view(at::kByte);
    const at::Tensor host_out = host_buffer(out);
    at::Tensor bytes_out = host_out.view(at::kByte);
    std::vector<int64_t> equal;
    return std::make_shared<C10dWork>(pg_->alltoall_base(bytes_out, host_in, equal, equal),
                                      copy_back(host_out, out));
  }

  // Note [Wire bytes]: what this backend's algorithms send.
  int64_t wire_bytes(WireOp op, int64_t bytes, at::ScalarType dtype, int root) const override {
    const int n = init_.size;
    const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
    // Gloo sums in the tensor's dtype, or in fp32 (gloo_reduces).
    const int64_t summed = gloo_reduces(dtype) ? bytes : bytes / element * 4;
    const int64_t summed_element = gloo_reduces(dtype) ? element : 4;
    switch (op) {
      case WireOp::kReduceScatter:
        if (rs_algorithm_ == RsAlgorithm::kDirect) return ring_share_bytes(bytes, n);
        return gloo_ring_all_reduce_bytes(summed, summed_element, n, init_.rank);
      case WireOp::kAllReduce:
        return gloo_ring_all_reduce_bytes(summed, summed_element, n, init_.rank);
      case WireOp::kBroadcast:
        return gloo_broadcast_bytes(bytes, n, init_.rank, root);
      case WireOp::kAllGather:
      case WireOp::kAllToAll:
        break;
    }
    return ring_share_bytes(bytes, n);
  }

  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, int tag) override {
    at::Tensor host = to_host(tensor);  // Note [Gloo with CUDA tensors]
    std::vector<at::Tensor> ts{host};
    // The work keeps the host copy until it has been sent.
    return std::make_shared<C10dWork>(pg_->send(ts, dst, tag), [host]() {});
  }

  std::shared_ptr<Work> recv(const at::Tensor& tensor, int src, int tag) override {
    at::Tensor host = host_buffer(tensor);
    std::vector<at::Tensor> ts{host};
    return std::make_shared<C10dWork>(pg_->recv(ts, src, tag), copy_back(host, tensor));
  }

 private:
  // Note [Gloo with CUDA tensors]: whether `t` goes through a host buffer, the buffer
  // (pinned for a CUDA tensor), `t` copied there (after the current stream's work on it),
  // and the copy of a buffer back into `t`, run by wait() (nothing when `t` is the buffer).
  bool staged(const at::Tensor& t) const { return t.is_cuda() || stage_all_; }
  at::Tensor host_buffer(const at::Tensor& t) const {
    if (!staged(t)) return t;
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  }
  at::Tensor to_host(const at::Tensor& t) const {
    if (!staged(t)) return t;
    at::NoGradGuard g;
    return host_buffer(t).copy_(t);
  }
  static std::function<void()> copy_back(const at::Tensor& host, const at::Tensor& t) {
    if (host.is_same(t)) return {};
    return [host, t]() {
      at::NoGradGuard g;
      t.copy_(host);
    };
  }

  // Note [Gloo reduce-scatter]
  std::shared_ptr<Work> direct_reduce_scatter(const at::Tensor& full, const at::Tensor& shard) {
    const int64_t n = shard.numel();
    const int size = init_.size;
    const int me = init_.rank;
    const int tag = static_cast<int>(rs_calls_++ % (int64_t{1} << 30));
    std::vector<at::Tensor> parts(static_cast<size_t>(size));
    std::vector<c10::intrusive_ptr<c10d::Work>> recvs;
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    for (int k = 1; k < size; ++k) {
      const int from = (me - k + size) % size;
      const int to = (me + k) % size;
      parts[static_cast<size_t>(from)] = at::empty({n}, full.options());
      std::vector<at::Tensor> in{parts[static_cast<size_t>(from)]};
      recvs.push_back(pg_->recv(in, from, tag));
      std::vector<at::Tensor> out{full.narrow(0, to * n, n)};
      sends.push_back(pg_->send(out, to, tag));
    }
    parts[static_cast<size_t>(me)] = full.narrow(0, me * n, n);
    return std::make_shared<GlooReduceScatter>(std::move(recvs), std::move(sends), std::move(parts),
                                               shard);
  }

  // The former reduce-scatter (FSDP_GLOO_REDUCE_SCATTER=allreduce): a SUM all-reduce of
  // `full`, then this rank's chunk; 2(N-1)/N of `full` leaves each rank.
  std::shared_ptr<Work> all_reduce_then_chunk(const at::Tensor& full, const at::Tensor& shard) {
    auto buf = gloo_reduces(full.scalar_type()) ? full : full.to(at::kFloat);
    std::vector<at::Tensor> ts{buf};
    auto work = pg_->allreduce(ts);
    int64_t n = shard.numel();
    int64_t r = init_.rank;
    return std::make_shared<C10dWork>(work, [buf, shard, n, r]() {
      at::NoGradGuard g;
      shard.copy_(buf.narrow(0, r * n, n));
    });
  }

  RsAlgorithm rs_algorithm_ = reduce_scatter_algorithm();
  bool stage_all_ = stage_all_through_host();  ///< Note [Gloo with CUDA tensors]
  int64_t rs_calls_ = 0;  ///< reduce-scatters issued; each uses its own send/recv tag
  std::shared_ptr<ProbeListener> probe_;  ///< Note [Peer probe]
  std::vector<ProbePeer> peers_;          ///< this group's other ranks, to probe
};

}  // namespace

std::shared_ptr<Backend> make_gloo_backend(const BackendInit& init) {
  return std::make_shared<GlooBackend>(init, "fsdp/gloo");
}

}  // namespace fsdp::detail
