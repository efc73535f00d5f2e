#pragma once
// Note [Backend adaptor]
// The one place that knows c10d. Each backend below holds its concrete c10d class
// (c10d::ProcessGroupGloo, c10d::ProcessGroupNCCL, both c10d::Backend in LibTorch 2.x)
// and exposes the few collectives the engine needs, in the forms every supported
// LibTorch (2.6 and newer) has (docs/design.md, "LibTorch facts"). Gloo and NCCL live in
// their own files; CMake swaps in a stand-in that throws when one is not built.

#include <fsdp/core/options.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

/// A backend's name (auto, gloo or nccl) as the options core checks it, its error a
/// c10::Error naming `option` (src/comm/device.cpp).
void check_backend_name(const std::string& name, const std::string& option, core::Surface s);
class Backend;

/// What a ProcessGroup handle holds (declared opaque in fsdp/process_group.h).
class BackendCore {
 public:
  virtual ~BackendCore() = default;
};

/// The library's way into ProcessGroup's private member (a friend of it).
struct GroupAccess {
  static std::shared_ptr<Backend> backend(const ProcessGroup& pg);
  static ProcessGroup make_group(std::shared_ptr<Backend> backend);
};

/// An issued collective. wait() blocks until its result is in place.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  /// Calls `f` (on any thread) once the collective has completed, where the backend can
  /// tell without a wait (Gloo's work futures); elsewhere never. For the trace's
  /// communication spans (Note [Per-unit trace]).
  virtual void on_completion(std::function<void()> f) { (void)f; }
  /// A collective in stages (the hierarchical quantized reduce-scatter): waits for the
  /// first stage and issues the next, so that it runs while the caller computes; wait()
  /// then finishes it. Elsewhere nothing.
  virtual void progress() {}
};

/// A finished collective.
class DoneWork : public Work {
 public:
  void wait() override {}
};

/// Runs `then` once, after `work` completes (e.g. to free a staging buffer).
class ThenWork : public Work {
 public:
  ThenWork(std::shared_ptr<Work> work, std::function<void()> then)
      : work_(std::move(work)), then_(std::move(then)) {}
  void wait() override {
    work_->wait();
    if (then_) {
      auto f = std::move(then_);
      then_ = {};
      f();
    }
  }
  void on_completion(std::function<void()> f) override { work_->on_completion(std::move(f)); }

 private:
  std::shared_ptr<Work> work_;
  std::function<void()> then_;
};

enum class ReduceKind { kSum, kMax };

/// The collectives whose bytes on the wire a backend can tell (Backend::wire_bytes).
enum class WireOp { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll };

class Backend : public BackendCore {
 public:
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  /// How long a collective waits for the other ranks before it fails.
  virtual double timeout_s() const { return 300.0; }
  /// What a failed collective can say about this group's peers: called after the failure,
  /// it returns the peers that do not answer (Note [Peer probe]); empty function when the
  /// backend cannot tell.
  virtual std::function<std::string()> peer_report() const { return {}; }
  /// full (size()*shard.numel()) <- every rank's shard, in rank order. Asynchronous.
  virtual std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) = 0;
  /// shard <- this rank's chunk of the sum of `full` over ranks. `full` may be clobbered.
  virtual std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                                   const at::Tensor& shard) = 0;
  virtual std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, ReduceKind kind) = 0;
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;
  /// out <- chunk i of `in` from every rank i, in rank order: `in` and `out` hold size()
  /// equal chunks (1-D, the same dtype); chunk j of `in` goes to rank j. Asynchronous.
  virtual std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual void barrier() = 0;
  /// Note [Wire bytes]: the bytes this rank sends to the other ranks for one `op` over a
  /// buffer of `bytes` bytes of `dtype` (an all-gather's output, a reduce-scatter's input,
  /// an all-reduce's or a broadcast's tensor, an all-to-all's input), by the algorithm
  /// this backend runs. `root`: a broadcast's. 0 for a group of one.
  virtual int64_t wire_bytes(WireOp op, int64_t bytes, at::ScalarType dtype, int root) const;
  /// The subgroup this rank belongs to, from disjoint rank lists covering the world.
  virtual std::shared_ptr<Backend> split(const std::vector<std::vector<int>>& groups) = 0;
  /// Point to point (the pipeline's stages, Note [Pipeline schedules]): sends the
  /// contiguous `tensor` to rank `dst` of this group, where a recv with the same tag takes
  /// it. Asynchronous: `tensor` stays untouched until wait(). Tags from 2^30 up are the
  /// pipeline's (Gloo's reduce-scatter numbers its own below). Not recorded in the
  /// collective ring: the ranks' sequences of point-to-point calls differ by design.
  virtual std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, int tag);
  /// Receives into the contiguous `tensor` (the sender's sizes and dtype) from rank `src`.
  virtual std::shared_ptr<Work> recv(const at::Tensor& tensor, int src, int tag);
};

/// Rank 0 of 1: collectives are local copies.
std::shared_ptr<Backend> make_single_backend();

/// What a c10d backend needs to start: a connected store and this rank's place.
struct BackendInit {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{300000};
  std::string master_addr;  ///< used to pick the Gloo interface (loopback or not)
  int device_index = 0;     ///< CUDA device for NCCL
  /// The job rank of each member, in group order (errors name job ranks); empty means
  /// 0..size-1 (the world).
  std::vector<int> global_ranks;
};

/// The job rank of `init`'s member `r`.
inline int global_rank_of(const BackendInit& init, int r) {
  return init.global_ranks.empty() ? r : init.global_ranks[static_cast<size_t>(r)];
}

std::shared_ptr<Backend> make_gloo_backend(const BackendInit& init);
std::shared_ptr<Backend> make_nccl_backend(const BackendInit& init);
bool nccl_available();

/// Validates `groups` (disjoint, covering 0..world-1) and returns the list holding `rank`.
/// Throws with the offending value otherwise.
std::vector<int> find_group(const std::vector<std::vector<int>>& groups, int world, int rank);

/// The BackendInit of the subgroup `parent` belongs to, and a store prefix that keeps
/// this split's keys apart (`count` numbers the parent's splits).
BackendInit split_init(const BackendInit& parent, const std::vector<std::vector<int>>& groups,
                       const std::string& prefix, int count, std::string& sub_prefix);

/// What the Gloo and NCCL backends share (`Derived` is the backend, `Group` its c10d
/// process group): where this rank stands, the store prefix its splits extend, the group,
/// and the calls that are the same for both. `Derived(init, prefix)` builds a subgroup.
template <class Derived, class Group>
class C10dBackend : public Backend {
 public:
  C10dBackend(const BackendInit& init, std::string prefix)
      : init_(init), prefix_(std::move(prefix)) {}

  int rank() const override { return init_.rank; }
  int size() const override { return init_.size; }
  double timeout_s() const override { return std::chrono::duration<double>(init_.timeout).count(); }
  void barrier() override { pg_->barrier()->wait(); }
  std::shared_ptr<Backend> split(const std::vector<std::vector<int>>& groups) override {
    std::string tag;
    BackendInit sub = split_init(init_, groups, prefix_, split_count_++, tag);
    if (sub.size == 1) return make_single_backend();
    return std::make_shared<Derived>(sub, tag);
  }

 protected:
  BackendInit init_;
  std::string prefix_;
  int split_count_ = 0;  ///< splits made so far; keeps store keys of each split apart
  c10::intrusive_ptr<Group> pg_;
};

}  // namespace detail
}  // namespace fsdp
