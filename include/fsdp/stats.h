#pragma once
// Memory and communication accounting. All figures are bytes, per rank.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fsdp {
/// What a sharded model counts: memory by class, bytes communicated, the GPU's bytes.
namespace stats {

/// One tracked allocation class.
struct MemoryCounter {
  int64_t current = 0;  ///< bytes held now
  int64_t peak = 0;  ///< most bytes held at once since the last ShardedModel::reset_peak_memory()
};

/// Bytes the engine itself holds, by class.
struct MemoryStats {
  MemoryCounter sharded_params;   ///< fp32 master shards (trainable and frozen)
  MemoryCounter grad_shards;      ///< fp32 gradient shards
  MemoryCounter gathered_params;  ///< full parameters of gathered units, in param_dtype
  /// ShardingOptions::reshard_after_forward_group_size = k: each unit's 1/k slice of its
  /// full parameters (param_dtype), kept from its training forward to its backward gather.
  MemoryCounter post_forward_params;
  /// Flat gradient buffers awaiting reduction (none at world size 1 without offload:
  /// gradients go straight into the shards). Gathers cast into gathered_params in place.
  MemoryCounter comm_buffers;
  MemoryCounter
      checkpoint_buffers;  ///< full fp32 flat parameters gathered for export (gather_flat)
  /// offload_optimizer: copies in transit. On the device, a shard in param_dtype before
  /// its all-gather; on the host, fp32 gradient shards back from the device that wait to
  /// be added into existing gradients (at most two units' at a time). With
  /// offload_optimizer, sharded_params and grad_shards are host memory.
  MemoryCounter offload_buffers;
  /// offload_optimizer without offload_param: each shard's param_dtype copy kept on the
  /// device for the all-gathers (DeepSpeed's 16-bit partition), refreshed from the host
  /// shard once an optimizer step changed it.
  MemoryCounter device_param_shards;
  /// ShardingOptions::offload_activations: host copies of the inputs that checkpointed
  /// units saved for backward, from their forward until the graph is freed.
  MemoryCounter offloaded_activations;
  /// Host copies of this rank's checkpoint state that an asynchronous save writes in the
  /// background (save_sharded_checkpoint_async), then kept for the next one to copy into
  /// (SaveOptions::keep_staging) until release_checkpoint_staging().
  MemoryCounter checkpoint_staging;
  /// offload_param = nvme: this rank's parameter files (masters, gradients and the
  /// optimizer's param_dtype copies), on disk and not in memory; sharded_params and
  /// grad_shards are 0 then (Note [NVMe parameters] in src/engine/flat_param.cpp).
  MemoryCounter nvme_params;
};

/// Bytes moved by collectives, counted twice. The *_bytes figures count a collective by
/// the size of its full (unsharded) buffer: an all-gather by its output, a reduce-scatter
/// by its input, an all-reduce and a broadcast by their tensor. This is what NCCL reads or
/// writes per rank and does not depend on the algorithm a backend picks, nor on
/// quantization. The *_wire_bytes figures count what this rank sends to the other ranks,
/// by the algorithm its backend runs (Gloo: a ring all-gather, a direct reduce-scatter, a
/// ring all-reduce, a binomial-tree broadcast; NCCL: its ring's figures), quantized where
/// ShardingOptions::quantized_communication says so; transport headers not included.
/// docs/design.md, "Wire bytes".
struct CommStats {
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_bytes = 0;
  /// Of all_gather_bytes: gathers from the reshard_after_forward group (k ranks, e.g. one
  /// node; ShardingOptions::reshard_after_forward_group_size) instead of the shard group.
  int64_t reshard_group_all_gather_bytes = 0;
  int64_t all_gather_calls = 0;
  int64_t reduce_scatter_calls = 0;
  int64_t all_reduce_calls = 0;
  /// Bytes this rank sent, per kind (Note [Wire bytes] in src/comm/wire.cpp).
  int64_t all_gather_wire_bytes = 0;
  int64_t reduce_scatter_wire_bytes = 0;
  int64_t all_reduce_wire_bytes = 0;
  int64_t broadcast_wire_bytes = 0;
  /// Of all_gather_wire_bytes: gathers from the reshard_after_forward group (inside one
  /// node under hpZ).
  int64_t reshard_group_all_gather_wire_bytes = 0;
  /// Of reduce_scatter_wire_bytes: the cross-group exchange of hierarchical quantized
  /// reductions (QuantizedCommunication::gradients with hpZ: what crosses nodes).
  int64_t hierarchical_outer_wire_bytes = 0;
  /// Of the calls above: those that travelled quantized (int8 or int4 with scales).
  int64_t quantized_all_gather_calls = 0;
  int64_t quantized_reduce_scatter_calls = 0;
  /// offload_optimizer: bytes copied from the host shards to the device for gathers (in
  /// param_dtype), and fp32 gradient shards copied back to the host. Not collectives:
  /// not in total_bytes(). An explicit copy even when the device is the CPU.
  int64_t offload_to_device_bytes = 0;
  int64_t offload_to_host_bytes = 0;
  /// offload_param = nvme: bytes the engine read from and wrote to its parameter files
  /// (gathers' inputs, gradient shards; the optimizer's own streaming is not counted
  /// here). Rounded up to 4096-byte blocks. Not in total_bytes().
  int64_t nvme_read_bytes = 0;
  int64_t nvme_write_bytes = 0;
  /// offload_param = nvme: gathers whose input was read ahead (queued when the unit before
  /// was prefetched, so the read ran beside compute) rather than when they were issued.
  int64_t nvme_reads_ahead = 0;

  /// Bytes moved by collectives (full buffers).
  int64_t total_bytes() const {
    return all_gather_bytes + reduce_scatter_bytes + all_reduce_bytes + broadcast_bytes;
  }
  /// Bytes this rank sent for collectives.
  int64_t wire_bytes() const {
    return all_gather_wire_bytes + reduce_scatter_wire_bytes + all_reduce_wire_bytes +
           broadcast_wire_bytes;
  }
};

/// Communication in the current training step (since the last training forward began)
/// and since sharding.
struct CommCounters {
  CommStats step;
  CommStats total;
};

/// One GPU's bytes as LibTorch's CUDA caching allocator counts them (what
/// torch.cuda.memory_allocated, max_memory_allocated, memory_reserved and
/// max_memory_reserved report in Python): every tensor on the device, the engine's and the
/// program's, and cuBLAS's workspace.
struct DeviceMemory {
  int64_t allocated = 0;       ///< bytes in tensors now
  int64_t peak_allocated = 0;  ///< most bytes in tensors since the last reset
  int64_t reserved = 0;        ///< bytes the allocator holds from the driver now
  int64_t peak_reserved = 0;   ///< most bytes held from the driver since the last reset
};
/// `device`'s figures (a CUDA device; no index: the current one). Throws for another
/// device type, and when this fsdp was built against a CPU-only LibTorch.
DeviceMemory device_memory(const c10::Device& device);
/// Starts device_memory's peaks again from the current figures.
void reset_device_peak_memory(const c10::Device& device);

}  // namespace stats

// The names before they moved into fsdp::stats (issue 54: concepts in nested namespaces).
// They stay one release, deprecated.
using MemoryCounter [[deprecated("renamed fsdp::stats::MemoryCounter")]] = stats::MemoryCounter;
using MemoryStats [[deprecated("renamed fsdp::stats::MemoryStats")]] = stats::MemoryStats;
using CommStats [[deprecated("renamed fsdp::stats::CommStats")]] = stats::CommStats;
using CommCounters [[deprecated("renamed fsdp::stats::CommCounters")]] = stats::CommCounters;
using DeviceMemory [[deprecated("renamed fsdp::stats::DeviceMemory")]] = stats::DeviceMemory;
[[deprecated("renamed fsdp::stats::device_memory")]] inline stats::DeviceMemory device_memory(
    const c10::Device& device) {
  return stats::device_memory(device);
}
[[deprecated("renamed fsdp::stats::reset_device_peak_memory")]] inline void
reset_device_peak_memory(const c10::Device& device) {
  stats::reset_device_peak_memory(device);
}

}  // namespace fsdp
