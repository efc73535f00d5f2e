#pragma once
// Fully Sharded Data Parallel for LibTorch: the whole public API.

#include <fsdp/activation_checkpoint.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/deepspeed_config.h>
#include <fsdp/full_params.h>
#include <fsdp/fully_sharded_module.h>
#include <fsdp/fused_adamw.h>
#include <fsdp/loss_scaler.h>
#include <fsdp/options.h>
#include <fsdp/param_groups.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>
#include <fsdp/stats.h>
#include <fsdp/trace.h>
#include <fsdp/version.h>
#include <fsdp/warmup_schedule.h>
#include <fsdp/wrap_policy.h>
