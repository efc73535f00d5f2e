#include "hard_values.h"

#include <gtest/gtest.h>

#include <cmath>

namespace fsdp::testing {

std::vector<uint32_t> hard_fp32_bits() {
  return {
      // bf16 ties (the low 16 bits are exactly 0x8000): to even, down and up, both signs
      0x3bc68000,
      0x3bc78000,
      0xbbc68000,
      0xbbc78000,
      0x3f808000,
      0x3f818000,
      0xbf808000,
      0xbf818000,
      // bf16: not ties, either side of one
      0x3bc67fff,
      0x3bc68001,
      // fp32 subnormals: bf16 ties to 0 and to 2, the largest subnormal's tie up into normals
      0x00000001,
      0x00008000,
      0x00018000,
      0x80018000,
      0x007f8000,
      0x807f8000,
      // bf16 overflow: the tie above the largest finite value and the largest float go to inf
      0x7f7f8000,
      0x7f7fffff,
      0xff7f8000,
      // fp16 ties: 1 + 2^-11 (to 1), 1 + 3 * 2^-11 (up), both signs
      0x3f801000,
      0x3f803000,
      0xbf801000,
      0xbf803000,
      // fp16 subnormal ties: 2^-25 (to 0), 3 * 2^-25 (up to 2^-23), 5 * 2^-25 (down to 2^-23)
      0x33000000,
      0x33400000,
      0x33a00000,
      0xb3400000,
      // fp16 overflow: 65520 is the tie between 65504 and 65536 (to inf); 65519 stays finite
      0x477ff000,
      0x477fef00,
      0xc77ff000,
      // infinities, NaNs (quiet, signalling, negative, all payload bits), zeros
      0x7f800000,
      0xff800000,
      0x7fc00000,
      0xffc00000,
      0x7f800001,
      0xff800001,
      0x7fffffff,
      0x00000000,
      0x80000000,
  };
}

HardValuesImpl::HardValuesImpl() {
  auto bits = hard_fp32_bits();
  std::vector<int32_t> v(bits.begin(), bits.end());
  torch::manual_seed(5);
  auto rest = torch::randn({64 - static_cast<int64_t>(v.size())});
  w = register_parameter(
      "w", torch::cat({torch::tensor(v, torch::kInt).view(torch::kFloat), rest}).reshape({8, 8}));
  // A float64 buffer with float32 ties (1 + 2^-24 to 1, 1 + 3 * 2^-24 up), a tie below
  // the smallest float32 subnormal, overflow, and a NaN.
  b = register_buffer(
      "b",
      torch::tensor({1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24),
                     -(1.0 + std::ldexp(1.0, -24)), std::ldexp(1.0, -150), 1e39, std::nan(""), 0.1},
                    torch::kDouble));
}

void expect_rounded_like_torch(const std::vector<uint16_t>& got, const torch::Tensor& fp32,
                               torch::ScalarType dtype, const std::string& what) {
  auto src = fp32.reshape({-1}).contiguous();
  auto want = src.to(dtype).view(torch::kShort);
  ASSERT_EQ(got.size(), static_cast<size_t>(src.numel())) << what;
  for (int64_t i = 0; i < src.numel(); ++i) {
    const float x = src[i].item<float>();
    const auto bits = static_cast<uint32_t>(src.view(torch::kInt)[i].item<int32_t>());
    uint16_t expected = static_cast<uint16_t>(want[i].item<int16_t>());
    if (std::isnan(x))
      expected = dtype == torch::kBFloat16 ? 0x7fc0 : (std::signbit(x) ? 0xfe00 : 0x7e00);
    EXPECT_EQ(got[static_cast<size_t>(i)], expected)
        << what << ": element " << i << " (fp32 bits 0x" << std::hex << bits << ") stored as 0x"
        << got[i] << ", torch rounds it to 0x" << expected;
  }
}

}  // namespace fsdp::testing
