#pragma once
// Host memory under training that lives in host memory: Note [Host heap] in host_heap.cpp.

#include <fsdp/options.h>

#include <cstdint>

namespace fsdp::detail {

/// Where the options keep shards in host memory (a CPU device, or offload_optimizer),
/// makes the block allocator LibTorch's CPU allocator and fixes glibc's mmap threshold at
/// kLargeBlock, once per process, unless the user chose already: MALLOC_MMAP_THRESHOLD_ or
/// glibc's malloc.mmap_threshold tunable (glibc applied them), FSDP_HOST_ALLOCATOR=glibc,
/// or a CPU allocator the program installed itself. Throws on an FSDP_HOST_ALLOCATOR other
/// than blocks or glibc. Once installed, later calls do nothing.
void bound_host_heap(const ShardingOptions& options);

/// Blocks of at least this many bytes are the block allocator's; smaller ones glibc's.
constexpr int64_t kLargeBlock = int64_t{64} << 10;

/// The block allocator's counters (bytes are whole pages).
struct HostBlockStats {
  int64_t live_bytes = 0;       ///< in blocks held by tensors now
  int64_t cached_bytes = 0;     ///< in freed blocks kept for reuse
  int64_t peak_live_bytes = 0;  ///< the most live_bytes ever; live + cached never exceed it
  int64_t mapped = 0;           ///< blocks mapped from the kernel
  int64_t reused = 0;           ///< allocations served from the cache
  int64_t unmapped = 0;         ///< blocks returned to the kernel
};

/// The counters; all zero while the allocator was never installed.
HostBlockStats host_block_stats();

/// Whether the block allocator is LibTorch's CPU allocator now.
bool host_blocks_installed();

/// Unmaps the blocks kept for reuse (make_sharded after each unit it builds: its full
/// parameters are not needed again at that size).
void release_host_blocks();

}  // namespace fsdp::detail
