#pragma once
// The engine's byte counters (public figures in fsdp/stats.h).

#include <fsdp/stats.h>

#include <algorithm>
#include <cstdint>

namespace fsdp::detail {

enum class Collective { kAllGather, kReduceScatter, kAllReduce, kBroadcast };

struct Accounting {
  stats::MemoryStats mem;
  stats::CommCounters comm;

  static void alloc(stats::MemoryCounter& c, int64_t bytes) {
    c.current += bytes;
    c.peak = std::max(c.peak, c.current);
  }
  static void release(stats::MemoryCounter& c, int64_t bytes) { c.current -= bytes; }

  /// A collective over a full buffer of `bytes`, of which this rank sent `wire` bytes
  /// (Note [Wire bytes]); `quantized`: it travelled quantized.
  void count(Collective kind, int64_t bytes, int64_t wire, bool quantized = false) {
    for (stats::CommStats* s : {&comm.step, &comm.total}) {
      switch (kind) {
        case Collective::kAllGather:
          s->all_gather_bytes += bytes;
          s->all_gather_wire_bytes += wire;
          s->all_gather_calls += 1;
          s->quantized_all_gather_calls += quantized ? 1 : 0;
          break;
        case Collective::kReduceScatter:
          s->reduce_scatter_bytes += bytes;
          s->reduce_scatter_wire_bytes += wire;
          s->reduce_scatter_calls += 1;
          s->quantized_reduce_scatter_calls += quantized ? 1 : 0;
          break;
        case Collective::kAllReduce:
          s->all_reduce_bytes += bytes;
          s->all_reduce_wire_bytes += wire;
          s->all_reduce_calls += 1;
          break;
        case Collective::kBroadcast:
          s->broadcast_bytes += bytes;
          s->broadcast_wire_bytes += wire;
          break;
      }
    }
  }
  /// An all-gather from the reshard_after_forward group: counted as one, and apart.
  void count_reshard_group_gather(int64_t bytes, int64_t wire) {
    count(Collective::kAllGather, bytes, wire);
    for (stats::CommStats* s : {&comm.step, &comm.total}) {
      s->reshard_group_all_gather_bytes += bytes;
      s->reshard_group_all_gather_wire_bytes += wire;
    }
  }
  /// Of a hierarchical quantized reduce-scatter counted above: its cross-group bytes.
  void count_hierarchical_outer(int64_t wire) {
    for (stats::CommStats* s : {&comm.step, &comm.total}) s->hierarchical_outer_wire_bytes += wire;
  }
  /// offload_param = nvme: a transfer between a parameter file and host memory.
  void count_nvme(bool read, int64_t bytes) {
    for (stats::CommStats* s : {&comm.step, &comm.total})
      (read ? s->nvme_read_bytes : s->nvme_write_bytes) += bytes;
  }
  /// cpu_offload: a copy between the host shards and the device.
  void count_offload(bool to_device, int64_t bytes) {
    for (stats::CommStats* s : {&comm.step, &comm.total})
      (to_device ? s->offload_to_device_bytes : s->offload_to_host_bytes) += bytes;
  }
};

}  // namespace fsdp::detail
