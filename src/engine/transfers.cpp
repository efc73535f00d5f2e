// Offload transfers on the host: immediate copies (Note [Offload transfers]).
#include "transfers.h"

namespace fsdp::detail {
namespace {

class HostTransfers : public Transfers {
 public:
  explicit HostTransfers(at::Device device) : device_(device) {}

  at::Tensor to_device(const at::Tensor& host, at::ScalarType dtype) override {
    at::Tensor out = at::empty(host.sizes(), at::TensorOptions().dtype(dtype).device(device_));
    out.copy_(host);
    return out;
  }
  std::function<void()> on_stream(const std::function<void()>& issue, const at::Tensor&) override {
    issue();
    return {};
  }
  HostCopy to_host(const at::Tensor& device) override {
    at::Tensor out = at::empty(device.sizes(), at::TensorOptions().dtype(device.scalar_type()));
    out.copy_(device);
    return {out, {}};
  }
  void wait_host() override {}

 private:
  at::Device device_;
};

}  // namespace

std::shared_ptr<Transfers> make_transfers(at::Device device) {
  if (device.is_cuda()) return make_cuda_transfers(device);
  return std::make_shared<HostTransfers>(device);
}

}  // namespace fsdp::detail
