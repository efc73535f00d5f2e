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

class Backend;  // backend.h

/// qwZ's gather: `full` (size() × shard.numel() elements, floating) <- every rank's
/// `shard` (1-D, floating), each quantized by blocks on the wire and dequantized into
/// `full` in rank order, this rank's own part too (so every rank holds the same values).
/// Two all-gathers: the data (int8, or int4 packed) and the scales. Returns the bytes
/// this rank sends in a ring all-gather of them: (size() - 1) × quantized_bytes(shard).
/// Collective; waits.
int64_t quantized_all_gather(Backend& group, const at::Tensor& full, const at::Tensor& shard,
                             int64_t block, int bits, at::ScalarType scale_dtype = at::kFloat);

/// qgZ's reduction: `shard` <- this rank's chunk of the sum of `full` over the ranks, with
/// every chunk that travels quantized by blocks: chunk j of `full` goes to rank j (an
/// all-to-all over point to point, posted at once), and each rank dequantizes the parts
/// of its chunk and sums them in fp32 in rank order (its own part unquantized), then
/// rounds once into `shard`: the same result on every run for a given world size.
/// `tag`: the same on every rank for one call, unique among the calls in flight on
/// `group`, in [0, 2^28) (point-to-point tags from 3 × 2^29 up are these). Returns the bytes this
/// rank sends: (size() - 1) × quantized_bytes(chunk). Collective; waits.
int64_t quantized_reduce_scatter(Backend& group, const at::Tensor& full, const at::Tensor& shard,
                                 int64_t block, int bits, int tag,
                                 at::ScalarType scale_dtype = at::kFloat);

}  // namespace fsdp::detail
