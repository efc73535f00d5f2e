#pragma once
// Full parameters on demand, for evaluation and export.

#include <fsdp/fully_sharded_module.h>

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace fsdp {

/// Options for FullParamsScope and full_state_dict.
struct FullParamsOptions {
  /// Only rank 0 keeps the full parameters; the others take part in the gathers and
  /// free them at once.
  bool rank0_only = false;
  /// full_state_dict: return CPU tensors (the scope keeps parameters on their device).
  bool offload_to_cpu = false;
  /// FullParamsScope: copy changes made to the full parameters back into the fp32
  /// shards when the scope ends (fp32 param_dtype only).
  bool writeback = true;
};

/// RAII: while alive, every original parameter of the sharded model (under its FQN and
/// shape) holds its full value, so the model can be used or read like an unsharded
/// one. All ranks must create and destroy it together (it runs collectives).
class FullParamsScope {
 public:
  explicit FullParamsScope(ShardedModel model, FullParamsOptions options = {});
  ~FullParamsScope();
  FullParamsScope(const FullParamsScope&) = delete;
  FullParamsScope& operator=(const FullParamsScope&) = delete;

 private:
  ShardedModel model_;
  FullParamsOptions options_;
};

/// The full fp32 value of every parameter, by clean FQN in unit order, gathered one unit
/// at a time. Collective: all ranks call it. With rank0_only, other ranks get an empty list.
std::vector<std::pair<std::string, torch::Tensor>> full_state_dict(const ShardedModel& model,
                                                                   FullParamsOptions options = {});

}  // namespace fsdp
