// Block quantization for the wire (quantize.h).
#include "quantize.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace fsdp::detail {

// Note [Block quantization]
// ZeRO++ sends weights (qwZ) and gradients (qgZ) as small integers with one scale per
// block of elements. Symmetric, as DeepSpeed's: scale = max|x| / qmax over the block,
// q = round(x / scale), so the error of an element is at most scale / 2: a block is as
// precise as its largest element allows. The scale travels in fp32, or in bf16 rounded
// up (never down, so no |x| / scale exceeds qmax and the bound holds with the scale that
// travels). Rounding is half to even (at::round), the same on every rank and run. A block
// of zeros gets scale 0 and dequantizes to zeros. A non-finite element makes its block's
// scale non-finite, and the whole block dequantizes to NaN: gradients that overflowed
// stay non-finite for the loss scaler, and the other blocks are untouched.

namespace {

int qmax_of(int bits) { return bits == 8 ? 127 : 7; }

void check_args(const at::Tensor& flat, int64_t block, int bits, at::ScalarType scale_dtype) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_floating_point(),
              "quantize_blocks: a 1-D floating tensor is quantized, got ", flat.dim(),
              " dimension(s) of ", flat.scalar_type());
  TORCH_CHECK(block >= 1, "quantize_blocks: block=", block, " must be at least 1 element");
  TORCH_CHECK(bits == 8 || bits == 4, "quantize_blocks: bits=", bits, " must be 8 or 4");
  TORCH_CHECK(scale_dtype == at::kFloat || scale_dtype == at::kBFloat16,
              "quantize_blocks: scales are kFloat or kBFloat16, got ", scale_dtype);
}

// `scale` (fp32) in bf16, rounded up where rounding to nearest went below it.
at::Tensor bf16_not_below(const at::Tensor& scale) {
  at::Tensor s = scale.to(at::kBFloat16);
  const at::Tensor low = s.to(at::kFloat) < scale;  // false for NaN and inf
  // The next bf16 above a positive finite value: its bits plus one.
  at::Tensor up = (s.view(at::kShort) + 1).view(at::kBFloat16);
  return at::where(low, up, s);
}

}  // namespace

int64_t quantized_bytes(int64_t numel, int64_t block, int bits, at::ScalarType scale_dtype) {
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t data = bits == 8 ? numel : (numel + 1) / 2;
  return data + blocks * static_cast<int64_t>(c10::elementSize(scale_dtype));
}

Quantized quantize_blocks(const at::Tensor& flat, int64_t block, int bits,
                          at::ScalarType scale_dtype) {
  check_args(flat, block, bits, scale_dtype);
  at::NoGradGuard no_grad;
  Quantized q;
  q.numel = flat.numel();
  q.block = block;
  q.bits = bits;
  const int64_t blocks = (q.numel + block - 1) / block;
  const int qmax = qmax_of(bits);
  at::Tensor x = flat.to(at::kFloat);
  if (blocks * block != q.numel) x = at::constant_pad_nd(x, {0, blocks * block - q.numel}, 0);
  x = x.view({blocks, block});
  // max|x| per block; NaN propagates (amax ignores nothing), inf gives an inf scale.
  at::Tensor amax = x.abs().amax(1);
  amax = at::where(x.isnan().any(1), at::full_like(amax, NAN), amax);
  at::Tensor scale = amax / static_cast<float>(qmax);
  q.scales = scale_dtype == at::kBFloat16 ? bf16_not_below(scale) : scale;
  const at::Tensor s = q.scales.to(at::kFloat).unsqueeze(1);
  // x / s with s == 0 (a block of zeros) gives NaN: those become 0.
  at::Tensor v = at::round(x / s).clamp(-qmax, qmax);
  v = at::where(s == 0, at::zeros_like(v), v).nan_to_num(0.0);
  v = v.view({-1}).narrow(0, 0, q.numel);
  if (bits == 8) {
    q.data = v.to(at::kChar);
  } else {
    at::Tensor u = (v + 8).to(at::kByte);
    if (q.numel % 2 == 1) u = at::constant_pad_nd(u, {0, 1}, 8);
    u = u.view({-1, 2});
    q.data = u.select(1, 0).bitwise_or(u.select(1, 1).bitwise_left_shift(4)).contiguous();
  }
  return q;
}

at::Tensor dequantize_blocks(const Quantized& q, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  at::Tensor v;
  if (q.bits == 8) {
    v = q.data.to(at::kFloat);
  } else {
    const at::Tensor lo = q.data.bitwise_and(15), hi = q.data.bitwise_right_shift(4);
    v = at::stack({lo, hi}, 1).view({-1}).narrow(0, 0, q.numel).to(at::kFloat) - 8;
  }
  const int64_t blocks = q.scales.numel();
  at::Tensor s = q.scales.to(at::kFloat);
  // A non-finite scale (a block that held an inf or a NaN): NaN throughout the block.
  s = at::where(s.isfinite(), s, at::full_like(s, NAN));
  if (blocks * q.block != q.numel) v = at::constant_pad_nd(v, {0, blocks * q.block - q.numel}, 0);
  at::Tensor out = (v.view({blocks, q.block}) * s.unsqueeze(1)).view({-1}).narrow(0, 0, q.numel);
  return out.to(dtype);
}

}  // namespace fsdp::detail
