// Gloo backend: CPU collectives through c10d::ProcessGroupGloo (see Note [Backend adaptor]).
#include "comm/backend.h"
#include "comm/route.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

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

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;  ///< finishes the emulated collective (e.g. takes a chunk)
};

// Other dtypes (bfloat16) are reduced in fp32: Gloo's bf16 sum differs between LibTorch
// versions, and an fp32 sum rounds once, at the end.
bool gloo_reduces(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kInt || t == at::kLong;
}

class GlooBackend : public Backend {
 public:
  GlooBackend(const BackendInit& init, std::string prefix)
      : init_(init), prefix_(std::move(prefix)) {
    auto opts = c10d::ProcessGroupGloo::Options::create(init.timeout);
    std::string bound;  // which address the ranks' sockets use, and why (for errors)
    const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
    if (iface != nullptr && *iface != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      bound = std::string("interface ") + iface + " (GLOO_SOCKET_IFNAME)";
    } else if (init.master_addr == "127.0.0.1" || init.master_addr == "localhost" ||
               init.master_addr == "::1") {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      bound = "127.0.0.1 (MASTER_ADDR=" + init.master_addr + " is loopback)";
    } else {
      // Note [Gloo's interface]: the address that reaches the rendezvous host, not the
      // one this host's name resolves to (127.0.1.1 on Debian).
      const std::string local = local_address_toward(init.master_addr, "MASTER_ADDR");
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
      bound = local + " (the address that reaches MASTER_ADDR=" + init.master_addr + ")";
    }
    opts->threads = 2;
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix_, init.store);
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, init.rank, init.size, opts);
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(false, "rank ", init.rank,
                  " could not connect to the other ranks over Gloo from ", bound, ": ",
                  what.substr(0, what.find('\n')),
                  ". Ranks on several hosts must advertise an address their peers can reach: "
                  "set GLOO_SOCKET_IFNAME to the interface that links the hosts (e.g. eth0) on "
                  "every rank, or check that every host reaches MASTER_ADDR.");
    }
  }

  int rank() const override { return init_.rank; }
  int size() const override { return init_.size; }
  std::string name() const override { return "gloo"; }
  double timeout_s() const override { return std::chrono::duration<double>(init_.timeout).count(); }

  std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) override {
    // Gathering moves bytes, so any dtype travels as bytes; the list form (in every
    // LibTorch 2.x) writes into chunks of the flat output.
    auto in = shard.view(at::kByte);
    auto out = full.view(at::kByte);
    std::vector<at::Tensor> inputs{in};
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0] = out.chunk(init_.size);
    return std::make_shared<C10dWork>(pg_->allgather(outputs, inputs));
  }

  std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                           const at::Tensor& shard) override {
    // A SUM all-reduce, then this rank's chunk: Gloo's reduce_scatter is not in every
    // supported LibTorch (issue 26 measures the native one where it exists).
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

  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, ReduceKind kind) override {
    auto buf = gloo_reduces(tensor.scalar_type()) ? tensor : tensor.to(at::kFloat);
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = kind == ReduceKind::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    auto work = pg_->allreduce(ts, o);
    if (buf.is_same(tensor)) return std::make_shared<C10dWork>(work);
    return std::make_shared<C10dWork>(work, [buf, tensor]() {
      at::NoGradGuard g;
      tensor.copy_(buf);
    });
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> ts{tensor.view(at::kByte)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg_->broadcast(ts, o)->wait();
  }

  void barrier() override { pg_->barrier()->wait(); }

  std::shared_ptr<Backend> split(const std::vector<std::vector<int>>& groups) override {
    std::string tag;
    BackendInit sub = split_init(init_, groups, prefix_, split_count_++, tag);
    if (sub.size == 1) return make_single_backend();
    return std::make_shared<GlooBackend>(sub, tag);
  }

 private:
  BackendInit init_;
  std::string prefix_;
  int split_count_ = 0;  ///< splits made so far; keeps store keys of each split apart
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::shared_ptr<Backend> make_gloo_backend(const BackendInit& init) {
  return std::make_shared<GlooBackend>(init, "fsdp/gloo");
}

}  // namespace fsdp::detail
