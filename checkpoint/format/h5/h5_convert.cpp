// Float conversion for checkpoint files (Note [Float conversion]; see h5.h).
#include "h5_detail.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

namespace fsdp::h5 {

// Note [Float conversion]
// No float conversion is left to HDF5: its conversion of float32 to 16-bit floats
// rounds ties away from zero, where torch's Tensor::to rounds them to even, so an export
// differed from `tensor.to(dtype)` in the last bit of every exact tie (seen on an Intel
// Xeon, where such ties came up in a GPT's weights). The conversions here are c10's
// scalar ones, which Tensor::to's vectorized loops match bit for bit: round to nearest
// even, also into subnormals and to infinity on overflow. NaN is the one value whose
// bits differ between LibTorch versions (bf16: 0xffff in 1.13's vectorized path, 0x7fc0
// in 2.6's); here it is always the quiet NaN of c10's scalar rule, 0x7fc0 (bf16) or
// 0x7e00 (fp16), with the sign of the input for fp16. c10 only: the offline tools use it.
void convert(const void* src, Elem from, void* dst, Elem to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * H5Tget_size(mem_type(from)));
    return;
  }
  const bool half =
      from == Elem::kBF16 || from == Elem::kF16 || to == Elem::kBF16 || to == Elem::kF16;
  if (from == Elem::kF32 && half) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<uint16_t*>(dst);
    // NaN is set here, not left to c10: with F16C, c10::Half keeps NaN payloads.
    if (to == Elem::kBF16) {
      for (size_t i = 0; i < n; ++i) out[i] = std::isnan(in[i]) ? kBF16NaN : c10::BFloat16(in[i]).x;
    } else {
      for (size_t i = 0; i < n; ++i) {
        out[i] = std::isnan(in[i])
                     ? static_cast<uint16_t>(kF16NaN | (std::signbit(in[i]) ? 0x8000 : 0))
                     : c10::Half(in[i]).x;
      }
    }
  } else if (to == Elem::kF32 && half) {
    const auto* in = static_cast<const uint16_t*>(src);
    auto* out = static_cast<float*>(dst);
    if (from == Elem::kBF16) {
      for (size_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(c10::BFloat16(in[i], c10::BFloat16::from_bits()));
    } else {
      for (size_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(c10::Half(in[i], c10::Half::from_bits()));
    }
  } else if (from == Elem::kF64 && to == Elem::kF32) {
    // A float64 buffer (or another writer's float64 dataset) read as float32: the C++
    // cast rounds to nearest even, as Tensor::to does.
    const auto* in = static_cast<const double*>(src);
    auto* out = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  } else if (from == Elem::kF32 && to == Elem::kF64) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<double*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]);
  } else {
    TORCH_CHECK(false, "cannot convert ", elem_name(from), " to ", elem_name(to));
  }
}

void detail::convert_named(const void* src, Elem from, void* dst, Elem to, size_t n,
                           const std::string& where, const std::string& name) {
  try {
    convert(src, from, dst, to, n);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": dataset '", name, "': ", e.what_without_backtrace());
  }
}

}  // namespace fsdp::h5
