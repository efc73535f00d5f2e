#pragma once
// What fully_shard and make_sharded check before they build anything (preflight.cpp):
// the options, by the options core's rules (Note [Options core]), with the deprecated
// fields resolved; and the machine: host memory for the shards, the NVMe directories and
// their free space.

#include <fsdp/fully_sharded_module.h>

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// ShardingOptions::cpu_offload (deprecated) as what it means, offload_optimizer and
/// offload_param on the host, with a one-time warning; the engine reads only those.
ShardingOptions resolve_deprecated_options(const ShardingOptions& given);
/// The options' rules (the options core's, in the API's words) and what the engine
/// checks itself: a wrap policy, the scale dtype, the NVMe directories. c10::Error.
void validate_sharding_options(const ShardingOptions& o);
/// Refuses, before any allocation, a sharding whose host-resident state cannot fit in
/// MemAvailable (see preflight.cpp); `built_bytes`: shards make_sharded already built.
void check_host_memory(const WrapPointImpl& root, const ShardingOptions& o, int64_t built_bytes);
/// Note [Shared NVMe disk]: room for the parameter files that `bytes` are (`what`: of
/// which units). Collective.
void check_param_file_space(int64_t bytes, const ShardingOptions& options, const std::string& what);

}  // namespace fsdp::detail
