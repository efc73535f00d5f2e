// Memory estimator (see include/fsdp/estimate.h).
#include <fsdp/estimate.h>

#include <algorithm>
#include <stdexcept>

namespace fsdp {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t padded(int64_t n, int g) { return (n + g - 1) / g * g; }

}  // namespace

int64_t MemoryEstimate::device_total() const {
  int64_t s = 0;
  for (const auto& t : terms) s += t.device_bytes;
  return s;
}

int64_t MemoryEstimate::host_total() const {
  int64_t s = 0;
  for (const auto& t : terms) s += t.host_bytes;
  return s;
}

const MemoryTerm& MemoryEstimate::term(const std::string& name) const {
  for (const auto& t : terms) {
    if (t.name == name) return t;
  }
  throw std::invalid_argument("no memory term '" + name + "'");
}

std::vector<int64_t> gpt_unit_params(int64_t n_layer, int64_t d_model, int64_t block_size, int64_t vocab_size) {
  const int64_t d = d_model;
  // Root: wte (V x d), wpe (block x d), ln_f (2d), lm_head (d x V, no bias).
  std::vector<int64_t> units = {vocab_size * d + block_size * d + 2 * d + d * vocab_size};
  // Block: ln1, ln2 (2d each), qkv (d x 3d + 3d), attn.proj (d x d + d), fc (d x 4d + 4d),
  // mlp.proj (4d x d + d).
  const int64_t block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  for (int64_t i = 0; i < n_layer; ++i) units.push_back(block);
  return units;
}

MemoryEstimate estimate_memory(const EstimateInput& in) {
  if (in.unit_params.empty()) bad("no parameters: give a GPT shape or --params N");
  for (int64_t n : in.unit_params) {
    if (n < 0) bad("a unit has " + std::to_string(n) + " parameters; counts must not be negative");
  }
  if (in.world_size < 1) bad("world size " + std::to_string(in.world_size) + " must be at least 1");
  if (in.max_gathered_units < 1) bad("max_gathered_units " + std::to_string(in.max_gathered_units) + " must be at least 1");
  int g = in.world_size;
  if (in.strategy == "none") {
    g = 1;
  } else if (in.strategy == "hybrid") {
    g = in.hybrid_group_size == 0 ? in.world_size : in.hybrid_group_size;
    if (g < 1 || in.world_size % g != 0) {
      bad("hybrid group size " + std::to_string(in.hybrid_group_size) + " must divide the world size " +
          std::to_string(in.world_size));
    }
  } else if (in.strategy != "full" && in.strategy != "grad_op") {
    bad("strategy '" + in.strategy + "' is unknown; use full, grad_op, none or hybrid");
  }
  int64_t elem = 4;
  if (in.precision == "bf16" || in.precision == "fp16") {
    elem = 2;
  } else if (in.precision != "fp32") {
    bad("precision '" + in.precision + "' is unknown; use fp32, bf16 or fp16");
  }

  MemoryEstimate est;
  est.shard_group_size = g;
  int64_t shard_elems = 0, largest_shard = 0, root_full = 0, largest_full = 0, all_full = 0;
  for (size_t i = 0; i < in.unit_params.size(); ++i) {
    const int64_t p = padded(in.unit_params[i], g);
    est.total_params += in.unit_params[i];
    shard_elems += p / g;
    largest_shard = std::max(largest_shard, p / g);
    all_full += p;
    if (i == 0) root_full = p;
    else largest_full = std::max(largest_full, p);
  }
  // Model state: fp32 shard, fp32 gradient shard, Adam m and v (fp32), per rank.
  const int64_t params = 4 * shard_elems, grads = 4 * shard_elems, optim = 8 * shard_elems;
  const bool host = in.cpu_offload;
  est.terms.push_back({"parameters (fp32 shards)", host ? 0 : params, host ? params : 0});
  est.terms.push_back({"gradients (fp32 shards)", host ? 0 : grads, host ? grads : 0});
  est.terms.push_back({"optimizer state (Adam m, v)", host ? 0 : optim, host ? optim : 0});

  // Gathered units in param_dtype: the root stays gathered through the iteration, plus
  // at most max_gathered_units non-root units (Note [Prefetch bound]); SHARD_GRAD_OP
  // keeps every unit gathered from forward to backward. A group of one in fp32 without
  // offload computes on the shard itself (Note [Group of one]): nothing is gathered.
  int64_t gathered = 0;
  if (!(g == 1 && elem == 4 && !in.cpu_offload)) {
    gathered = in.strategy == "grad_op"
                   ? all_full * elem
                   : (root_full + static_cast<int64_t>(in.max_gathered_units) * largest_full) * elem;
  }
  est.terms.push_back({"gathered units (" + in.precision + ")", gathered, 0});
  if (in.cpu_offload) {
    // A shard in transit to the gather (two gathers may be in flight) and a gradient
    // shard on its way back (MemoryStats::offload_buffers).
    est.terms.push_back({"offload transit buffers", 2 * largest_shard * elem + 4 * largest_shard, 0});
  }

  int64_t act = 0;
  if (in.n_layer > 0 && in.micro_batch > 0) {
    // Per block, bytes at 2-byte precision: s*b*h*(34 + 5*a*s/h) (Korthikanti et al.,
    // "Reducing Activation Recomputation in Large Transformer Models", 2022), scaled to
    // the compute precision; with checkpointing, each block keeps its input and one
    // block's activations exist at a time. Plus logits and their gradient in fp32.
    const double s = static_cast<double>(in.block_size), b = static_cast<double>(in.micro_batch);
    const double h = static_cast<double>(in.d_model), a = static_cast<double>(in.n_head);
    const double per_block = s * b * h * (34.0 + 5.0 * a * s / h) * (static_cast<double>(elem) / 2.0);
    const double input = s * b * h * static_cast<double>(elem);
    const double blocks = in.activation_checkpointing ? static_cast<double>(in.n_layer) * input + per_block
                                                      : static_cast<double>(in.n_layer) * per_block;
    const double logits = 2.0 * s * b * static_cast<double>(in.vocab_size) * 4.0;
    act = static_cast<int64_t>(blocks + logits);
  }
  est.terms.push_back({std::string("activations") + (in.activation_checkpointing ? " (checkpointed)" : ""), act, 0});
  return est;
}

}  // namespace fsdp
