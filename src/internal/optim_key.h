#pragma once
// The key torch::optim uses for a parameter's state: its TensorImpl address, printed as
// a string in LibTorch 1.13 and the pointer itself in 2.x. Picked by the map's key type.

#include <ATen/ATen.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace fsdp::detail {

template <class Map>
typename Map::key_type optim_state_key(const Map&, const at::Tensor& p) {
  using K = typename Map::key_type;
  if constexpr (std::is_same_v<K, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<K>(p.unsafeGetTensorImpl());
  }
}

}  // namespace fsdp::detail
