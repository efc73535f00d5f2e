// NCCL backend: GPU collectives through c10d::ProcessGroupNCCL (see Note [Backend adaptor]).
// Built only against a CUDA LibTorch (2.6 or newer).
#include "comm/backend.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace fsdp::detail {
namespace {

class NcclWork : public Work {
 public:
  explicit NcclWork(c10::intrusive_ptr<c10d::Work> work) : work_(std::move(work)) {}
  // wait() makes the current stream wait on the collective's stream; it does not
  // block the host, which is what lets prefetched gathers overlap compute.
  void wait() override { work_->wait(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

class NcclBackend : public C10dBackend<NcclBackend, c10d::ProcessGroupNCCL> {
 public:
  NcclBackend(const BackendInit& init, std::string prefix) : C10dBackend(init, std::move(prefix)) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(init.device_index));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = init.timeout;
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix_, init.store);
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, init.rank, init.size, opts);
  }

  std::string name() const override { return "nccl"; }

  std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) override {
    at::Tensor out = full;
    at::Tensor in = shard;
    return std::make_shared<NcclWork>(pg_->_allgather_base(out, in));
  }

  std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                           const at::Tensor& shard) override {
    at::Tensor out = shard;
    at::Tensor in = full;
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return std::make_shared<NcclWork>(pg_->_reduce_scatter_base(out, in, o));
  }

  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, ReduceKind kind) override {
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = kind == ReduceKind::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    return std::make_shared<NcclWork>(pg_->allreduce(ts, o));
  }

  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, int tag) override {
    std::vector<at::Tensor> ts{tensor};
    return std::make_shared<NcclWork>(pg_->send(ts, dst, tag));
  }

  std::shared_ptr<Work> recv(const at::Tensor& tensor, int src, int tag) override {
    std::vector<at::Tensor> ts{tensor};
    return std::make_shared<NcclWork>(pg_->recv(ts, src, tag));
  }

  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in) override {
    at::Tensor o = out;
    at::Tensor i = in;
    std::vector<int64_t> equal;  // empty: equal chunks
    return std::make_shared<NcclWork>(pg_->alltoall_base(o, i, equal, equal));
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg_->broadcast(ts, o)->wait();
  }
};

}  // namespace

bool nccl_available() { return true; }

std::shared_ptr<Backend> make_nccl_backend(const BackendInit& init) {
  return std::make_shared<NcclBackend>(init, "fsdp/nccl");
}

}  // namespace fsdp::detail
