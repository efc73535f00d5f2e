// Block quantization for the wire (Note [Block quantization] in src/comm/quantize.cpp):
// every element within scale / 2 of its value, with fp32 and bf16 scales, int8 and int4;
// the cases built on purpose: the largest element at a block's ends, a block of zeros, one
// nonzero element, a partial last block, one element, values the scale represents exactly,
// non-finite elements; and the bytes that travel.
#include "../src/comm/backend.h"
#include "../src/comm/quantize.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_quantize_cases {

using fsdp::detail::dequantize_blocks;
using fsdp::detail::quantize_blocks;
using fsdp::detail::quantized_bytes;
using fsdp::testing::run_ranks;

namespace {

// Data with the edge cases in fixed places: blocks of 16; block 0 has its largest
// magnitude first (negative), block 1 last, block 2 is zeros, block 3 one nonzero
// element, block 4 tiny values (1e-30), then random values, and 5 elements of a last
// partial block.
torch::Tensor edge_data(int64_t blocks) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = torch::randn({blocks * 16 + 5}, g);
  x.narrow(0, 0, 16).clamp_(-1, 1);
  x[0] = -3.0f;
  x.narrow(0, 16, 16).clamp_(-1, 1);
  x[31] = 2.5f;
  x.narrow(0, 32, 16).zero_();
  x.narrow(0, 48, 16).zero_();
  x[53] = 0.75f;
  x.narrow(0, 64, 16).mul_(1e-30f);
  return x;
}

// Every element within half its block's scale (the scale that travels).
void expect_within_half_scale(const torch::Tensor& x, int64_t block, int bits,
                              at::ScalarType scale_dtype) {
  const auto q = quantize_blocks(x, block, bits, scale_dtype);
  const auto y = dequantize_blocks(q);
  ASSERT_EQ(y.numel(), x.numel());
  const auto s = q.scales.to(torch::kFloat);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float scale = s[i / block].item<float>();
    const float err = std::abs(y[i].item<float>() - x[i].item<float>());
    ASSERT_LE(err, scale / 2 * (1 + 1e-6f) + 1e-37f)
        << "element " << i << " of block " << i / block << ": " << x[i].item<float>()
        << " came back " << y[i].item<float>() << ", scale " << scale << ", " << bits << " bits, "
        << scale_dtype;
  }
}

}  // namespace

TEST(BlockQuantization, EveryElementWithinHalfItsBlocksScale) {
  const auto x = edge_data(12);
  for (int bits : {8, 4}) {
    for (auto scale_dtype : {at::kFloat, at::kBFloat16}) {
      expect_within_half_scale(x, 16, bits, scale_dtype);
      expect_within_half_scale(x, 2048, bits, scale_dtype);  // one partial block
      expect_within_half_scale(x, 1, bits, scale_dtype);     // every element its own scale
    }
  }
}

TEST(BlockQuantization, TheLargestElementAndZerosComeBackExactly) {
  const auto x = edge_data(6);
  for (int bits : {8, 4}) {
    const auto q = quantize_blocks(x, 16, bits);
    const auto y = dequantize_blocks(q);
    const int qmax = bits == 8 ? 127 : 7;
    EXPECT_FLOAT_EQ(q.scales[0].item<float>(), 3.0f / qmax);
    EXPECT_FLOAT_EQ(y[0].item<float>(), -3.0f) << "the block's extreme is ±qmax × scale";
    EXPECT_FLOAT_EQ(y[31].item<float>(), 2.5f);
    EXPECT_EQ(q.scales[2].item<float>(), 0.0f) << "a block of zeros";
    EXPECT_TRUE(torch::equal(y.narrow(0, 32, 16), torch::zeros({16})));
    EXPECT_FLOAT_EQ(y[53].item<float>(), 0.75f);  // the one nonzero element of block 3
    EXPECT_TRUE(torch::equal(y.narrow(0, 48, 5), torch::zeros({5})));
  }
  // Multiples of a power-of-two scale are represented exactly.
  auto exact = torch::arange(-127, 128, torch::kFloat) * 0.25f;
  EXPECT_TRUE(torch::equal(dequantize_blocks(quantize_blocks(exact, 255, 8)), exact));
}

TEST(BlockQuantization, OneElementAndPartialBlocks) {
  for (int bits : {8, 4}) {
    auto one = torch::tensor({-0.3f});
    auto q = quantize_blocks(one, 2048, bits);
    EXPECT_EQ(q.data.numel(), 1);
    EXPECT_EQ(q.scales.numel(), 1);
    EXPECT_FLOAT_EQ(dequantize_blocks(q)[0].item<float>(), -0.3f);
    // 5 elements in blocks of 2: three blocks, the last of one element; int4 packs 3 bytes.
    auto five = torch::tensor({1.0f, -2.0f, 0.5f, 0.25f, -4.0f});
    q = quantize_blocks(five, 2, bits);
    EXPECT_EQ(q.scales.numel(), 3);
    EXPECT_EQ(q.data.numel(), bits == 8 ? 5 : 3);
    EXPECT_FLOAT_EQ(dequantize_blocks(q)[4].item<float>(), -4.0f);
  }
}

TEST(BlockQuantization, ANonFiniteElementMakesItsBlockNaNAndLeavesTheOthers) {
  auto x = edge_data(6);
  x[17] = std::numeric_limits<float>::infinity();
  x[70] = std::nanf("");
  for (int bits : {8, 4}) {
    const auto y = dequantize_blocks(quantize_blocks(x, 16, bits));
    EXPECT_TRUE(y.narrow(0, 16, 16).isnan().all().item<bool>()) << "the block with the inf";
    EXPECT_TRUE(y.narrow(0, 64, 16).isnan().all().item<bool>()) << "the block with the NaN";
    EXPECT_TRUE(y.narrow(0, 0, 16).isfinite().all().item<bool>());
    EXPECT_TRUE(y.narrow(0, 32, 32).isfinite().all().item<bool>());
  }
}

TEST(BlockQuantization, Bf16ScalesAreNeverBelowTheFp32Ones) {
  // Maxima whose fp32 scale falls between two bf16 values: rounding to nearest would go
  // below for some, and push |x| / scale past qmax.
  auto x = torch::zeros({64 * 4});
  for (int64_t b = 0; b < 64; ++b) x[b * 4] = 1.0f + static_cast<float>(b) / 97.0f;
  const auto q32 = quantize_blocks(x, 4, 8, at::kFloat);
  const auto q16 = quantize_blocks(x, 4, 8, at::kBFloat16);
  EXPECT_EQ(q16.scales.scalar_type(), at::kBFloat16);
  EXPECT_TRUE((q16.scales.to(at::kFloat) >= q32.scales).all().item<bool>());
  int64_t rounded_up = 0;
  for (int64_t b = 0; b < 64; ++b)
    rounded_up += q16.scales[b].item<float>() > q32.scales[b].item<float>();
  EXPECT_GT(rounded_up, 0) << "the data must reach the case where rounding goes up";
  expect_within_half_scale(x, 4, 8, at::kBFloat16);
}

TEST(BlockQuantization, BytesOnTheWireAreTheDataAndTheScales) {
  for (int64_t n : {int64_t{1}, int64_t{2047}, int64_t{2048}, int64_t{2049}, int64_t{10000}}) {
    for (int bits : {8, 4}) {
      for (auto sd : {at::kFloat, at::kBFloat16}) {
        const auto q = quantize_blocks(torch::randn({n}), 2048, bits, sd);
        EXPECT_EQ(quantized_bytes(n, 2048, bits, sd),
                  static_cast<int64_t>(q.data.nbytes() + q.scales.nbytes()))
            << n << " elements, " << bits << " bits";
      }
    }
  }
  EXPECT_EQ(quantized_bytes(2048, 2048, 8, at::kFloat), 2048 + 4);
  EXPECT_EQ(quantized_bytes(4097, 2048, 4, at::kBFloat16), 2049 + 3 * 2);
}

TEST(BlockQuantization, BadArgumentsNameTheValue) {
  auto error = [](auto fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("<no error>");
  };
  EXPECT_NE(error([] {
              quantize_blocks(torch::ones({4}), 0, 8);
            }).find("block=0 must be at least 1 element"),
            std::string::npos);
  EXPECT_NE(error([] { quantize_blocks(torch::ones({4}), 2, 2); }).find("bits=2 must be 8 or 4"),
            std::string::npos);
  EXPECT_NE(error([] {
              quantize_blocks(torch::ones({2, 2}), 2, 8);
            }).find("a 1-D floating tensor is quantized, got 2 dimension(s)"),
            std::string::npos);
  EXPECT_NE(error([] {
              quantize_blocks(torch::ones({4}), 2, 8, at::kHalf);
            }).find("scales are kFloat or kBFloat16"),
            std::string::npos);
  // The collectives, on the single process's group: sizes and the spec before any message.
  auto single = fsdp::detail::make_single_backend();
  auto& one = *single;
  const fsdp::detail::QuantizeSpec spec{2, 8, at::kFloat};
  EXPECT_NE(error([&] {
              fsdp::detail::quantized_all_gather(one, torch::empty({3}), torch::ones({2}), spec);
            }).find("quantized_all_gather: full has 3 elements, not 1 x 2"),
            std::string::npos);
  EXPECT_NE(error([&] {
              fsdp::detail::quantized_reduce_scatter(one, torch::ones({3}), torch::empty({2}),
                                                     spec);
            }).find("quantized_reduce_scatter: full has 3 elements, not 1 x 2"),
            std::string::npos);
  EXPECT_NE(error([&] {
              fsdp::detail::quantized_reduce_scatter(one, torch::ones({2}), torch::empty({2}),
                                                     {2, 3, at::kFloat});
            }).find("bits=3 must be 8 or 4"),
            std::string::npos);
  EXPECT_NE(error([&] {
              fsdp::detail::hierarchical_quantized_reduce_scatter(one, one, torch::ones({3}),
                                                                  torch::empty({2}), spec);
            }).find("full has 3 elements, not 1 x 1 x 2"),
            std::string::npos);
  EXPECT_NE(error([&] {
              fsdp::detail::quantized_all_reduce(one, torch::ones({2, 2}), spec);
            }).find("quantized_all_reduce: a 1-D floating tensor, got 2 dimension(s)"),
            std::string::npos);
}

// ---- Note [Quantized collectives], over Gloo at worlds 2 to 4 -------------------------

namespace {

// Rank r's data of n elements: its own seed, with a block of zeros and a large element
// placed on purpose.
torch::Tensor rank_data(int r, int64_t n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 + r);
  auto x = torch::randn({n}, g);
  if (n >= 8) x.narrow(0, 0, 4).zero_();
  x[n - 1] = 5.0f + static_cast<float>(r);
  return x;
}

fsdp::detail::Backend& backend(const fsdp::ProcessGroup& pg) {
  return *fsdp::detail::GroupAccess::backend(pg);
}

}  // namespace

// qwZ: every rank gets every shard as its quantization dequantized (its own too), each
// element within half its block's scale of the value, and sends (N - 1) quantized shards;
// with shards of 1 element and of 1000 (blocks of 64: a partial last block).
TEST(QuantizedCollectives, AllGatherGivesEveryRankTheSameDequantizedShards) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](const fsdp::ProcessGroup& pg) {
      for (int64_t part : {int64_t{1}, int64_t{1000}}) {
        for (int bits : {8, 4}) {
          auto full = torch::empty({world * part});
          int64_t sent = -1;
          fsdp::detail::quantized_all_gather(backend(pg), full, rank_data(pg.rank(), part),
                                             {64, bits, at::kBFloat16}, &sent)
              ->wait();
          EXPECT_EQ(sent, (world - 1) * quantized_bytes(part, 64, bits, at::kBFloat16));
          for (int r = 0; r < world; ++r) {
            const auto want =
                dequantize_blocks(quantize_blocks(rank_data(r, part), 64, bits, at::kBFloat16));
            EXPECT_TRUE(torch::equal(full.narrow(0, r * part, part), want))
                << "rank " << r << "'s part, " << part << " elements, " << bits << " bits";
          }
        }
      }
    });
  }
}

// qgZ: rank j's chunk is the sum, in fp32 and rank order, of its own part as it is and
// the others' parts dequantized; the same twice; within the sum of the parts' half
// scales of the exact sum; (N - 1) quantized chunks sent; chunks of 1 element too.
TEST(QuantizedCollectives, ReduceScatterSumsTheDequantizedPartsInRankOrder) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](const fsdp::ProcessGroup& pg) {
      for (int64_t chunk : {int64_t{1}, int64_t{1000}}) {
        for (int bits : {8, 4}) {
          const int me = pg.rank();
          auto shard = torch::empty({chunk});
          int64_t sent = -1;
          fsdp::detail::quantized_reduce_scatter(backend(pg), rank_data(me, world * chunk), shard,
                                                 {64, bits, at::kFloat}, &sent)
              ->wait();
          EXPECT_EQ(sent, (world - 1) * quantized_bytes(chunk, 64, bits));
          auto want = torch::zeros({chunk});
          auto exact = torch::zeros({chunk});
          auto bound = torch::zeros({chunk});
          for (int r = 0; r < world; ++r) {
            const auto part = rank_data(r, world * chunk).narrow(0, me * chunk, chunk);
            const auto q = quantize_blocks(part.contiguous(), 64, bits);
            want.add_(r == me ? part : dequantize_blocks(q));
            exact.add_(part);
            if (r != me) bound.add_(q.scales.repeat_interleave(64).narrow(0, 0, chunk) / 2);
          }
          EXPECT_TRUE(torch::equal(shard, want)) << chunk << " elements, " << bits << " bits";
          EXPECT_TRUE(((shard - exact).abs() <= bound * (1 + 1e-5) + 1e-6).all().item<bool>());
          auto again = torch::empty({chunk});
          fsdp::detail::quantized_reduce_scatter(backend(pg), rank_data(me, world * chunk), again,
                                                 {64, bits, at::kFloat})
              ->wait();
          EXPECT_TRUE(torch::equal(again, shard)) << "deterministic";
        }
      }
    });
  }
}

// ZeRO++'s hierarchical qgZ at world 4 as 2 hosts of 2 (and as 4 hosts of 1, and 1 of 4):
// rank h*k + l gets, from a reference built here from quantize_blocks alone, its chunk:
// inside its host, the m chunks its outer group owns quantized as one part per sender and
// summed in fp32 in local order (its own as it is), then across hosts each of those
// partial sums quantized per chunk and summed in host order. Within the bound of the exact
// sum; the same twice; what crosses hosts is (m - 1) quantized chunks; chunks of 1 element.
TEST(QuantizedCollectives, HierarchicalReduceScatterReducesInsideThenAcrossHosts) {
  run_ranks(4, [](const fsdp::ProcessGroup& pg) {
    for (int k : {2, 1, 4}) {
      const int m = 4 / k, me = pg.rank(), h = me / k, l = me % k;
      std::vector<std::vector<int>> inner_groups(m), outer_groups(k);
      for (int r = 0; r < 4; ++r) {
        inner_groups[r / k].push_back(r);
        outer_groups[r % k].push_back(r);
      }
      auto inner = backend(pg).split(inner_groups);
      auto outer = backend(pg).split(outer_groups);
      for (int64_t c : {int64_t{1}, int64_t{300}}) {
        const fsdp::detail::QuantizeSpec spec{64, 8, at::kFloat};
        auto q = [&](const torch::Tensor& x) {
          return dequantize_blocks(quantize_blocks(x.contiguous(), 64, 8));
        };
        // Rank r's contribution to the chunks local index l owns, h' = 0..m-1.
        auto owned_by = [&](int r, int local) {
          return rank_data(r, 4 * c).view({m, k, c}).select(1, local).reshape({-1});
        };
        auto partial_of = [&](int host, int local) {  // fp32, m * c elements
          auto acc = torch::zeros({m * c});
          for (int j = 0; j < k; ++j) {
            const auto x = owned_by(host * k + j, local);
            acc.add_(j == local ? x : q(x));
          }
          return acc;
        };
        auto want = torch::zeros({c});
        auto exact = torch::zeros({c});
        for (int hh = 0; hh < m; ++hh) {
          const auto chunk = partial_of(hh, l).narrow(0, h * c, c);
          want.add_(hh == h ? chunk : q(chunk));
        }
        for (int r = 0; r < 4; ++r) exact.add_(rank_data(r, 4 * c).narrow(0, me * c, c));
        auto shard = torch::empty({c});
        int64_t wire = -1, across = -1;
        fsdp::detail::hierarchical_quantized_reduce_scatter(*inner, *outer, rank_data(me, 4 * c),
                                                            shard, spec, &wire, &across)
            ->wait();
        EXPECT_TRUE(torch::allclose(shard, want, 0, 0)) << "k=" << k << ", c=" << c;
        EXPECT_LT((shard - exact).abs().max().item<float>(), 0.2f) << "k=" << k << ", c=" << c;
        EXPECT_EQ(across, (m - 1) * quantized_bytes(c, 64, 8));
        EXPECT_EQ(wire, across + (k - 1) * quantized_bytes(m * c, 64, 8));
        auto again = torch::empty({c});
        fsdp::detail::hierarchical_quantized_reduce_scatter(*inner, *outer, rank_data(me, 4 * c),
                                                            again, spec)
            ->wait();
        EXPECT_TRUE(torch::equal(again, shard)) << "deterministic";
      }
    }
  });
}

// A quantized all-reduce leaves every rank with the same values, within the quantization
// bound of the exact sum, for lengths that do not divide by the world (padding), 1 too.
TEST(QuantizedCollectives, AllReduceAgreesOnEveryRank) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](const fsdp::ProcessGroup& pg) {
      for (int64_t n : {int64_t{1}, int64_t{1001}}) {
        auto x = rank_data(pg.rank(), n);
        auto exact = torch::zeros({n});
        for (int r = 0; r < world; ++r) exact.add_(rank_data(r, n));
        const int64_t sent =
            fsdp::detail::quantized_all_reduce(backend(pg), x, {64, 8, at::kFloat});
        EXPECT_GT(sent, 0);
        auto all = torch::empty({world * n});
        backend(pg).all_gather(all, x)->wait();
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(torch::equal(all.narrow(0, r * n, n), x)) << "rank " << r << " differs";
        }
        EXPECT_LT((x - exact).abs().max().item<float>(), 0.3f);
      }
    });
  }
}

// Note [Quantization faults]: with scales off by one block, a dequantized tensor leaves the
// bound (so the accuracy checks of the engine's tests can fail), and without it comes back.
TEST(BlockQuantization, TheScaleFaultBreaksTheBound) {
  const auto x = edge_data(8);
  const auto q = quantize_blocks(x, 16, 8);
  fsdp::detail::set_quantization_fault(fsdp::detail::QuantizationFault::kScalesOffByOneBlock);
  const auto broken = dequantize_blocks(q);
  fsdp::detail::set_quantization_fault(fsdp::detail::QuantizationFault::kNone);
  const auto fine = dequantize_blocks(q);
  EXPECT_GT((broken - x).abs().max().item<float>(), 1.0f);
  EXPECT_LT((fine - x).abs().max().item<float>(), 3.0f / 127);
}

// Note [Quantizing on the CPU]: the CPU's two loops give ATen's op chain's bits, scales and
// data, for every input dtype, 8 and 4 bits, fp32 and bf16 scales, blocks that split the
// int4 pairs (7), a partial last block, and blocks holding a NaN, an inf, zeros, a single
// nonzero element and values on rounding ties (k + 0.5 times the scale).
TEST(BlockQuantization, CpuLoopsGiveAtensBits) {
  auto x = edge_data(40);
  x[100] = NAN;
  x[140] = INFINITY;
  x[190] = -INFINITY;
  // Ties: a block of 16 whose largest element is 127 (scale 1 at 8 bits): k + 0.5.
  x.narrow(0, 208, 16).copy_(torch::arange(16).to(torch::kFloat) * 3.0f - 20.5f);
  x[223] = 127.0f;
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const auto xt = x.to(dtype);
    for (int64_t block : {int64_t{16}, int64_t{7}, int64_t{2048}}) {
      for (int bits : {8, 4}) {
        for (auto sd : {at::kFloat, at::kBFloat16}) {
          const auto fast = quantize_blocks(xt, block, bits, sd);
          const auto ref = fsdp::detail::quantize_blocks_aten(xt, block, bits, sd);
          const std::string what = std::string(c10::toString(dtype)) + ", block " +
                                   std::to_string(block) + ", " + std::to_string(bits) + " bits";
          EXPECT_TRUE(torch::equal(fast.data, ref.data)) << what;
          EXPECT_TRUE(torch::equal(fast.scales.isnan(), ref.scales.isnan())) << what;
          EXPECT_TRUE(torch::equal(fast.scales.nan_to_num(0), ref.scales.nan_to_num(0))) << what;
        }
      }
    }
  }
}

}  // namespace test_quantize_cases
