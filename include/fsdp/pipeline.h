#pragma once
// Pipeline parallelism: a model's layers split into stages over ranks, micro-batches run
// through them by a schedule (GPipe or 1F1B), and sharding inside each stage (as
// DeepSpeed's PipelineModule with ZeRO, or torch.distributed.pipelining with FSDP2).
// Implemented in src/pipeline.

#include <fsdp/fully_sharded_module.h>
#include <fsdp/options.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

/// The order in which a stage runs its micro-batches' forwards and backwards.
enum class PipelineSchedule {
  /// GPipe: every micro-batch's forward, then every backward. Holds all micro-batches'
  /// activations at once.
  kGPipe,
  /// 1F1B (PipeDream-flush, DeepSpeed's TrainSchedule): stage s runs stages - s - 1
  /// forwards, then alternates one forward and one backward, then drains. Holds at most
  /// stages - s micro-batches' activations.
  k1F1B,
};

/// "gpipe" or "1f1b"; an error naming `what` and the choices otherwise.
PipelineSchedule parse_pipeline_schedule(const std::string& name,
                                         const std::string& what = "schedule");

struct PipelineOptions {
  /// Pipeline stages. The world size must be a multiple: world = stages × data-parallel
  /// size, and rank r is in stage r / dp at data-parallel index r % dp (DeepSpeed's
  /// pipe-then-data topology).
  int stages = 2;
  /// Micro-batches a step's batch is split into (dim 0): DeepSpeed's
  /// gradient_accumulation_steps under its pipe engine.
  int micro_batches = 4;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  /// How the layers are split: "parameters" (each stage about the same parameter count,
  /// DeepSpeed's default), "uniform" (about the same number of layers), or explicit
  /// boundaries: a comma-separated list of the first layer of stages 1 .. stages-1
  /// (e.g. "3,6,9" for four stages of a 12-layer model).
  std::string partition = "parameters";
  /// The sharding inside each stage. Its process_group is the world the pipeline spans
  /// (default: a single process); each stage shards over its own data-parallel ranks.
  ShardingOptions sharding;
  /// The name each stage parameter has in the whole model, from its name among the
  /// layers (the layer's key first: "3.weight", "block3.attn.qkv.weight"): checkpoints,
  /// state dicts and exports of the stage use it, so that a pipelined checkpoint loads
  /// into the model unpipelined and the reverse. Empty: the layers' names as they are (a
  /// torch::nn::Sequential pipelined keeps its own names).
  std::function<std::string(const std::string&)> parameter_names;
  /// true: a step reduces each stage's gradients once, in the last micro-batch's backward;
  /// the backwards before it accumulate unsharded gradients and keep their units gathered
  /// (set_requires_gradient_sync / set_reshard_after_backward false, as PyTorch's pipeline
  /// schedules do with FSDP2). Fewer collectives, for the memory of the stage's full
  /// parameters and gradients during the step. false: every micro-batch's backward
  /// gathers anew and reduces into the shards.
  bool reduce_once = true;
};

/// Computes a micro-batch's loss from the last stage's output and its targets.
using PipelineLossFn =
    std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

struct PipelineLayers;  // below

/// This rank's stage of a pipelined model: its layers, sharded over its data-parallel
/// ranks, and the schedule that moves micro-batches between stages.
class PipelinedModel {
 public:
  PipelinedModel() = default;

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  /// This rank's place among the ranks of its stage, and their number: the index of the
  /// batch this rank feeds (each data-parallel replica trains on its own rows).
  int data_parallel_rank() const { return dp_rank_; }
  int data_parallel_size() const { return dp_size_; }
  /// The layers this stage holds: [first, last) of the model's.
  std::pair<int64_t, int64_t> layer_range() const { return {first_, last_}; }
  /// Every stage's first layer, and the number of layers after the last: stages + 1 values.
  const std::vector<int64_t>& boundaries() const { return bounds_; }

  /// One step's forwards and backwards: `input` and `target` (this data-parallel
  /// replica's batch, the same on every stage of it) are split along dim 0 into
  /// micro_batches parts; the first stage reads `input`, the last `target`. Gradients
  /// accumulate into this stage's shards as the mean loss over the micro-batches asks
  /// (each micro-batch's loss divided by micro_batches). Returns that mean loss, averaged
  /// over the data-parallel replicas, on every rank.
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           const PipelineLossFn& loss_fn);
  /// Forward only (no graph), micro-batch by micro-batch: the last stage's output for
  /// `input`, concatenated; an undefined tensor on the other stages. `micro_batches`: how
  /// many parts `input` is split into (dim 0, a divisor of its rows), the same on every
  /// rank; 0 takes PipelineOptions::micro_batches.
  torch::Tensor forward(const torch::Tensor& input, int micro_batches = 0);

  /// This stage's trainable shards: give them to the optimizer on this rank.
  std::vector<torch::Tensor> sharded_parameters() const { return model_.sharded_parameters(); }
  /// This stage's sharded module (checkpoints, clipping, statistics).
  ShardedModel& stage_model() { return model_; }
  const ShardedModel& stage_model() const { return model_; }
  /// The world the pipeline spans, and this stage's data-parallel group.
  const ProcessGroup& world() const { return world_; }
  const ProcessGroup& stage_group() const { return stage_group_; }
  /// Most micro-batches whose activations this stage held at once in the last step.
  int peak_micro_batches_in_flight() const { return peak_in_flight_; }

 private:
  friend PipelinedModel pipeline(const torch::nn::Sequential&, const PipelineOptions&);
  friend PipelinedModel pipeline(const PipelineLayers&, const PipelineOptions&);
  /// Everything of pipeline() but the stage's layers: the groups and the boundaries.
  static PipelinedModel place(const std::vector<int64_t>& layer_params,
                              const PipelineOptions& options);
  /// The stage's layers, sharded; then the names, and the trace's mark.
  void adopt(Sharded<torch::nn::Sequential> seq);
  struct Step;  // one step's schedule (src/pipeline/pipeline.cpp)

  std::shared_ptr<Sharded<torch::nn::Sequential>> seq_;  ///< this stage's layers, sharded
  ShardedModel model_;                                   ///< the same model, as a handle
  ProcessGroup world_, stage_group_;
  PipelineOptions options_;
  int stage_ = 0, stages_ = 1, dp_rank_ = 0, dp_size_ = 1;
  int64_t first_ = 0, last_ = 0;
  std::vector<int64_t> bounds_;
  int peak_in_flight_ = 0;
};

/// clip_grad_norm_ over the whole pipelined model: the norm of every stage's gradients
/// together (each stage's over its shard group, then over the stages), and every shard
/// scaled by min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping, the same on
/// every rank. norm_type 2 or infinity. Collective over the world.
double clip_grad_norm_(PipelinedModel& model, double max_norm, double norm_type = 2.0);

/// The boundaries options.partition asks for: stages + 1 values, from 0 to the number of
/// layers, each stage at least one layer. `params` holds each layer's parameter count.
/// Errors name the value and the fix (fewer stages than layers, boundaries out of order).
std::vector<int64_t> partition_layers(const std::vector<int64_t>& params,
                                      const PipelineOptions& options);

/// A model's layers made one at a time, so that each rank builds only its own stage's
/// (fsdp::pipeline(PipelineLayers, ...)).
struct PipelineLayers {
  /// How many layers the model has.
  int64_t count = 0;
  /// Makes layer i (0-based): its name among the layers ("embed", "block3", ...) and the
  /// module (one Tensor in, one Tensor out). Its random initialisation must draw from the
  /// default CPU generator as building the whole model draws for that layer, after the
  /// layers before it: then every layout of stages gets the whole model's weights.
  std::function<std::pair<std::string, torch::nn::AnyModule>(int64_t i)> make;
  /// Each layer's trainable parameter count, for the "parameters" partition without
  /// building every layer twice; empty: counted by building each layer once and dropping
  /// it (one layer at a time).
  std::vector<int64_t> params;
};

/// Splits `layers` (every entry a module of one Tensor input and one Tensor output) into
/// options.stages stages and keeps this rank's, sharded over its stage's ranks with
/// options.sharding (shard_sequential: each layer behind a wrap point, units as the
/// auto-wrap policy picks). Every rank of the world calls it with the same layers and
/// options. The layers of other stages are dropped on this rank.
PipelinedModel pipeline(const torch::nn::Sequential& layers, const PipelineOptions& options);

/// The same from a layer factory, building only this rank's stage: every rank makes the
/// layers before its stage's and drops each at once (their draws from the CPU generator
/// keep the weights those of the whole model), then makes its own layers under sharded
/// construction (each sharded as soon as it is built, as fsdp::make_sharded does), and
/// leaves the generator where building every layer would. A rank holds its stage's shards
/// and the one layer being built, never the model or its stage in full. With the
/// "parameters" partition and no layers.params, a first pass makes each layer once to
/// count its parameters (one at a time; the generator's state is restored after it).
PipelinedModel pipeline(const PipelineLayers& layers, const PipelineOptions& options);

}  // namespace fsdp
