#include <fsdp/loss_scaler.h>

#include "internal/train_view.h"

#include <cmath>

namespace fsdp {

LossScaler::LossScaler(ShardedModel model, LossScalerOptions options)
    : model_(std::move(model)), options_(options) {
  TORCH_CHECK(options_.loss_scale >= 0, "LossScalerOptions::loss_scale=", options_.loss_scale,
              " must be 0 (dynamic) or positive (static)");
  TORCH_CHECK(options_.loss_scale_window >= 1,
              "LossScalerOptions::loss_scale_window=", options_.loss_scale_window,
              " must be at least 1");
  TORCH_CHECK(options_.hysteresis >= 1, "LossScalerOptions::hysteresis=", options_.hysteresis,
              " must be at least 1");
  TORCH_CHECK(options_.min_loss_scale > 0,
              "LossScalerOptions::min_loss_scale=", options_.min_loss_scale, " must be positive");
  state_.scale =
      options_.loss_scale > 0 ? options_.loss_scale : std::ldexp(1.0, options_.initial_scale_power);
  TORCH_CHECK(options_.loss_scale > 0 || state_.scale >= options_.min_loss_scale,
              "LossScalerOptions: the initial scale 2^", options_.initial_scale_power,
              " is below min_loss_scale=", options_.min_loss_scale);
  state_.hysteresis_left = options_.hysteresis;
  (void)model_.sharding_options();  // fails early, with the fix, if the handle is empty
}

torch::Tensor LossScaler::scale(const torch::Tensor& loss) const { return loss * state_.scale; }

void LossScaler::unscale_() {
  if (unscaled_) return;
  unscaled_ = true;
  at::NoGradGuard no_grad;
  bool bad = false;
  std::vector<at::Tensor> grads = detail::grad_shards(model_);
  for (auto& g : grads) {
    if (!bad && !g.isfinite().all().item<bool>()) bad = true;
  }
  // Every rank must skip the same steps: agree over the whole world (a pipeline's, whose
  // stages hold different gradients).
  const ShardingOptions& options = model_.sharding_options();
  auto flag = at::full({1}, bad ? 1.0f : 0.0f, at::TensorOptions().device(options.device));
  (agree_ ? *agree_ : options.process_group).all_reduce_max(flag);
  overflow_ = flag.item<float>() > 0;
  if (!overflow_) {
    for (auto& g : grads) g.div_(state_.scale);
  }
}

bool LossScaler::step(torch::optim::Optimizer& optimizer) {
  unscale_();
  if (overflow_) {
    ++state_.skipped_steps;
    return false;
  }
  optimizer.step();
  return true;
}

void LossScaler::update() {
  TORCH_CHECK(unscaled_,
              "LossScaler::update() was called before step() or unscale_() in this step");
  const bool overflow = overflow_;
  unscaled_ = false;
  overflow_ = false;
  if (options_.loss_scale > 0) {  // static
    ++state_.iteration;
    return;
  }
  if (overflow) {
    if (options_.hysteresis == 1 || state_.hysteresis_left == 1) {
      TORCH_CHECK(state_.scale > options_.min_loss_scale,
                  "LossScaler: gradients overflowed (inf or nan) at the minimum loss scale ",
                  options_.min_loss_scale, " (iteration ", state_.iteration,
                  "), so the step cannot be saved by a smaller scale: training has diverged or "
                  "fp16 cannot represent these gradients. Try bf16 instead of fp16, a lower "
                  "learning rate, gradient clipping, or a lower min_loss_scale.");
      state_.scale = std::max(state_.scale / 2, options_.min_loss_scale);
    } else {
      --state_.hysteresis_left;
    }
    state_.last_overflow_iteration = state_.iteration;
  } else if ((state_.iteration - state_.last_overflow_iteration) % options_.loss_scale_window ==
             0) {
    state_.hysteresis_left = options_.hysteresis;
    state_.scale *= 2;
  }
  ++state_.iteration;
}

}  // namespace fsdp
