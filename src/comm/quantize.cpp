// Block quantization for the wire (quantize.h).
#include "quantize.h"

#include "backend.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <vector>

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

std::atomic<int> g_fault{0};  // Note [Quantization faults]

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

// Note [Quantization faults]
// The suite must show that its accuracy checks would catch broken quantization, so one
// fault can be switched on for the process: dequantization with each block's neighbour's
// scale, the kind of off-by-one an indexing bug makes. Nothing but tests sets it.
void set_quantization_fault(QuantizationFault fault) { g_fault = static_cast<int>(fault); }

int64_t quantized_bytes(int64_t numel, int64_t block, int bits, at::ScalarType scale_dtype) {
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t data = bits == 8 ? numel : (numel + 1) / 2;
  return data + blocks * static_cast<int64_t>(c10::elementSize(scale_dtype));
}

Quantized quantize_blocks_aten(const at::Tensor& flat, int64_t block, int bits,
                               at::ScalarType scale_dtype) {
  check_args(flat, block, bits, scale_dtype);
  at::NoGradGuard no_grad;
  Quantized q;
  q.numel = flat.numel();
  q.block = block;
  q.bits = bits;
  const int64_t blocks = (q.numel + block - 1) / block;
  const int qmax = qmax_of(bits);
  // One fp32 copy, worked on in place (a pass per step; quantizing is on the step's path).
  at::Tensor x = flat.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (blocks * block != q.numel) x = at::constant_pad_nd(x, {0, blocks * block - q.numel}, 0);
  x = x.view({blocks, block});
  // max|x| per block: amax propagates a NaN, and an inf gives an inf scale.
  at::Tensor scale = x.abs().amax(1).div_(static_cast<float>(qmax));
  q.scales = scale_dtype == at::kBFloat16 ? bf16_not_below(scale) : scale;
  const at::Tensor s = q.scales.to(at::kFloat).unsqueeze(1);
  // x / s is NaN for a block of zeros (0 / 0) and for a non-finite scale (or 0 for finite
  // elements over an inf): those become 0, and dequantizing a non-finite scale gives NaN.
  at::Tensor v = x.div_(s).round_().clamp_(-qmax, qmax).nan_to_num_(0.0);
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

namespace {

// Note [Quantizing on the CPU]
// On the step's path, quantizing a gradient through ATen's op chain reads and writes the
// tensor about eight times (an fp32 copy, abs, amax, division, rounding, clamping, NaN
// cleaning, the int8 cast). On the CPU two loops do it: one pass for each block's scale,
// straight from the input dtype, and one for the values. They give ATen's bits: the same
// fp32 division by the scale that travels, clamping before rounding (the same result: the
// bounds are integers), rounding half to even by adding and subtracting 1.5 x 2^23 (exact
// for |v| < 2^22 in the default rounding mode), and NaN (0 / 0 for a block of zeros,
// anything over a non-finite scale) to 0. BlockQuantization.CpuLoopsGiveAtensBits checks.
template <class T>
void cpu_scales(const T* x, int64_t n, int64_t block, int qmax, float* scale) {
  const int64_t blocks = (n + block - 1) / block;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      float amax = 0.f;
      bool nan = false;
      for (int64_t i = lo; i < hi; ++i) {
        const float v = static_cast<float>(x[i]);
        nan = nan || std::isnan(v);
        const float a = std::fabs(v);
        amax = a > amax ? a : amax;
      }
      scale[b] = nan ? NAN : amax / static_cast<float>(qmax);
    }
  });
}

inline int quantize_one(float v, float s, float qmax) {
  v = v / s;
  if (std::isnan(v)) return 0;
  v = v < -qmax ? -qmax : (v > qmax ? qmax : v);
  constexpr float kMagic = 12582912.0f;            // 1.5 x 2^23
  return static_cast<int>((v + kMagic) - kMagic);  // no -ffast-math: not folded to v
}

template <class T>
void cpu_values(const T* x, int64_t n, int64_t block, int qmax, int bits, const float* s,
                uint8_t* out) {
  const float q = static_cast<float>(qmax);
  if (bits == 8) {
    const int64_t blocks = (n + block - 1) / block;
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t lo = b * block, hi = std::min(n, lo + block);
        const float sb = s[b];
        for (int64_t i = lo; i < hi; ++i) {
          out[i] = static_cast<uint8_t>(
              static_cast<int8_t>(quantize_one(static_cast<float>(x[i]), sb, q)));
        }
      }
    });
    return;
  }
  const int64_t pairs = (n + 1) / 2;
  at::parallel_for(0, pairs, 8192, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t i = 2 * k;
      const int lo = quantize_one(static_cast<float>(x[i]), s[i / block], q) + 8;
      const int hi =
          i + 1 < n ? quantize_one(static_cast<float>(x[i + 1]), s[(i + 1) / block], q) + 8 : 8;
      out[k] = static_cast<uint8_t>(lo | (hi << 4));
    }
  });
}

}  // namespace

Quantized quantize_blocks(const at::Tensor& flat, int64_t block, int bits,
                          at::ScalarType scale_dtype) {
  check_args(flat, block, bits, scale_dtype);
  if (!flat.is_cpu()) return quantize_blocks_aten(flat, block, bits, scale_dtype);
  at::NoGradGuard no_grad;  // Note [Quantizing on the CPU]
  Quantized q;
  q.numel = flat.numel();
  q.block = block;
  q.bits = bits;
  const int64_t blocks = (q.numel + block - 1) / block;
  const int qmax = qmax_of(bits);
  const at::Tensor x = flat.contiguous();
  at::Tensor scale = at::empty({blocks}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_blocks", [&] {
        cpu_scales<scalar_t>(x.data_ptr<scalar_t>(), q.numel, block, qmax, scale.data_ptr<float>());
      });
  q.scales = scale_dtype == at::kBFloat16 ? bf16_not_below(scale) : scale;
  const at::Tensor s = q.scales.to(at::kFloat).contiguous();
  q.data = at::empty({bits == 8 ? q.numel : (q.numel + 1) / 2},
                     x.options().dtype(bits == 8 ? at::kChar : at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_blocks", [&] {
        cpu_values<scalar_t>(x.data_ptr<scalar_t>(), q.numel, block, qmax, bits,
                             s.data_ptr<float>(), static_cast<uint8_t*>(q.data.data_ptr()));
      });
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
  if (g_fault.load() == static_cast<int>(QuantizationFault::kScalesOffByOneBlock) && blocks > 1) {
    s = at::cat({s.narrow(0, 1, blocks - 1), s.narrow(0, blocks - 1, 1)});
  }
  if (blocks * q.block != q.numel) v = at::constant_pad_nd(v, {0, blocks * q.block - q.numel}, 0);
  at::Tensor out = (v.view({blocks, q.block}) * s.unsqueeze(1)).view({-1}).narrow(0, 0, q.numel);
  return out.to(dtype);
}

// Note [Quantized collectives]
// qwZ gathers weights quantized: each rank quantizes its shard by blocks (blocks never
// cross shards; each shard's last block may be partial) and packs the data and the scales
// into one byte buffer, so one all-gather of the backend's own carries them (a ring:
// (N - 1) parts leave each rank). Every rank then dequantizes all N parts, its own too, so
// the ranks agree on the weights. qgZ reduces gradients quantized: DeepSpeed's all-to-all,
// one packed part per destination: chunk j goes to rank j quantized, and rank j sums the
// parts of its chunk in fp32 in rank order, its own part as it is (its copy to itself is
// not used), then rounds once. Both return a Work at once and finish in wait(), so a
// prefetched gather and an overlapped reduction overlap compute as the unquantized ones
// do. Gloo and NCCL both run the all-to-all (c10d's alltoall_base), and the arithmetic is
// ATen's on the tensors' device.

namespace {

// One part's bytes: its data, then its scales.
int64_t data_bytes(int64_t numel, int bits) { return bits == 8 ? numel : (numel + 1) / 2; }

at::Tensor pack(const Quantized& q) {
  return at::cat({q.data.view(at::kByte).reshape({-1}), q.scales.view(at::kByte).reshape({-1})});
}

// The part of `numel` elements packed at the start of `bytes`.
Quantized unpack(const at::Tensor& bytes, int64_t numel, const QuantizeSpec& spec) {
  Quantized q;
  q.numel = numel;
  q.block = spec.block;
  q.bits = spec.bits;
  const int64_t d = data_bytes(numel, spec.bits);
  const int64_t blocks = (numel + spec.block - 1) / spec.block;
  q.data = bytes.narrow(0, 0, d);
  if (spec.bits == 8) q.data = q.data.view(at::kChar);
  // A copy: a view as a wider dtype needs an aligned offset.
  q.scales = bytes.narrow(0, d, blocks * static_cast<int64_t>(c10::elementSize(spec.scale_dtype)))
                 .clone()
                 .view(spec.scale_dtype);
  return q;
}

int64_t part_bytes(int64_t numel, const QuantizeSpec& spec) {
  return quantized_bytes(numel, spec.block, spec.bits, spec.scale_dtype);
}

// Chunk j of `x` (n equal chunks), each quantized and packed, one after another.
at::Tensor pack_chunks(const at::Tensor& x, int n, const QuantizeSpec& spec) {
  const int64_t c = x.numel() / n;
  std::vector<at::Tensor> parts;
  for (int j = 0; j < n; ++j) {
    parts.push_back(pack(
        quantize_blocks(x.narrow(0, j * c, c).detach(), spec.block, spec.bits, spec.scale_dtype)));
  }
  return at::cat(parts);
}

// The fp32 sum, in rank order, of the n parts of `c` elements packed in `received`, rank
// `me`'s taken from `own` as it is.
at::Tensor sum_parts(const at::Tensor& received, int n, int me, const at::Tensor& own, int64_t c,
                     const QuantizeSpec& spec) {
  const int64_t p = part_bytes(c, spec);
  at::Tensor acc = at::zeros({c}, own.options().dtype(at::kFloat));
  for (int r = 0; r < n; ++r) {
    acc.add_(r == me ? own.to(at::kFloat)
                     : dequantize_blocks(unpack(received.narrow(0, r * p, p), c, spec)));
  }
  return acc;
}

class FinishWork : public Work {
 public:
  FinishWork(std::shared_ptr<Work> inner, std::function<void()> finish)
      : inner_(std::move(inner)), finish_(std::move(finish)) {}
  void wait() override {
    if (!finish_) return;
    inner_->wait();
    auto f = std::move(finish_);
    finish_ = {};
    at::NoGradGuard no_grad;
    f();
  }
  void on_completion(std::function<void()> f) override { inner_->on_completion(std::move(f)); }

 private:
  std::shared_ptr<Work> inner_;
  std::function<void()> finish_;
};

void check_spec(const QuantizeSpec& spec) {
  check_args(at::empty({1}), spec.block, spec.bits, spec.scale_dtype);
}

}  // namespace

std::shared_ptr<Work> quantized_all_gather(Backend& group, const at::Tensor& full,
                                           const at::Tensor& shard, const QuantizeSpec& spec,
                                           int64_t* wire) {
  const int n = group.size();
  TORCH_CHECK(full.dim() == 1 && full.numel() == n * shard.numel(),
              "quantized_all_gather: full has ", full.numel(), " elements, not ", n, " x ",
              shard.numel());
  check_spec(spec);
  at::NoGradGuard no_grad;
  const int64_t part = shard.numel();
  const at::Tensor mine =
      pack(quantize_blocks(shard.detach().reshape({-1}), spec.block, spec.bits, spec.scale_dtype));
  const int64_t p = mine.numel();
  at::Tensor gathered = at::empty({n * p}, mine.options());
  if (wire != nullptr) *wire = group.wire_bytes(WireOp::kAllGather, n * p, at::kByte, 0);
  auto work = group.all_gather(gathered, mine);
  return std::make_shared<FinishWork>(std::move(work), [=]() {
    for (int r = 0; r < n; ++r) {
      full.narrow(0, r * part, part)
          .copy_(dequantize_blocks(unpack(gathered.narrow(0, r * p, p), part, spec),
                                   full.scalar_type()));
    }
  });
}

std::shared_ptr<Work> quantized_reduce_scatter(Backend& group, const at::Tensor& full,
                                               const at::Tensor& shard, const QuantizeSpec& spec,
                                               int64_t* wire) {
  const int n = group.size(), me = group.rank();
  const int64_t c = shard.numel();
  TORCH_CHECK(full.dim() == 1 && full.numel() == n * c, "quantized_reduce_scatter: full has ",
              full.numel(), " elements, not ", n, " x ", c);
  check_spec(spec);
  at::NoGradGuard no_grad;
  const at::Tensor out = pack_chunks(full, n, spec);
  at::Tensor in = at::empty_like(out);
  if (wire != nullptr) *wire = group.wire_bytes(WireOp::kAllToAll, out.numel(), at::kByte, 0);
  auto work = group.all_to_all(in, out);
  return std::make_shared<FinishWork>(std::move(work), [=]() {
    (void)out;  // alive until the exchange is done
    shard.copy_(sum_parts(in, n, me, full.narrow(0, me * c, c), c, spec));
  });
}

namespace {

// Two exchanges: the first issued at once, the second by progress() (or wait()) once the
// first is done, the result by wait().
class TwoStageWork : public Work {
 public:
  TwoStageWork(std::shared_ptr<Work> first, std::function<std::shared_ptr<Work>()> second,
               std::function<void()> finish)
      : first_(std::move(first)), second_(std::move(second)), finish_(std::move(finish)) {}
  void progress() override {
    if (!second_) return;
    first_->wait();
    first_.reset();
    auto s = std::move(second_);
    second_ = {};
    at::NoGradGuard no_grad;
    issued_ = s();
  }
  void wait() override {
    progress();
    if (!finish_) return;
    issued_->wait();
    issued_.reset();
    auto f = std::move(finish_);
    finish_ = {};
    at::NoGradGuard no_grad;
    f();
  }

 private:
  std::shared_ptr<Work> first_;
  std::function<std::shared_ptr<Work>()> second_;
  std::function<void()> finish_;
  std::shared_ptr<Work> issued_;
};

}  // namespace

std::shared_ptr<Work> hierarchical_quantized_reduce_scatter(Backend& inner, Backend& outer,
                                                            const at::Tensor& full,
                                                            const at::Tensor& shard,
                                                            const QuantizeSpec& spec, int64_t* wire,
                                                            int64_t* outer_wire) {
  const int k = inner.size(), m = outer.size(), l = inner.rank(), h = outer.rank();
  const int64_t c = shard.numel();
  TORCH_CHECK(full.dim() == 1 && full.numel() == int64_t{m} * k * c,
              "hierarchical_quantized_reduce_scatter: full has ", full.numel(), " elements, not ",
              m, " x ", k, " x ", c);
  check_spec(spec);
  at::NoGradGuard no_grad;
  // Inner destination l' gets the m chunks its outer group owns: h' * k + l' for every h'.
  const at::Tensor by_local = full.view({m, k, c}).transpose(0, 1).reshape({-1});
  struct State {
    at::Tensor own, out, in, partial, out2, in2;
  };
  auto st = std::make_shared<State>();
  st->out = pack_chunks(by_local, k, spec);
  st->in = at::empty_like(st->out);
  st->own = by_local.narrow(0, l * m * c, m * c).clone();  // `full` is not needed again
  const int64_t inner_bytes = inner.wire_bytes(WireOp::kAllToAll, st->out.numel(), at::kByte, 0);
  const int64_t second = m * part_bytes(c, spec);
  const int64_t outer_bytes = outer.wire_bytes(WireOp::kAllToAll, second, at::kByte, 0);
  if (wire != nullptr) *wire = inner_bytes + outer_bytes;
  if (outer_wire != nullptr) *outer_wire = outer_bytes;
  auto first = inner.all_to_all(st->in, st->out);
  Backend* across = &outer;
  // This rank's m chunks, summed over its inner group, then chunk h' to outer rank h'.
  auto issue_second = [st, across, k, l, m, c, spec]() {
    st->partial = sum_parts(st->in, k, l, st->own, m * c, spec);
    st->own = st->out = st->in = at::Tensor();
    st->out2 = pack_chunks(st->partial, m, spec);
    st->in2 = at::empty_like(st->out2);
    return across->all_to_all(st->in2, st->out2);
  };
  auto finish = [st, shard, m, h, c, spec]() {
    shard.copy_(sum_parts(st->in2, m, h, st->partial.narrow(0, h * c, c), c, spec));
    *st = State();
  };
  return std::make_shared<TwoStageWork>(std::move(first), std::move(issue_second),
                                        std::move(finish));
}

int64_t quantized_all_reduce(Backend& group, const at::Tensor& tensor, const QuantizeSpec& spec) {
  const int n = group.size();
  TORCH_CHECK(tensor.dim() == 1 && tensor.is_floating_point(),
              "quantized_all_reduce: a 1-D floating tensor, got ", tensor.dim(),
              " dimension(s) of ", tensor.scalar_type());
  if (n == 1) return 0;
  at::NoGradGuard no_grad;
  const int64_t c = (tensor.numel() + n - 1) / n;
  at::Tensor padded = at::constant_pad_nd(tensor.detach(), {0, n * c - tensor.numel()}, 0);
  at::Tensor mine = at::empty({c}, tensor.options().dtype(at::kFloat));
  int64_t sent_rs = 0, sent_ag = 0;
  quantized_reduce_scatter(group, padded, mine, spec, &sent_rs)->wait();
  at::Tensor all = at::empty({n * c}, mine.options());
  quantized_all_gather(group, all, mine, spec, &sent_ag)->wait();
  tensor.copy_(all.narrow(0, 0, tensor.numel()));
  return sent_rs + sent_ag;
}

}  // namespace fsdp::detail
