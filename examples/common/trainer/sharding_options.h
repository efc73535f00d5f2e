#pragma once
// train_gpt's sharding flags (--precision, --sharding, --hybrid-group-size, --wrap,
// --activation-checkpointing) as fsdp::ShardingOptions. An unknown value throws a
// UsageError that lists the known ones.

#include <fsdp/fsdp.h>

#include <string>

namespace lm {

/// Names the flags' values; `hybrid_group_size` is --hybrid-group-size's; `block` picks the
/// model's repeated block (--wrap block, --activation-checkpointing). The options' process
/// group is left for the caller.
fsdp::ShardingOptions sharding_options(const std::string& precision, const std::string& sharding,
                                       int hybrid_group_size, const std::string& wrap,
                                       const std::string& activation_checkpointing,
                                       const fsdp::wrap::WrapPolicy& block);

}  // namespace lm
