#pragma once
// Values built to be hard for 16-bit exports (Note [Float conversion] in
// checkpoint/h5_convert.cpp): exact ties both ways and both signs, ties into and out of
// subnormals, overflow to infinity, infinities and NaNs. The consolidated and the
// safetensors export tests check that every stored word rounds as torch's Tensor::to.

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::testing {

/// The fp32 bit patterns above.
std::vector<uint32_t> hard_fp32_bits();

/// A model whose one parameter holds `hard_fp32_bits()` and then random values.
struct HardValuesImpl : torch::nn::Module {
  HardValuesImpl();
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w); }
  torch::Tensor w, b;
};
TORCH_MODULE(HardValues);

/// Every word equals torch's `to(dtype)`, except NaN, which is the one quiet NaN of
/// Note [Float conversion] (torch's own NaN bits differ between versions).
void expect_rounded_like_torch(const std::vector<uint16_t>& got, const torch::Tensor& fp32,
                               torch::ScalarType dtype, const std::string& what);

}  // namespace fsdp::testing
