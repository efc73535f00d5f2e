// Offload transfers on a GPU: side streams, one per direction (Note [Offload transfers]).
// Built only against a CUDA LibTorch (2.6 or newer).
#include "transfers.h"

#include <fsdp/stats.h>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <deque>
#include <memory>

namespace fsdp::detail {
namespace {

class CudaTransfers : public Transfers {
 public:
  explicit CudaTransfers(at::Device device)
      : device_(at::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device()),
        to_device_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())),
        to_host_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())) {}

  at::Tensor to_device(const at::Tensor& host, at::ScalarType dtype) override {
    c10::cuda::CUDAGuard on_device(device_);
    reap(/*all=*/false);
    wait_for_compute(to_device_);
    c10::cuda::CUDAStreamGuard on_side(to_device_);
    // Allocated while the side stream is current, so the caching allocator ties the
    // memory to it; the all-gather that reads it is issued in on_stream().
    at::Tensor out =
        at::empty(host.sizes(), at::TensorOptions().dtype(host.scalar_type()).device(device_));
    out.copy_(host, /*non_blocking=*/true);
    // The copy reads `host` after this returns. ATen's host allocator knows that of its
    // own blocks, not of a buffer wrapped around one (the NVMe reads' pinned buffers,
    // Note [NVMe parameters]), which their owner may drop at once: keep `host` until then.
    auto read = std::make_shared<at::cuda::CUDAEvent>();
    read->record(to_device_);
    in_flight_.push_back({host, std::move(read)});
    if (dtype != host.scalar_type()) out = out.to(dtype);
    pending_ = true;
    return out;
  }

  std::function<void()> on_stream(const std::function<void()>& issue,
                                  const at::Tensor& staged) override {
    c10::cuda::CUDAGuard on_device(device_);
    auto issued = std::make_shared<at::cuda::CUDAEvent>();
    {
      c10::cuda::CUDAStreamGuard on_side(to_device_);
      issue();
      issued->record(to_device_);
    }
    const at::Device device = device_;
    return [issued, staged, device]() {
      const auto compute = c10::cuda::getCurrentCUDAStream(device.index());
      issued->block(compute);
      // The collective keeps no claim on `staged` once waited for (recent LibTorch
      // stashes tensors instead of recording streams): the compute stream's claim keeps
      // its memory from the side stream's next allocation until compute gets here.
      if (staged.defined())
        c10::cuda::CUDACachingAllocator::recordStream(staged.storage().data_ptr(), compute);
    };
  }

  HostCopy to_host(const at::Tensor& device) override {
    c10::cuda::CUDAGuard on_device(device_);
    wait_for_compute(to_host_);
    at::Tensor out = at::empty(device.sizes(),
                               at::TensorOptions().dtype(device.scalar_type()).pinned_memory(true));
    {
      c10::cuda::CUDAStreamGuard on_side(to_host_);
      out.copy_(device, /*non_blocking=*/true);
    }
    // `device` belongs to the compute stream's pool: keep its memory from being reused
    // there before the side stream has read it.
    c10::cuda::CUDACachingAllocator::recordStream(device.storage().data_ptr(), to_host_);
    auto landed = std::make_shared<at::cuda::CUDAEvent>();
    landed->record(to_host_);
    pending_ = true;
    return {out, [landed]() { landed->synchronize(); }};
  }

  void wait_host() override {
    if (!pending_) return;
    to_device_.synchronize();
    to_host_.synchronize();
    reap(/*all=*/true);
    pending_ = false;
  }

 private:
  // Drops the host sources of finished copies (all of them after a synchronize).
  void reap(bool all) {
    while (!in_flight_.empty() && (all || in_flight_.front().read->query())) in_flight_.pop_front();
  }
  void wait_for_compute(const c10::cuda::CUDAStream& side) {
    at::cuda::CUDAEvent done;
    done.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    done.block(side);
  }

  at::Device device_;
  c10::cuda::CUDAStream to_device_;  ///< shards to the device, and the gathers that read them
  c10::cuda::CUDAStream to_host_;    ///< gradient shards back to the host
  bool pending_ = false;             ///< copies issued since the last wait_host()
  struct InFlight {
    at::Tensor host;                            ///< what a to_device() copy reads
    std::shared_ptr<at::cuda::CUDAEvent> read;  ///< recorded after it on to_device_
  };
  std::deque<InFlight> in_flight_;  ///< in issue order, so the oldest finishes first
};

}  // namespace

std::shared_ptr<Transfers> make_cuda_transfers(at::Device device) {
  return std::make_shared<CudaTransfers>(device);
}

}  // namespace fsdp::detail

namespace fsdp {
namespace {

c10::DeviceIndex cuda_index_of(const c10::Device& device, const char* what) {
  TORCH_CHECK(device.is_cuda(), what, ": ", device,
              " is not a CUDA device; the caching allocator's figures exist for cuda:N only "
              "(for host memory read the process's peak RSS)");
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

}  // namespace

stats::DeviceMemory stats::device_memory(const c10::Device& device) {
  const auto device_stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index_of(device, "device_memory"));
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  DeviceMemory m;
  m.allocated = device_stats.allocated_bytes[all].current;
  m.peak_allocated = device_stats.allocated_bytes[all].peak;
  m.reserved = device_stats.reserved_bytes[all].current;
  m.peak_reserved = device_stats.reserved_bytes[all].peak;
  return m;
}

void stats::reset_device_peak_memory(const c10::Device& device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(
      cuda_index_of(device, "reset_device_peak_memory"));
}

}  // namespace fsdp
