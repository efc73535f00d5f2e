#pragma once
// Note [Communication context]
// Everything a sharded model has in flight between issuing a collective (or a copy to or
// from the host) and using its result belongs to the runtime's one CommContext. Units
// and flat parameters issue work and hand it over; they keep no pending work of their
// own. What it holds, and why each exists:
//  - gathers: each unit's all-gathers, from start_gather() (a prefetch, Note [Prefetch
//    bound]) until the unit is used or resharded. Waiting late is what lets a prefetch
//    overlap the computation of the unit before.
//  - reductions: the gradient reduce-scatter in flight (Note [Overlapped reduction]),
//    with its input and output buffers. It finishes when the next flat parameter's
//    reduction has been issued, so it overlaps backward's next unit. Two are listed for
//    a moment while the next one is issued and the one before it finishes; three under
//    hierarchical qgZ, whose second stage is issued when the next reduction is and
//    finishes when the one after is (the first stage's flat gradient freed at once).
//  - landing: with cpu_offload, reduced gradient shards on their way to the host (Note
//    [Offload transfers]). At most one flat parameter's copies wait to be added.
//  - transfers: with cpu_offload, the host <-> device copy streams (CUDA) or immediate
//    copies (CPU).
// In CUDA builds the streams and events live in Transfers (transfers_cuda.cpp) and in c10d's
// NCCL work objects; the context holds those objects.

#include "accounting.h"
#include "comm/backend.h"
#include "flat_param.h"
#include "transfers.h"

#include <deque>
#include <memory>
#include <utility>
#include <vector>

namespace fsdp::detail {

class Unit;

// Note [Collectives in one place]: the engine's collectives besides a step's gathers and
// reductions, here too, each counted where the accounting counts collectives.
/// sync_module_states: `v` (fp32, one parameter's values) from rank 0 of `group`.
void broadcast_from_rank0(Backend& group, at::Tensor& v, Accounting& acct,
                          const std::string& label);
/// `shard_like` (shard_numel fp32 elements laid out like `flat`'s shard: the shard, or
/// state laid out like it) all-gathered over the shard group into a new fp32 tensor of
/// padded_numel elements on the compute device (exports and full parameters).
at::Tensor gather_like(const FlatParam& flat, const at::Tensor& shard_like);
/// `tensor` summed (or its maximum taken) over `group` in place, counted in `acct` when
/// given.
void all_reduce(Backend& group, const at::Tensor& tensor, ReduceKind kind, Accounting* acct,
                const std::string& label);
/// Every rank of `group` reaches here before any goes on.
void barrier(Backend& group);

class CommContext {
 public:
  /// `transfers` is null without cpu_offload.
  CommContext(Accounting* acct, std::shared_ptr<Transfers> transfers);
  /// Waits for gathers still in flight (their buffers go with the flat parameters);
  /// failures are ignored there (a dead peer leaves nothing to wait for).
  ~CommContext();
  CommContext(const CommContext&) = delete;
  CommContext& operator=(const CommContext&) = delete;

  // Gathers.
  /// Holds `unit`'s newly issued all-gathers until wait_gathers().
  void add_gathers(const Unit& unit, std::vector<std::shared_ptr<Work>> works);
  /// Waits for `unit`'s gathers in flight, if any.
  void wait_gathers(const Unit& unit);

  /// Issues the all-gather of `flat`'s full parameters (its input from
  /// FlatParam::gather_input) into its full buffer; the work holds the input until it
  /// completes (Note [Collectives in one place]).
  std::shared_ptr<Work> all_gather(FlatParam& flat);

  // Reductions.
  /// Issues the reduce-scatter (sum) of `grad` (GradBuffer::take_for_reduction(), may be
  /// undefined: nothing to reduce) into `flat`'s gradient shard, then finishes the
  /// reduction issued before it by another flat parameter, and lands offloaded copies
  /// that waited (Note [Overlapped reduction], Note [Offload transfers]).
  void reduce(FlatParam& flat, at::Tensor grad);
  /// At the end of backward: finishes every reduction and, with offload, lands every
  /// gradient copy, so an optimizer step can read the gradient shards.
  /// With NVMe parameters it waits for every gradient's write too.
  void finish_backward();

  /// False inside a NoSyncScope (ShardedModel::set_requires_gradient_sync): units keep
  /// their unsharded gradients instead of handing them to reduce().
  bool gradient_sync() const { return gradient_sync_; }
  void set_gradient_sync(bool on) { gradient_sync_ = on; }

  // Transfers.
  /// With offload: blocks until no copy from or to the host shards is in flight.
  void wait_transfers();

 private:
  struct Reduction {
    FlatParam* flat;
    at::Tensor in;   ///< the flat gradient (reduce_dtype, padded), alive until finished
    at::Tensor out;  ///< its reduced shard
    std::shared_ptr<Work> work;
    /// A two-stage reduction (hierarchical qgZ): whether its second stage has been issued
    /// (Note [Overlapped reduction]).
    bool two_stage = false, advanced = false;
  };
  /// A flat parameter's reduced gradient shards on their way to the host.
  struct Landing {
    FlatParam* flat;
    std::function<void()> first;              ///< the copy that became the gradient shard
    std::vector<Transfers::HostCopy> to_add;  ///< copies to add into it once landed
  };
  /// Issues `r`'s reduce-scatter over its flat parameter's shard group (sets out, work).
  void issue_reduction(Reduction& r);
  /// Waits for the oldest reduction and adds its result into the gradient shard.
  void finish_oldest();
  Landing& landing_of(FlatParam& flat);
  /// With offload: once `flat` has copies waiting, lands those another flat left.
  void park(FlatParam& flat);
  void land(Landing& l);

  /// Note [NVMe parameters]: gradient writes left in flight at once (each holds a host
  /// buffer of its shard's size), so that the writes overlap the next units' backward.
  static constexpr size_t kGradWritesInFlight = 2;

  Accounting* acct_;
  std::shared_ptr<Transfers> transfers_;
  std::deque<FlatParam*> grad_writes_;  ///< flats whose gradient write is queued, oldest first
  std::vector<std::pair<const Unit*, std::shared_ptr<Work>>> gathers_;
  std::vector<Reduction> reductions_;  ///< oldest first
  std::vector<Landing> landing_;       ///< flats with copies in flight, first use first
  FlatParam* parked_ = nullptr;        ///< the flat whose copies wait to be added
  bool gradient_sync_ = true;
};

}  // namespace fsdp::detail
