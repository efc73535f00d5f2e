#include "clip_grad.h"

#include <fsdp/clip_grad.h>
#include "trace/trace.h"

#include "internal/train_view.h"

#include <cmath>
#include <limits>

namespace fsdp {

double detail::clip_grad_norm_across(
    ShardedModel& model, double max_norm, double norm_type,
    const std::function<void(at::Tensor& local, bool inf)>& across) {
  detail::trace::Scope span("optimizer", []() { return std::string("clip_grad_norm"); });
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  TORCH_CHECK(inf || norm_type == 2.0, "clip_grad_norm_: norm_type=", norm_type,
              " is unsupported; use 2.0 (L2) or std::numeric_limits<double>::infinity()");
  TORCH_CHECK(max_norm > 0, "clip_grad_norm_: max_norm=", max_norm, " must be positive");
  at::NoGradGuard no_grad;
  // Each shard group holds the model once (padding is zero), and replicas across
  // groups hold the same values, so reducing over the shard group gives the global norm.
  auto local = at::zeros(
      {1}, at::TensorOptions().dtype(at::kDouble).device(model.sharding_options().device));
  // Note [NVMe parameters]: gradients in parameter files are read by O_DIRECT, one shard
  // at a time, not through the page cache.
  detail::visit_grad_shards(model, /*write=*/false, [&](at::Tensor& g) {
    if (inf) {
      local = at::maximum(local, g.abs().max().to(local.device(), at::kDouble).reshape({1}));
    } else {
      // With offload the gradient shards are on the host, the collective on the device.
      local += g.to(at::kDouble).pow(2).sum().to(local.device());
    }
  });
  detail::shard_group_all_reduce(model, local, /*max=*/inf);
  if (across) across(local, inf);
  const double total = inf ? local.item<double>() : std::sqrt(local.item<double>());
  // As torch::nn::utils::clip_grad_norm_: scale by min(1, max_norm / (total + 1e-6)).
  const double coef = std::min(1.0, max_norm / (total + 1e-6));
  if (coef < 1.0)
    detail::visit_grad_shards(model, /*write=*/true, [&](at::Tensor& g) { g.mul_(coef); });
  return total;
}

double clip_grad_norm_(ShardedModel& model, double max_norm, double norm_type) {
  return detail::clip_grad_norm_across(model, max_norm, norm_type, {});
}

}  // namespace fsdp
