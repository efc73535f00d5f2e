// Full parameters on demand: FullParamsScope and full_state_dict, through the model
// view (src/internal/train_view.h).
#include <fsdp/full_params.h>

#include "internal/train_view.h"

namespace fsdp {

namespace {
// Whether this rank keeps what it gathers (FullParamsOptions::rank0_only).
bool keeps(const ShardedModel& model, const FullParamsOptions& options) {
  return !options.rank0_only || model.sharding_options().process_group.rank() == 0;
}
}  // namespace

FullParamsScope::FullParamsScope(ShardedModel model, FullParamsOptions options)
    : model_(std::move(model)), options_(options) {
  detail::gather_units(model_, keeps(model_, options_));
}

FullParamsScope::~FullParamsScope() {
  // Written back only in fp32: a low-precision copy would round the shards.
  const bool writeback = options_.writeback && keeps(model_, options_) &&
                         model_.sharding_options().mixed_precision.param_dtype == at::kFloat;
  if (writeback) detail::shard_change_barrier_of(model_)();  // Note [Background staging]
  detail::release_units(model_, writeback);
}

std::vector<std::pair<std::string, torch::Tensor>> full_state_dict(const ShardedModel& model,
                                                                   FullParamsOptions options) {
  const bool keep = keeps(model, options);
  const size_t flats = detail::flat_params(model).size();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t k = 0; k < flats; ++k) {
    at::Tensor full = detail::full_flat_fp32(model, k);  // a collective: every rank takes part
    if (!keep) continue;
    if (options.offload_to_cpu) full = full.to(at::kCPU);
    for (const auto& s : detail::flat_slots(model, k)) {
      at::Tensor v = full.narrow(0, s.offset, s.numel).view(s.shape).clone();
      for (const auto& name : s.names) out.emplace_back(name, v);  // tied names share one tensor
    }
  }
  return out;
}

}  // namespace fsdp
