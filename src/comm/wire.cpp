// Bytes on the wire (wire.h, Backend::wire_bytes).
#include "wire.h"

#include "backend.h"

#include <algorithm>

namespace fsdp::detail {

// Note [Wire bytes]
// CommStats counts each collective twice: by its full buffer (what NCCL reads or writes
// per rank, the same whatever the algorithm), and by the bytes this rank sends to the
// other ranks, which depend on the algorithm and are what a slow link carries. The
// second figure comes from the backend, which knows what it runs:
//  - Gloo: a ring all-gather ((n-1)/n of the output), the library's direct reduce-scatter
//    ((n-1)/n of the input, in its own dtype; FSDP_GLOO_REDUCE_SCATTER=allreduce: the
//    all-reduce's), a ring all-reduce (gloo_ring_all_reduce_bytes; bf16 widened to fp32
//    first, Note [Gloo reduce-scatter]), a binomial-tree broadcast
//    (gloo_broadcast_bytes) and a direct all-to-all ((n-1)/n of the input).
//  - NCCL, and the default: rings, as NCCL's ring algorithm moves them ((n-1)/n for an
//    all-gather, a reduce-scatter and an all-to-all, 2(n-1)/n for an all-reduce, the
//    whole tensor from every rank but the ring's last for a broadcast). NCCL may pick a
//    tree or NVLS instead; the figure is then the ring's, and says so in the docs.
// The bytes a rank keeps for itself (its own part) never count. Transport framing (Gloo's
// per-message header, TCP/IP) does not either: tests/test_wire_bytes.cpp checks the
// figures against the kernel's count of bytes the process wrote to its TCP sockets,
// which carry them plus that framing.

int64_t ring_share_bytes(int64_t bytes, int n) {
  if (n <= 1) return 0;
  return bytes / n * (n - 1);
}

int64_t gloo_ring_all_reduce_bytes(int64_t bytes, int64_t element_size, int n, int rank) {
  if (n <= 1 || bytes <= 0) return 0;
  const auto round_up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  const int64_t segment = round_up((bytes + 2 * n - 1) / (2 * n), element_size);
  const int64_t segments = round_up(std::max<int64_t>((bytes + segment - 1) / segment, 2 * n), n);
  const int64_t per_rank = segments / n;
  int64_t sent = 0;
  const auto send = [&](int64_t first_segment, int64_t i) {
    const int64_t offset = ((first_segment * per_rank + i) * segment) % (segments * segment);
    sent += std::max<int64_t>(0, std::min(segment, bytes - offset));
  };
  for (int64_t i = 0; i < segments - 2; ++i) send(rank + 1, i);  // reduce-scatter
  for (int64_t i = 0; i < segments - 2; ++i) send(rank, i);      // all-gather
  return sent;
}

int64_t gloo_broadcast_bytes(int64_t bytes, int n, int rank, int root) {
  if (n <= 1) return 0;
  const int64_t vrank = (rank - root + n) % n;
  int dim = 0;
  while ((int64_t{1} << dim) < n) ++dim;
  int64_t sends = 0;
  for (int i = 0; i < dim; ++i) {
    // Rank vrank takes part from round i on when its bits above i are clear, and sends
    // to vrank + 2^i when its bit i is clear and that peer exists.
    if ((vrank >> (i + 1)) != 0) continue;
    if ((vrank & (int64_t{1} << i)) == 0 && vrank + (int64_t{1} << i) < n) ++sends;
  }
  return sends * bytes;
}

int64_t Backend::wire_bytes(WireOp op, int64_t bytes, at::ScalarType dtype, int root) const {
  (void)dtype;
  const int n = size();
  if (n <= 1) return 0;
  switch (op) {
    case WireOp::kAllGather:
    case WireOp::kReduceScatter:
    case WireOp::kAllToAll:
      return ring_share_bytes(bytes, n);
    case WireOp::kAllReduce:
      return 2 * ring_share_bytes(bytes, n);
    case WireOp::kBroadcast:
      return rank() == (root + n - 1) % n ? 0 : bytes;
  }
  return 0;
}

}  // namespace fsdp::detail
