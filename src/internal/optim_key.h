#pragma once
// The key torch::optim uses for a parameter's state: its TensorImpl address (a void*
// in LibTorch 2.x; 1.13 printed it as a string).

#include <ATen/ATen.h>

#include <type_traits>

namespace fsdp::detail {

template <class Map>
typename Map::key_type optim_state_key(const Map&, const at::Tensor& p) {
  using K = typename Map::key_type;
  static_assert(std::is_pointer_v<K>,
                "torch::optim keys its state by the TensorImpl pointer (LibTorch 2.x)");
  return static_cast<K>(p.unsafeGetTensorImpl());
}

}  // namespace fsdp::detail
