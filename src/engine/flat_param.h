#pragma once
// One flat parameter: a unit's parameters (trainable or frozen ones) concatenated in
// registration order, padded to a multiple of the shard group size, and split so that
// each rank keeps one fp32 shard (docs/design.md, "The engine").

#include "accounting.h"
#include "comm/backend.h"
#include "comm/quantize.h"
#include "shard_file.h"
#include "transfers.h"

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

/// What impl::grad_accumulator() returns: a shared_ptr<Node> in earlier LibTorch 2.x, an
/// intrusive_ptr<Node> in later ones; taken from the declaration.
using GradAccumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// One original parameter inside the flat parameter.
struct ParamSlot {
  std::string fqn;                   ///< clean FQN of its first occurrence
  std::vector<std::string> aliases;  ///< further FQNs of the same tensor (tied in one unit)
  at::Tensor param;                  ///< the original parameter; keeps its identity
  int64_t offset = 0;                ///< elements from the start of the flat parameter
  int64_t numel = 0;                 ///< elements
  std::vector<int64_t> shape;        ///< original shape
};

/// What a flat parameter needs from its runtime.
struct FlatConfig {
  std::shared_ptr<Backend> shard_group;      ///< ranks the parameter is split over
  std::shared_ptr<Backend> replicate_group;  ///< ranks holding the same shard (hybrid, no-shard)
  /// Groups of k consecutive ranks inside the shard group that units reshard to after a
  /// training forward (ShardingOptions::reshard_after_forward_group_size); null: none.
  std::shared_ptr<Backend> reshard_group;
  /// ShardingOptions::quantized_communication (Note [Quantized training]): set when that
  /// direction travels quantized.
  std::optional<QuantizeSpec> quantize_weights, quantize_gradients;
  /// Hierarchical qgZ: the reshard group (inside) and the ranks with this rank's index in
  /// every reshard group (across); null: a flat quantized reduce-scatter.
  std::shared_ptr<Backend> hierarchy_inner, hierarchy_outer;
  int world_size = 1;                        ///< gradients are averaged over this many ranks
  at::Device device = at::kCPU;              ///< where the shard and gathered params live
  at::ScalarType param_dtype = at::kFloat;   ///< gathered (compute) dtype
  at::ScalarType reduce_dtype = at::kFloat;  ///< gradient reduction dtype
  at::ScalarType master_dtype = at::kFloat;  ///< the shards' and their gradients' dtype
  bool offload = false;                      ///< shards and their grads live on the host
  /// With offload: keep each shard's param_dtype copy on the device between gathers
  /// (offload_optimizer without offload_param; Note [Offload granularity]).
  bool keep_device_params = false;
  std::shared_ptr<Transfers> transfers;  ///< host <-> device copies (with offload)
  /// offload_param = nvme: the directory of this rank's parameter files (Note [NVMe
  /// parameters]); empty: the shards live in memory.
  std::string nvme_path;
  /// With nvme_path: the engine's queue for read-ahead (Note [NVMe parameters]); main
  /// thread only.
  std::shared_ptr<nvme::IoEngine> nvme_io;
  Accounting* acct = nullptr;
  std::string label;  ///< what its collectives are for ("unit 'blocks.0'")
};

class FlatParam {
 public:
  /// Gives `values` (one parameter's, fp32) rank 0's (sync_module_states); `label` names
  /// the flat parameter in errors and traces. Empty: each rank keeps its own.
  using SyncFromRank0 = std::function<void(at::Tensor& values, const std::string& label)>;
  /// Flattens `slots` (offsets assigned here) and keeps this rank's shard, each
  /// parameter's values first passed through `sync` when it is given.
  FlatParam(std::vector<ParamSlot> slots, bool trainable, const FlatConfig& cfg,
            const SyncFromRank0& sync = nullptr);
  ~FlatParam();
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  /// Names a flat parameter built before its unit's FQN was known (make_sharded): each
  /// slot's FQN and aliases get `prefix`, and its collectives `label`.
  void set_names(const std::string& prefix, const std::string& label);

  bool trainable() const { return trainable_; }
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_; }
  int64_t shard_numel() const { return shard_numel_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  /// For renaming (rename_parameters): the slots' FQNs and aliases may change, nothing else.
  std::vector<ParamSlot>& mutable_slots() { return slots_; }
  /// The shard (master_dtype, fp32 unless pure bf16): a leaf the optimizer steps on; its
  /// .grad() is the gradient shard.
  const at::Tensor& shard() const { return shard_; }
  /// The gathered buffer (param_dtype); its storage is empty while sharded.
  const at::Tensor& full() const { return full_; }
  at::ScalarType param_dtype() const { return cfg_.param_dtype; }
  int64_t full_bytes() const {
    return padded_ * static_cast<int64_t>(c10::elementSize(cfg_.param_dtype));
  }

  /// What an all-gather of this flat parameter sends (CommContext::all_gather issues it).
  struct GatherInput {
    bool done = false;        ///< nothing to gather (aliased: the buffer is the shard)
    at::Tensor input;         ///< this rank's part, in param_dtype on the device
    bool from_slice = false;  ///< the post-forward slice: gather over the reshard group
    /// An offload copy made for this gather (input is it); the collective waits for its
    /// transfer stream. A cast has none: it writes the full buffer (Note [Gather in place]).
    at::Tensor staging;
    /// keep_device_params: the device copy refreshed now (its transfer stream joins).
    at::Tensor copied;
    stats::MemoryCounter* counter =
        nullptr;  ///< where `held_bytes` of input are counted until done
    int64_t held_bytes = 0;
  };
  /// Restores the full buffer's storage and prepares the gather's input: the shard cast
  /// to param_dtype into this rank's part of the full buffer, copied to the device with offload,
  /// read from its file with NVMe parameters, or the optimizer's copy; or, with a post-forward
  /// slice (release with keep_slice), the slice, which the gather then drops. Storage and casting
  /// only: the collective is CommContext's.
  GatherInput gather_input();
  /// Frees the full buffer's storage; the parameter views stay, the bytes go. With
  /// `keep_slice` and a reshard group (Note [Post-forward slices]), first keeps this
  /// rank's 1/k slice of the full buffer for backward's gather; otherwise drops any slice.
  void release(bool keep_slice = false);
  /// Whether a post-forward slice is held.
  bool has_slice() const { return slice_.defined(); }
  /// Whether the full buffer holds parameters gathered before the shard last changed (an
  /// optimizer step, a checkpoint load): its version counter moved since gather_input().
  /// Persistent strategies (kZero2, kZero1) gather such a unit again (Note [Persistent
  /// parameters]). False while sharded, and when aliased (the buffer is the shard).
  bool stale() const {
    return !alias_ && full_allocated() && shard_._version() != gathered_version_;
  }
  /// Note [Writes the version counter misses]: stale(), or this rank's part of the full
  /// buffer is not what gathering the shard now would put there (a write through
  /// Tensor::data(), which has its own version counter, as torch::optim::SGD's step).
  /// Local: ranks must agree before acting on it.
  bool changed_since_gather() const;

  /// Group of one computing in the shards' dtype (Note [Group of one]): the full buffer is
  /// the shard itself.
  bool aliased() const { return alias_; }
  const FlatConfig& config() const { return cfg_; }
  /// What this flat's collectives are for, in the collective ring.
  std::string label() const {
    return trainable_ ? cfg_.label : cfg_.label + " (frozen parameters)";
  }

  /// Brings MemoryStats::grad_shards up to date with this shard's gradient, counted as
  /// its bytes (0 while undefined). Called wherever the engine gives the shard a
  /// gradient; Runtime::recount_grads() calls it for every flat parameter where an
  /// optimizer may have freed them (zero_grad with set_to_none). `grow` false: only a
  /// decrease is applied (so a recount releases everything before it adds anything).
  void count_grad(bool grow = true);

  /// Keeps the accumulators whose hooks take the gradients (AutogradMeta keeps weak refs only).
  std::vector<GradAccumulator>& grad_accumulators() { return grad_accs_; }

  /// The host tensor (param_dtype, shard-sized) an optimizer may fill with the updated
  /// shard in the same pass (FusedAdamW::set_copy_out), and the cell where it records
  /// the shard's version after writing. Gathers use the copy while that version still
  /// matches the shard's. Undefined unless param_dtype is 16-bit and the shard on the CPU.
  std::pair<at::Tensor, std::shared_ptr<std::atomic<int64_t>>> copy_out_target();
  /// Gathers that used the optimizer's copy instead of casting the shard.
  int64_t copy_out_gathers() const { return copy_out_gathers_; }

  /// Note [NVMe parameters]: the shard, its gradient and its param_dtype copy are views of
  /// a file of this flat parameter (ShardFile).
  bool in_file() const { return file_ != nullptr; }
  /// With in_file() and while sharded: queues the read of the next gather's input (the
  /// copy, or the master when the copy is stale), which gather_input() then waits for instead
  /// of reading. No-op otherwise, or when one is queued.
  void read_ahead();
  /// With in_file(): sets (no gradient yet) or adds `grad` (the reduced gradient shard in
  /// master_dtype, on the device) to the gradient in the file, through an aligned host
  /// buffer, as CommContext would in memory; the shard's .grad() is the file's view.
  /// The write is queued, not waited for: settle_grad_write() waits (CommContext keeps at
  /// most kGradWritesInFlight queued and settles them all at the end of backward).
  void store_grad(const at::Tensor& grad);
  /// Waits for store_grad()'s write, if one is queued, and frees its buffer.
  void settle_grad_write();
  /// Calls `fn` with the gradient shard (defined): in memory itself; in the file read into
  /// a host buffer, written back after `fn` when `write`.
  void visit_grad(bool write, const std::function<void(at::Tensor&)>& fn);

 private:
  /// Frees the post-forward slice, if any.
  void drop_slice();
  /// Whether the full buffer currently has its storage (always, when aliased).
  bool full_allocated() const { return alias_ || full_.storage().nbytes() != 0; }

  std::vector<ParamSlot> slots_;
  bool trainable_;
  FlatConfig cfg_;
  int64_t numel_ = 0;        ///< elements before padding
  int64_t padded_ = 0;       ///< elements after padding to a multiple of the group size
  int64_t shard_numel_ = 0;  ///< padded_ / group size
  at::Tensor shard_;         ///< fp32 leaf, shard_numel_ elements
  at::Tensor full_;          ///< param_dtype, padded_ elements; storage freed when sharded
  bool alias_ = false;       ///< group of one in fp32: full_ is the shard's own storage
  at::Tensor slice_;         ///< post-forward slice: padded_/k elements of full_, param_dtype
  at::Tensor lowp_;          ///< optimizer-written param_dtype copy of the shard (copy_out_target)
  std::shared_ptr<std::atomic<int64_t>> lowp_version_;  ///< shard version lowp_ was written at
  int64_t copy_out_gathers_ = 0;
  int64_t gathered_version_ = -1;
  at::Tensor device_params_;  ///< keep_device_params: the shard in param_dtype on the device
  int64_t device_params_version_ =
      -1;  ///< the shard's version device_params_ was copied at  ///< the shard's version when the
           ///< full buffer was last gathered
  int64_t counted_grad_bytes_ = 0;  ///< this shard's gradient as MemoryStats::grad_shards counts it
  std::unique_ptr<ShardFile> file_;  ///< Note [NVMe parameters]; null: in memory
  std::vector<GradAccumulator> grad_accs_;
};

}  // namespace fsdp::detail
