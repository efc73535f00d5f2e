// Block quantization for the wire (quantize.h).
#include "quantize.h"

#include "backend.h"

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

// Note [Quantized collectives]
// qwZ gathers weights quantized: each rank quantizes its shard by blocks (blocks never
// cross shards; each shard's last block may be partial) and the data and the scales
// travel in two all-gathers of the backend's own (a ring: (N - 1) parts leave each rank).
// Every rank then dequantizes all N parts, its own too, so the ranks agree on the
// weights. qgZ reduces gradients quantized: DeepSpeed's all-to-all, over point to point
// here: chunk j goes to rank j quantized, and rank j sums the parts of its chunk in fp32
// in rank order, its own part as it is (it never travels), then rounds once.

int64_t quantized_all_gather(Backend& group, const at::Tensor& full, const at::Tensor& shard,
                             int64_t block, int bits, at::ScalarType scale_dtype) {
  const int n = group.size();
  TORCH_CHECK(full.dim() == 1 && full.numel() == n * shard.numel(),
              "quantized_all_gather: full has ", full.numel(), " elements, not ", n, " x ",
              shard.numel());
  at::NoGradGuard no_grad;
  const Quantized mine = quantize_blocks(shard.detach().reshape({-1}), block, bits, scale_dtype);
  at::Tensor data = at::empty({n * mine.data.numel()}, mine.data.options());
  at::Tensor scales = at::empty({n * mine.scales.numel()}, mine.scales.options());
  auto w1 = group.all_gather(data, mine.data);
  auto w2 = group.all_gather(scales, mine.scales);
  w1->wait();
  w2->wait();
  const int64_t part = shard.numel();
  for (int r = 0; r < n; ++r) {
    Quantized q = mine;
    q.data = data.narrow(0, r * mine.data.numel(), mine.data.numel());
    q.scales = scales.narrow(0, r * mine.scales.numel(), mine.scales.numel());
    full.narrow(0, r * part, part).copy_(dequantize_blocks(q, full.scalar_type()));
  }
  return static_cast<int64_t>(n - 1) * quantized_bytes(part, block, bits, scale_dtype);
}

int64_t quantized_reduce_scatter(Backend& group, const at::Tensor& full, const at::Tensor& shard,
                                 int64_t block, int bits, int tag, at::ScalarType scale_dtype) {
  const int n = group.size(), me = group.rank();
  const int64_t chunk = shard.numel();
  TORCH_CHECK(full.dim() == 1 && full.numel() == n * chunk, "quantized_reduce_scatter: full has ",
              full.numel(), " elements, not ", n, " x ", chunk);
  TORCH_CHECK(tag >= 0 && tag < (1 << 28), "quantized_reduce_scatter: tag=", tag,
              " must be in [0, 2^28)");
  at::NoGradGuard no_grad;
  const int data_tag = 3 * (1 << 29) + 2 * tag, scales_tag = data_tag + 1;
  std::vector<Quantized> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  std::vector<std::shared_ptr<Work>> works;
  // The receive buffers and the sum on `full`'s device. (Over NCCL the point-to-point
  // calls would need grouping; the engine does not call this there yet.)
  const auto on = full.options();
  for (int k = 1; k < n; ++k) {
    const int from = (me - k + n) % n, to = (me + k) % n;
    Quantized& q = in[static_cast<size_t>(from)];
    q.numel = chunk;
    q.block = block;
    q.bits = bits;
    q.data = at::empty({bits == 8 ? chunk : (chunk + 1) / 2},
                       on.dtype(bits == 8 ? at::kChar : at::kByte));
    q.scales = at::empty({(chunk + block - 1) / block}, on.dtype(scale_dtype));
    works.push_back(group.recv(q.data, from, data_tag));
    works.push_back(group.recv(q.scales, from, scales_tag));
    Quantized& o = out[static_cast<size_t>(to)];
    o = quantize_blocks(full.narrow(0, to * chunk, chunk).detach(), block, bits, scale_dtype);
    works.push_back(group.send(o.data, to, data_tag));
    works.push_back(group.send(o.scales, to, scales_tag));
  }
  for (auto& w : works) w->wait();
  at::Tensor acc = at::zeros({chunk}, full.options().dtype(at::kFloat));
  for (int r = 0; r < n; ++r) {
    acc.add_(r == me ? full.narrow(0, me * chunk, chunk).to(at::kFloat)
                     : dequantize_blocks(in[static_cast<size_t>(r)]));
  }
  shard.copy_(acc);
  return static_cast<int64_t>(n - 1) * quantized_bytes(chunk, block, bits, scale_dtype);
}

}  // namespace fsdp::detail
