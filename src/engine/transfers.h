#pragma once
// Host <-> device copies for CPU offload, ordered against compute (Note [Offload transfers]).

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace fsdp::detail {

// Note [Offload transfers]
// With cpu_offload the fp32 shard, its gradient and the optimizer state live on the host.
// Each gather first copies the shard (in param_dtype) to the device, and each reduced
// gradient shard goes back to the host. On a GPU the copies run on side streams of their
// own (one per direction, so both copy engines work), overlapping the kernels of the
// compute stream:
//  - to_device(): the side stream first waits for the compute stream's work issued so
//    far (the gather's output buffer may reuse memory those kernels still read), then
//    copies from pinned memory. The all-gather is issued inside on_stream(), with the
//    side stream current, so NCCL starts after the copy; Work::wait() later makes the
//    compute stream wait for NCCL, and the join returned by on_stream() for the side
//    stream itself (which matters when the gather is a local copy: one rank, NO_SHARD).
//    Meanwhile the compute stream runs the current unit.
//  - to_host(): the side stream waits for the compute stream (which produced the
//    gradient), copies into pinned memory, and the caching allocator is told that the
//    side stream uses the source. The host copy is valid once its wait() or wait_host()
//    has returned.
// The first gradient of a shard in a backward pass becomes its gradient as it is. One
// that must be added to an existing gradient (accumulation) waits in the flat
// parameter's landing list; the runtime lands each unit's list when the next unit's
// gradients have been reduced (by then its copy has usually finished), so at most two
// units' gradient copies wait on the host at once.
// The runtime calls wait_host() at the end of backward (before any optimizer step reads
// the gradients or writes the shards a copy may still read) and after an eval forward.
// On the host (CPU devices, CPU-only builds) every copy completes at once and on_stream()
// just runs its argument, so the same bookkeeping runs, and is tested, everywhere.
class Transfers {
 public:
  virtual ~Transfers() = default;
  /// A new device tensor of `dtype` with `host`'s values (an explicit copy, also when the
  /// device is the host). `host` is kept alive until the copy has read it (on a GPU: until
  /// a later call finds it done, or wait_host()), so a caller may drop it at once.
  virtual at::Tensor to_device(const at::Tensor& host, at::ScalarType dtype) = 0;
  /// Runs `issue` with the transfer stream current: collectives it issues start after the
  /// copies issued so far. Returns the join, to call with the compute stream current
  /// once the collective has been waited for: it makes the compute stream wait for what
  /// `issue` did on the transfer stream (a single-rank gather is a plain copy there) and
  /// keeps `staged`'s memory from reuse until the compute stream gets there. Empty on
  /// the host.
  virtual std::function<void()> on_stream(const std::function<void()>& issue,
                                          const at::Tensor& staged) = 0;
  /// A device tensor's copy on its way to the host.
  struct HostCopy {
    at::Tensor value;            ///< new host tensor (pinned for a GPU); read it once landed
    std::function<void()> wait;  ///< blocks until the copy has landed; empty if it has
  };
  /// Starts copying `device` to the host.
  virtual HostCopy to_host(const at::Tensor& device) = 0;
  /// Blocks until every copy issued so far has landed.
  virtual void wait_host() = 0;
};

/// Transfers between the host and `device` (immediate copies unless it is a GPU).
std::shared_ptr<Transfers> make_transfers(at::Device device);
/// The GPU implementation (src/engine/transfers_cuda.cpp; a stand-in in CPU-only builds).
std::shared_ptr<Transfers> make_cuda_transfers(at::Device device);

}  // namespace fsdp::detail
