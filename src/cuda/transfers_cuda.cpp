// Offload transfers on a GPU: one side stream per device (Note [Offload transfers]).
// Built only against a CUDA LibTorch (1.13 or 2.x).
#include "../transfers.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>

namespace fsdp::detail {
namespace {

class CudaTransfers : public Transfers {
 public:
  explicit CudaTransfers(at::Device device)
      : device_(at::kCUDA, device.has_index() ? device.index() : c10::cuda::current_device()),
        side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index())) {}

  at::Tensor to_device(const at::Tensor& host, at::ScalarType dtype) override {
    c10::cuda::CUDAGuard on_device(device_);
    wait_for_compute();
    c10::cuda::CUDAStreamGuard on_side(side_);
    // Allocated while the side stream is current, so the caching allocator ties the
    // memory to it; the all-gather that reads it is issued in on_stream().
    at::Tensor out = at::empty(host.sizes(), at::TensorOptions().dtype(host.scalar_type()).device(device_));
    out.copy_(host, /*non_blocking=*/true);
    if (dtype != host.scalar_type()) out = out.to(dtype);
    pending_ = true;
    return out;
  }

  void on_stream(const std::function<void()>& issue) override {
    c10::cuda::CUDAGuard on_device(device_);
    c10::cuda::CUDAStreamGuard on_side(side_);
    issue();
  }

  HostCopy to_host(const at::Tensor& device) override {
    c10::cuda::CUDAGuard on_device(device_);
    wait_for_compute();
    at::Tensor out = at::empty(device.sizes(), at::TensorOptions().dtype(device.scalar_type()).pinned_memory(true));
    {
      c10::cuda::CUDAStreamGuard on_side(side_);
      out.copy_(device, /*non_blocking=*/true);
    }
    // `device` belongs to the compute stream's pool: keep its memory from being reused
    // there before the side stream has read it.
    c10::cuda::CUDACachingAllocator::recordStream(device.storage().data_ptr(), side_);
    auto landed = std::make_shared<at::cuda::CUDAEvent>();
    landed->record(side_);
    pending_ = true;
    return {out, [landed]() { landed->synchronize(); }};
  }

  void wait_host() override {
    if (!pending_) return;
    side_.synchronize();
    pending_ = false;
  }

 private:
  void wait_for_compute() {
    at::cuda::CUDAEvent done;
    done.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    done.block(side_);
  }

  at::Device device_;
  c10::cuda::CUDAStream side_;
  bool pending_ = false;  ///< copies issued since the last wait_host()
};

}  // namespace

std::shared_ptr<Transfers> make_cuda_transfers(at::Device device) {
  return std::make_shared<CudaTransfers>(device);
}

}  // namespace fsdp::detail
