#pragma once
// Block quantization for the wire (ZeRO++'s qwZ and qgZ; Note [Block quantization] in
// quantize.cpp): a flat tensor as int8 or int4 values with one symmetric scale per block
// of elements, and back.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

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

/// quantize_blocks through ATen's ops alone, on any device: what CUDA tensors take, and
/// the reference the CPU's loops match bit for bit (Note [Quantizing on the CPU]).
Quantized quantize_blocks_aten(const at::Tensor& flat, int64_t block, int bits,
                               at::ScalarType scale_dtype = at::kFloat);

/// The values of `q` in `dtype`, 1-D of q.numel elements.
at::Tensor dequantize_blocks(const Quantized& q, at::ScalarType dtype = at::kFloat);

/// Bytes on the wire for `numel` elements quantized so: the data and the scales.
int64_t quantized_bytes(int64_t numel, int64_t block, int bits,
                        at::ScalarType scale_dtype = at::kFloat);

/// How a collective quantizes what it sends (ShardingOptions::quantized_communication).
struct QuantizeSpec {
  int64_t block = 2048;
  int bits = 8;
  at::ScalarType scale_dtype = at::kFloat;
};

/// Note [Quantization faults]: a fault put in on purpose, so that a test can show the
/// accuracy checks catch broken quantization: kScalesOffByOneBlock dequantizes block b
/// with block b + 1's scale (the last block with its own). Process-wide; kNone is normal.
enum class QuantizationFault { kNone, kScalesOffByOneBlock };
void set_quantization_fault(QuantizationFault fault);

class Backend;  // backend.h
class Work;     // backend.h

/// qwZ's gather: `full` (size() x shard.numel() elements, floating) <- every rank's
/// `shard` (1-D, floating), each quantized by blocks on the wire and dequantized into
/// `full` in rank order, this rank's own part too (so every rank holds the same values).
/// One all-gather of each rank's data and scales packed as bytes. Asynchronous: wait()
/// dequantizes. `wire`, if given, gets the bytes this rank sends (the backend's figure for
/// the packed gather: (size() - 1) x quantized_bytes(shard) for a ring).
std::shared_ptr<Work> quantized_all_gather(Backend& group, const at::Tensor& full,
                                           const at::Tensor& shard, const QuantizeSpec& spec,
                                           int64_t* wire = nullptr);

/// qgZ's reduction: `shard` <- this rank's chunk of the sum of `full` over the ranks, with
/// every chunk that travels quantized by blocks: chunk j of `full` goes to rank j (one
/// all-to-all of packed bytes), and each rank dequantizes the parts of its chunk and sums
/// them in fp32 in rank order (its own part unquantized), then rounds once into `shard`:
/// the same result on every run for a given world size. Asynchronous: wait() sums.
/// `full` is read at issue and by wait(). `wire` as above.
std::shared_ptr<Work> quantized_reduce_scatter(Backend& group, const at::Tensor& full,
                                               const at::Tensor& shard, const QuantizeSpec& spec,
                                               int64_t* wire = nullptr);

/// ZeRO++'s hierarchical qgZ over `inner` (k consecutive ranks, e.g. one host) and `outer`
/// (the m ranks with this rank's index in every inner group): first inside `inner`, each
/// rank gets the sum of its inner group's parts of the m chunks it and its outer peers own
/// (quantized, summed in fp32 in inner-rank order); then across `outer`, each rank gets its
/// own chunk (those partial sums quantized again, summed in outer-rank order). The same
/// result as a flat reduce-scatter over the m x k ranks up to quantization, and
/// deterministic. Across `outer` travels 1/k of what a flat one sends there. The first
/// exchange runs asynchronously; wait() runs the second. `wire`: both exchanges' bytes;
/// `outer_wire`: the second's alone (what crosses hosts).
std::shared_ptr<Work> hierarchical_quantized_reduce_scatter(
    Backend& inner, Backend& outer, const at::Tensor& full, const at::Tensor& shard,
    const QuantizeSpec& spec, int64_t* wire = nullptr, int64_t* outer_wire = nullptr);

/// A sum all-reduce of `tensor` (1-D, floating) with quantized traffic: a quantized
/// reduce-scatter of it (padded to size() equal chunks), then a quantized all-gather of
/// the sums, so every rank ends with the same values. Collective; waits. Returns the bytes
/// this rank sent.
int64_t quantized_all_reduce(Backend& group, const at::Tensor& tensor, const QuantizeSpec& spec);

}  // namespace fsdp::detail
