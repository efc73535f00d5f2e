// Pipeline stages in the memory estimator (include/fsdp/tools/estimate.h): the partition
// fsdp::pipeline uses (src/pipeline/pipeline.cpp calls pipeline_partition), and each
// stage's memory as the engine holds it under the schedules (Note [Pipeline schedules]).
#include <fsdp/tools/estimate.h>

#include "rules.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace fsdp {
namespace {

using estimate_rules::bad;
using estimate_rules::precision_bytes;
using estimate_rules::round_up;

// Stage s's input: its layers as units under an empty root, its data-parallel ranks, and
// its share of the activations (blocks 1 .. n_layer among the layers; the logits on the
// last stage).
EstimateInput stage_input(const EstimateInput& in, int stages, int64_t first, int64_t last) {
  EstimateInput si = in;
  const int dp = in.world_size / stages;
  si.world_size = dp;
  si.gpus_per_node = in.gpus_per_node > 0 && dp % in.gpus_per_node == 0 ? in.gpus_per_node : 0;
  si.unit_params = {0};  // shard_sequential's root: the stage's Sequential holds nothing itself
  si.unit_params.insert(si.unit_params.end(), in.unit_params.begin() + first,
                        in.unit_params.begin() + last);
  TransformerShape& a = si.activations;
  if (a.n_layer > 0) {
    // Blocks are the layers 1 .. n_layer: those of [first, last).
    a.n_layer = std::max<int64_t>(0, std::min(last, a.n_layer + 1) - std::max<int64_t>(first, 1));
  }
  return si;
}

// The logits and their gradient in fp32, which estimate_memory's activation term counts
// with the blocks (s*b*V*4 each): only the last stage computes them.
int64_t logits_bytes(const TransformerShape& a) {
  return a.micro_batch > 0 ? 2 * a.block_size * a.micro_batch * a.vocab_size * 4 : 0;
}

}  // namespace

std::vector<int64_t> pipeline_partition(const std::vector<int64_t>& layer_params, int stages,
                                        const std::string& partition,
                                        const std::string& stages_name,
                                        const std::string& partition_name) {
  return core::pipeline_partition(layer_params, stages, partition, stages_name, partition_name);
}

std::vector<StageEstimate> estimate_pipeline(const EstimateInput& in, const PipelineShape& p) {
  const int stages = p.stages;
  core::check_pipeline_stages(stages, in.world_size, "--pipeline-stages", core::Surface::kFlags);
  core::check_micro_batches(p.micro_batches, "--micro-batches", core::Surface::kFlags);
  const int m = p.micro_batches > 0 ? p.micro_batches : 2 * stages;
  if (!p.gpipe && m < stages) {
    bad("--micro-batches " + std::to_string(m) + " is fewer than --pipeline-stages " +
        std::to_string(stages) + " under the 1F1B schedule; use at least " +
        std::to_string(stages) + ", or --pipeline-schedule gpipe");
  }
  if (in.unit_params.empty()) bad("the model has no layers; give --unit-sizes or a GPT shape");
  const int dp = in.world_size / stages;
  if (in.strategy == ShardingStrategy::kHybridShard && in.hybrid_group_size > dp) {
    bad("--hybrid-group-size " + std::to_string(in.hybrid_group_size) +
        " is larger than a "
        "stage's " +
        std::to_string(dp) +
        " ranks (--world-size / --pipeline-stages): each "
        "stage shards over its own ranks; use a divisor of " +
        std::to_string(dp));
  }
  const std::vector<int64_t> bounds =
      pipeline_partition(in.unit_params, stages, p.partition, "--pipeline-stages ", "--partition ");
  std::vector<StageEstimate> out;
  for (int s = 0; s < stages; ++s) {
    StageEstimate st;
    st.stage = s;
    st.first_layer = bounds[static_cast<size_t>(s)];
    st.last_layer = bounds[static_cast<size_t>(s) + 1];
    st.micro_batches_in_flight = p.gpipe ? m : std::min(stages - s, m);
    const EstimateInput si = stage_input(in, stages, st.first_layer, st.last_layer);
    st.memory = estimate_memory(si);
    MemoryEstimate& est = st.memory;
    const int64_t k = st.micro_batches_in_flight;
    const bool last = s + 1 == stages, blocks = si.activations.n_layer > 0;
    for (auto& t : est.terms) {
      if (t.key != "activations") continue;
      if (in.activations.n_layer > 0) {  // the logits are the last stage's alone
        if (blocks && !last) t.device_bytes -= logits_bytes(si.activations);
        if (!blocks && last) t.device_bytes += logits_bytes(si.activations);
      }
      t.device_bytes *= k;
      t.host_bytes *= k;
      t.label += ", " + std::to_string(k) + " in flight";
    }
    // reduce_once (Note [Pipeline schedules]): the backwards before the last keep every
    // unit gathered (set_reshard_after_backward(false)) and its gradient unsharded in the
    // no-sync buffer (GradBuffer, reduce dtype, padded), until the last reduces them.
    const bool full = in.strategy == ShardingStrategy::kZero1 ||
                      in.strategy == ShardingStrategy::kZero2 ||
                      in.strategy == ShardingStrategy::kNoShard;  // already every unit's
    if (p.reduce_once && m > 1 && est.shard_group_size > 1) {
      const int64_t elem = precision_bytes(in.precision);
      int64_t padded = 0;
      for (int64_t n : si.unit_params) padded += round_up(n, est.shard_group_size);
      if (!full) {  // beyond the units the prefetch bound already counts
        const int64_t gathered = est.term("gathered_units").device_bytes;
        est.terms.push_back({"stage_full_parameters", "units kept gathered (reduce_once)", "bound",
                             std::max<int64_t>(0, padded * elem - gathered), 0, 0});
      }
      if (in.strategy != ShardingStrategy::kZero1) {
        est.terms.push_back(
            {"stage_full_gradients", "full gradients (reduce_once)", "bound", padded * elem, 0, 0});
      }
    }
    out.push_back(std::move(st));
  }
  return out;
}

}  // namespace fsdp
