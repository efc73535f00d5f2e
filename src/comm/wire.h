#pragma once
// Bytes on the wire of the collectives' algorithms (Note [Wire bytes] in wire.cpp).

#include <cstdint>

namespace fsdp::detail {

/// A ring all-gather's or a direct exchange's share: (n - 1) / n of `bytes` (the full
/// buffer, n equal parts) leaves each rank.
int64_t ring_share_bytes(int64_t bytes, int n);

/// What `rank` sends in Gloo's ring all-reduce (gloo/allreduce.cc) of `bytes` bytes in
/// elements of `element_size`: a reduce-scatter then an all-gather, each of 2n - 2
/// segment sends of ceil(bytes / 2n) rounded up to an element, the segments past the end
/// short or empty.
int64_t gloo_ring_all_reduce_bytes(int64_t bytes, int64_t element_size, int n, int rank);

/// What `rank` sends in Gloo's binomial-tree broadcast (gloo/broadcast.cc) from `root`:
/// `bytes` once per peer it forwards to.
int64_t gloo_broadcast_bytes(int64_t bytes, int n, int rank, int root);

}  // namespace fsdp::detail
