#pragma once
// One rank's part of a sharded checkpoint, taken from the live model in one pass
// (Note [Rank snapshot]) and written as its rank file (layout in layout.h); for an
// asynchronous save, staged into host memory that the model keeps for the next one
// (Note [Staging reuse]).

#include "../format/layout.h"

#include <fsdp/checkpoint.h>

#include "internal/checkpoint_view.h"

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::ckpt {

/// Tensors that cover parts of a range, each with its first element.
using Parts = std::vector<std::pair<int64_t, at::Tensor>>;

/// Everything one rank's file holds (Note [Rank snapshot]).
struct RankSnapshot {
  struct Flat {
    FlatParamInfo info;
    int64_t begin = 0, length = 0;
    std::vector<TableEntry> table;
    at::Tensor param;  ///< [length] fp32
    bool has_optim = false;
    int64_t optim_step = 0, optim_group = 0;
    /// Each state of [length] fp32 as parts at their first elements (zeros between): the
    /// optimizer's own tensors in a synchronous save (not put together: Note [Rank
    /// snapshot]), one staged host copy in an asynchronous one.
    std::vector<std::pair<std::string, Parts>> optim;
  };
  int rank = 0, world = 1;
  int64_t shard_group_size = 1;
  /// A pipelined model (Note [Pipelined checkpoints]): its stages and this rank's; rank
  /// and world are then the job's.
  int stages = 1, stage = 0;
  bool has_buffers = false;  ///< this file holds the buffers (its part's first rank)
  std::string optimizer_kind = "none";
  std::vector<Flat> flats;
  std::vector<std::map<std::string, ckpt::AttrValue>> groups;  ///< optimizer hyperparameters
  ckpt::TrainingState state;
  std::vector<std::pair<std::string, at::Tensor>> rng;      ///< "cpu", "cuda_<i>"
  std::vector<std::pair<std::string, at::Tensor>> buffers;  ///< has_buffers only
  int64_t staged_bytes = 0;                                 ///< host copies held (async)
  /// The staging buffers above by what they hold, for the next save (Note [Staging reuse]).
  std::map<std::string, at::Tensor> staged;
  /// A copy into staging memory left for the background thread (Note [Background
  /// staging]): `src`'s version when the save was called, and what it is.
  struct PendingCopy {
    at::Tensor dst, src;
    int64_t version = 0;
    std::string what;
  };
  std::vector<PendingCopy> pending;
};

/// Bytes the buffers hold.
int64_t staged_bytes(const std::map<std::string, at::Tensor>& buffers);

/// Makes the host copies of an asynchronous save (Note [Staging reuse]).
class Stager {
 public:
  /// `spare`: the model's kept buffers, already counted in checkpoint_staging; every
  /// byte allocated or freed from here on is counted as it happens.
  /// `defer`: leave the copies of host tensors that stage() and stage_parts() are
  /// allowed to defer in RankSnapshot::pending (Note [Background staging]).
  Stager(const ShardedModel& model, std::map<std::string, at::Tensor> spare, bool defer = false)
      : model_(model), spare_(std::move(spare)), defer_(defer) {}
  ~Stager() { free_spare(); }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;
  /// A host copy of `t` (pinned when `t` is on a GPU), made into the last save's buffer
  /// for `what` when it fits. `may_defer`: `t` changes only in an optimizer step, so
  /// the copy may be left to the background thread (`who` says whose it is, for errors).
  at::Tensor stage(const std::string& what, const at::Tensor& t, RankSnapshot& snap,
                   bool may_defer = false, const std::string& who = "");
  /// A host copy of `parts` put together into a [length] tensor of `options` (zeros where
  /// no part covers it), made like stage().
  at::Tensor stage_parts(const std::string& what, const Parts& parts, int64_t length,
                         const at::TensorOptions& options, RankSnapshot& snap,
                         bool may_defer = false, const std::string& who = "");
  /// Frees the kept buffers this save did not use.
  void free_spare();
  /// The snapshot was dropped (a failure while staging): its buffers are gone.
  void forget_used();

 private:
  /// The last save's buffer for `key` when it has this shape and dtype, else a new one.
  at::Tensor buffer(const std::string& key, at::IntArrayRef sizes, const at::TensorOptions& options,
                    bool pinned);
  /// Copies `src` into `dst` now, or leaves it in `snap.pending` (defer_, host tensors),
  /// named by `who` and `what` for the version check's error.
  void copy_or_defer(const at::Tensor& dst, const at::Tensor& src, bool may_defer,
                     const std::string& what, const std::string& who, RankSnapshot& snap);
  const ShardedModel& model_;
  std::map<std::string, at::Tensor> spare_;
  bool defer_ = false;
  int64_t used_bytes_ = 0;
};

/// Makes the copies left in `snap.pending` and drops them. Returns "" when every source
/// still had the version it had at the call, else what changed (Note [Background staging]).
std::string finish_staging(RankSnapshot& snap);

/// This rank's snapshot of the model, `opt`'s state (may be null) and `state`. `stager`
/// null: views of the live tensors (a synchronous save); else host copies.
RankSnapshot take_snapshot(const ShardedModel& root, torch::optim::Optimizer* opt,
                           const ckpt::TrainingState& state, int rank, int world, Stager* stager);

/// Writes `snap` as the rank file `path` and fsyncs it.
void write_snapshot(const std::string& path, const RankSnapshot& snap);

}  // namespace fsdp::ckpt
