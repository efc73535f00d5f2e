#pragma once
// DeepSpeed's learning-rate warm-up schedules (deepspeed/runtime/lr_schedules.py), as a
// DeepSpeed config's `scheduler` section asks for them (fsdp/deepspeed_config.h).

#include <cstdint>

namespace fsdp {

/// DeepSpeed's WarmupLR (total_num_steps = 0) and WarmupDecayLR
/// (deepspeed/runtime/lr_schedules.py), formula for formula.
struct WarmupSchedule {
  enum class Type { kLog, kLinear };
  double warmup_min_lr = 0;         ///< the rate before and at the first step
  double warmup_max_lr = 1e-3;      ///< the rate after the warm-up
  int64_t warmup_num_steps = 1000;  ///< steps from min to max (DeepSpeed uses at least 2)
  Type warmup_type = Type::kLog;    ///< log: min + (max-min)*ln(i+1)/ln(n); linear: i/n
  /// WarmupDecayLR: the rate falls linearly to 0 at this step; 0: WarmupLR (no decay).
  int64_t total_num_steps = 0;

  /// The rate after `last_batch_iteration` scheduler steps, DeepSpeed's argument: -1
  /// before the first (DeepSpeed's engine sets the rate of optimizer step k, counting
  /// from 0, as lr(k - 1 - steps skipped for fp16 overflow so far)).
  double lr(int64_t last_batch_iteration) const;
};

}  // namespace fsdp
