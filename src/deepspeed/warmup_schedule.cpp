// DeepSpeed's WarmupLR and WarmupDecayLR, as deepspeed/runtime/lr_schedules.py computes
// them (the tests compare with values that file's classes printed).
#include <fsdp/warmup_schedule.h>

#include <algorithm>
#include <cmath>

namespace fsdp {

double WarmupSchedule::lr(int64_t last_batch_iteration) const {
  // DeepSpeed: "Attempting to get learning rate from scheduler before it has started"
  // returns the minimum; the engine sets it at construction, so the first step uses it.
  if (last_batch_iteration < 0) return warmup_min_lr;
  const int64_t n = std::max<int64_t>(2, warmup_num_steps);  // DeepSpeed: max(2, ...)
  const double it = static_cast<double>(last_batch_iteration);
  double gamma;
  if (last_batch_iteration < n) {
    gamma = warmup_type == Type::kLog ? std::log(it + 1) * (1.0 / std::log(static_cast<double>(n)))
                                      : it / static_cast<double>(n);
  } else if (total_num_steps > 0) {
    gamma = std::max(0.0, static_cast<double>(total_num_steps - last_batch_iteration) /
                              std::max(1.0, static_cast<double>(total_num_steps - n)));
  } else {
    gamma = 1.0;
  }
  return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma;
}

}  // namespace fsdp
