#pragma once
// Block quantization for the wire (ZeRO++'s qwZ and qgZ; Note [Block quantization] in
// quantize.cpp): a flat tensor as int8 or int4 values with one symmetric scale per block
// of elements, and back.

#include <ATen/ATen.h>

#include <cstdint>

namespace fsdp::detail {

/// A flat tensor quantized by blocks.
struct Quantized {
  /// int8: one int8 per element; int4: two elements per uint8 (element 2k in the low
  /// nibble, 2k + 1 in the high one, each stored as q + 8).
  at::Tensor data;
  /// One per block (the last may be partial), in the scale dtype: kFloat or kBFloat16.
  at::Tensor scales;
  int64_t numel = 0;
  int64_t block = 0;
  int bits = 8;
};

/// Quantizes `flat` (1-D, floating) by blocks of `block` elements, symmetrically: block
/// b's scale is max|x| / qmax (qmax = 127 for 8 bits, 7 for 4), held in `scale_dtype`
/// and never rounded below that (a bf16 scale is rounded up), and each element is
/// round-half-to-even(x / scale), within [-qmax, qmax]. So every element dequantizes to
/// within scale / 2 of its value. A block of zeros has scale 0. A block holding an inf or
/// a NaN dequantizes to NaN throughout (a loss scaler still sees the overflow). Throws
/// for a block below 1, bits other than 4 and 8, or another scale dtype.
Quantized quantize_blocks(const at::Tensor& flat, int64_t block, int bits,
                          at::ScalarType scale_dtype = at::kFloat);

/// The values of `q` in `dtype`, 1-D of q.numel elements.
at::Tensor dequantize_blocks(const Quantized& q, at::ScalarType dtype = at::kFloat);

/// Bytes on the wire for `numel` elements quantized so: the data and the scales.
int64_t quantized_bytes(int64_t numel, int64_t block, int bits,
                        at::ScalarType scale_dtype = at::kFloat);

}  // namespace fsdp::detail
