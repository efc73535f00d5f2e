// ProcessGroup: the public handle over a Backend, and the single-process backend.
#include <fsdp/process_group.h>

#include "backend.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace fsdp {
namespace detail {
namespace {

class SingleBackend : public Backend {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single"; }
  std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) override {
    at::NoGradGuard g;
    // The input may be the output itself (Note [Gather in place]).
    if (full.data_ptr() != shard.data_ptr()) full.copy_(shard);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                           const at::Tensor& shard) override {
    at::NoGradGuard g;
    if (!full.is_same(shard)) shard.copy_(full);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> all_reduce(const at::Tensor&, ReduceKind) override {
    return std::make_shared<DoneWork>();
  }
  void broadcast(const at::Tensor&, int root) override {
    TORCH_CHECK(root == 0, "broadcast root=", root, " is invalid for a group of size 1");
  }
  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in) override {
    at::NoGradGuard g;
    if (!out.is_same(in)) out.copy_(in);
    return std::make_shared<DoneWork>();
  }
  void barrier() override {}
  std::shared_ptr<Backend> split(const std::vector<std::vector<int>>& groups) override {
    find_group(groups, 1, 0);
    return make_single_backend();
  }
};

}  // namespace

std::shared_ptr<Backend> make_single_backend() { return std::make_shared<SingleBackend>(); }

std::vector<int> find_group(const std::vector<std::vector<int>>& groups, int world, int rank) {
  std::set<int> seen;
  std::vector<int> mine;
  for (const auto& g : groups) {
    TORCH_CHECK(!g.empty(),
                "ProcessGroup::split: an empty rank list was given; every group needs ranks");
    for (int r : g) {
      TORCH_CHECK(r >= 0 && r < world, "ProcessGroup::split: rank ", r,
                  " is outside the world of size ", world, "; ranks run from 0 to ", world - 1);
      TORCH_CHECK(seen.insert(r).second, "ProcessGroup::split: rank ", r,
                  " is listed in two groups; the groups must be disjoint");
    }
    if (std::find(g.begin(), g.end(), rank) != g.end()) mine = g;
  }
  TORCH_CHECK(static_cast<int>(seen.size()) == world, "ProcessGroup::split: the groups cover ",
              seen.size(), " of ", world, " ranks; every rank must be in exactly one group");
  return mine;
}

BackendInit split_init(const BackendInit& parent, const std::vector<std::vector<int>>& groups,
                       const std::string& prefix, int count, std::string& sub_prefix) {
  auto mine = find_group(groups, parent.size, parent.rank);
  BackendInit sub = parent;
  sub.size = static_cast<int>(mine.size());
  sub.rank = static_cast<int>(std::find(mine.begin(), mine.end(), parent.rank) - mine.begin());
  sub_prefix = prefix + "/split" + std::to_string(count) + "/";
  for (int r : mine) sub_prefix += std::to_string(r) + ",";
  sub.global_ranks.clear();
  for (int r : mine) sub.global_ranks.push_back(global_rank_of(parent, r));
  return sub;
}

}  // namespace detail

ProcessGroup::ProcessGroup() : impl_(detail::make_single_backend()) {}

namespace detail {
std::shared_ptr<Work> Backend::send(const at::Tensor&, int dst, int) {
  TORCH_CHECK(false, "send to rank ", dst,
              ": point-to-point messages need a group of two or more "
              "ranks over gloo or nccl; this group is ",
              name(), " with ", size(), " rank(s)");
}
std::shared_ptr<Work> Backend::recv(const at::Tensor&, int src, int) {
  TORCH_CHECK(false, "recv from rank ", src,
              ": point-to-point messages need a group of two or "
              "more ranks over gloo or nccl; this group is ",
              name(), " with ", size(), " rank(s)");
}
}  // namespace detail

std::shared_ptr<detail::Backend> detail::GroupAccess::backend(const ProcessGroup& pg) {
  return std::static_pointer_cast<detail::Backend>(pg.impl_);
}

ProcessGroup detail::GroupAccess::make_group(std::shared_ptr<detail::Backend> backend) {
  TORCH_CHECK(backend != nullptr, "ProcessGroup needs a backend; use fsdp::init_process_group()");
  ProcessGroup pg;
  pg.impl_ = std::move(backend);
  return pg;
}

namespace {
detail::Backend& impl(const ProcessGroup& pg) { return *detail::GroupAccess::backend(pg); }
}  // namespace

int ProcessGroup::rank() const { return impl(*this).rank(); }
int ProcessGroup::size() const { return impl(*this).size(); }
std::string ProcessGroup::backend_name() const { return impl(*this).name(); }
double ProcessGroup::timeout_s() const { return impl(*this).timeout_s(); }

void ProcessGroup::all_gather(const torch::Tensor& full, const torch::Tensor& shard) const {
  TORCH_CHECK(full.is_contiguous() && shard.is_contiguous(), "all_gather needs contiguous tensors");
  TORCH_CHECK(full.scalar_type() == shard.scalar_type(), "all_gather: full is ", full.scalar_type(),
              " but shard is ", shard.scalar_type(), "; they must match");
  TORCH_CHECK(full.numel() == shard.numel() * size(), "all_gather: full has ", full.numel(),
              " elements but needs ", shard.numel() * size(), " (shard ", shard.numel(), " x ",
              size(), " ranks)");
  impl(*this).all_gather(full, shard)->wait();
}

void ProcessGroup::reduce_scatter_sum(const torch::Tensor& full, const torch::Tensor& shard) const {
  TORCH_CHECK(full.is_contiguous() && shard.is_contiguous(),
              "reduce_scatter_sum needs contiguous tensors");
  TORCH_CHECK(full.numel() == shard.numel() * size(), "reduce_scatter_sum: full has ", full.numel(),
              " elements but needs ", shard.numel() * size());
  impl(*this).reduce_scatter_sum(full, shard)->wait();
}

void ProcessGroup::all_reduce_sum(const torch::Tensor& t) const {
  impl(*this).all_reduce(t, detail::ReduceKind::kSum)->wait();
}
void ProcessGroup::all_reduce_max(const torch::Tensor& t) const {
  impl(*this).all_reduce(t, detail::ReduceKind::kMax)->wait();
}
void ProcessGroup::broadcast(const torch::Tensor& t, int root) const {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast: invalid root=", root, " for a group of size ",
              size());
  impl(*this).broadcast(t, root);
}
void ProcessGroup::barrier() const { impl(*this).barrier(); }

ProcessGroup ProcessGroup::split(const std::vector<std::vector<int>>& groups) const {
  return detail::GroupAccess::make_group(impl(*this).split(groups));
}

}  // namespace fsdp
