// Memory estimator (see include/fsdp/estimate.h). Every rule below mirrors a place in
// the engine; the comments name it, so that a change there shows what to change here.
#include <fsdp/estimate.h>

#include <algorithm>
#include <functional>
#include <stdexcept>

namespace fsdp {
namespace {

// Messages name the command-line flag too: fsdp-estimate passes them on as they are.
[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t round_up(int64_t n, int64_t g) { return (n + g - 1) / g * g; }

// Ranks each flat parameter is split over (src/engine/fully_shard.cpp: FULL_SHARD and
// SHARD_GRAD_OP shard over the world, HYBRID_SHARD within groups, NO_SHARD not at all).
int shard_group_size(const EstimateInput& in) {
  switch (in.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
    case ShardingStrategy::kZero2:
    case ShardingStrategy::kZero1:
      return in.world_size;
    case ShardingStrategy::kNoShard:
      return 1;
    case ShardingStrategy::kHybridShard: {
      const int g = in.hybrid_group_size == 0 ? in.world_size : in.hybrid_group_size;
      if (g < 1 || in.world_size % g != 0) {
        bad("--hybrid-group-size " + std::to_string(in.hybrid_group_size) +
            " is invalid; it must divide the world size " + std::to_string(in.world_size) +
            " (e.g. the ranks per node), or be 0 for the whole world");
      }
      return g;
    }
  }
  bad("strategy " + std::to_string(static_cast<int>(in.strategy)) +
      " is not a ShardingStrategy; use one of its enumerators");
}

// Bytes per element of the gathered parameters and reduced gradients.
int64_t precision_bytes(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return 4;
    case Precision::kBf16:
    case Precision::kFp16:
      return 2;
  }
  bad("precision " + std::to_string(static_cast<int>(precision)) +
      " is not a Precision; use one of its enumerators");
}

void require_positive(const char* flag, int64_t v) {
  if (v <= 0) bad(std::string(flag) + " " + std::to_string(v) + " is invalid; it must be positive");
}

void validate(const EstimateInput& in) {
  if (in.unit_params.empty()) {
    bad("no model given; give a GPT shape (--n-layer --n-head --d-model --block-size) or --params "
        "N");
  }
  for (int64_t n : in.unit_params) {
    if (n < 0)
      bad("a unit of " + std::to_string(n) + " parameters is invalid; counts must not be negative");
  }
  if (in.world_size < 1)
    bad("--world-size " + std::to_string(in.world_size) + " is invalid; it must be at least 1");
  if (in.max_gathered_units < 1) {
    bad("--max-gathered-units " + std::to_string(in.max_gathered_units) +
        " is invalid; it must be at least 1 (the unit that computes)");
  }
  const TransformerShape& a = in.activations;
  if (a.n_layer > 0) {
    require_positive("--n-head", a.n_head);
    require_positive("--d-model", a.d_model);
    require_positive("--block-size", a.block_size);
    require_positive("--vocab-size", a.vocab_size);
    if (a.d_model % a.n_head != 0) {
      bad("--d-model " + std::to_string(a.d_model) + " is not divisible by --n-head " +
          std::to_string(a.n_head) + "; pick a width that is a multiple of the head count");
    }
  }
  if (a.micro_batch < 0)
    bad("--micro-batch " + std::to_string(a.micro_batch) + " is invalid; it must not be negative");
  const int k = in.reshard_after_forward_group_size;
  if (k != 0) {
    const int group = shard_group_size(in);
    const bool sharded = in.strategy == ShardingStrategy::kFullShard ||
                         in.strategy == ShardingStrategy::kHybridShard;
    if (!sharded || k <= 1 || k >= group || group % k != 0) {
      bad("--reshard-after-forward-group-size " + std::to_string(k) +
          " must divide the shard group size " + std::to_string(group) +
          " and lie strictly between 1 and it, under --strategy full or hybrid (e.g. the number "
          "of ranks per node); 0 reshards to the whole shard group");
    }
  }
}

// The unit sizes the engine allocates with, per rank.
struct Layout {
  int group = 1;
  std::vector<int64_t> padded;  ///< FlatParam::padded_numel, root first
  std::vector<int64_t> shard;   ///< FlatParam::shard_numel
};

Layout layout_of(const EstimateInput& in, int group) {
  Layout l;
  l.group = group;
  for (int64_t n : in.unit_params) {
    l.padded.push_back(round_up(n, group));
    l.shard.push_back(l.padded.back() / group);
  }
  return l;
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// Sum of the k largest non-root entries (index 0 is the root).
int64_t largest_non_root(const std::vector<int64_t>& v, int k) {
  std::vector<int64_t> rest(v.begin() + 1, v.end());
  std::sort(rest.begin(), rest.end(), std::greater<int64_t>());
  rest.resize(std::min(rest.size(), static_cast<size_t>(k)));
  return sum(rest);
}

// Note [Group of one] (src/engine/flat_param.cpp): with a group of one, fp32 compute and no
// offload, the views point into the shard itself; nothing is gathered.
bool aliased(const EstimateInput& in, int group, int64_t elem) {
  return group == 1 && elem == 4 && !in.cpu_offload;
}

// ... and at world size 1 gradients accumulate straight into the gradient shard: no
// unsharded flat gradient to reduce.
bool direct_grads(const EstimateInput& in, int group, int64_t elem) {
  return aliased(in, group, elem) && in.world_size == 1;
}

// Full parameters held at once, in elements. Runtime::reshard_after_forward frees
// non-root units after forward only under FULL_SHARD and HYBRID_SHARD; the root stays
// gathered through backward. Under SHARD_GRAD_OP and NO_SHARD every unit is gathered
// at the end of forward. Otherwise Note [Prefetch bound] (src/engine/runtime.cpp) keeps at
// most max_gathered_units non-root units gathered, the computing one included.
int64_t gathered_elems(const EstimateInput& in, const Layout& l, int64_t elem) {
  if (aliased(in, l.group, elem)) return 0;
  if (in.strategy == ShardingStrategy::kShardGradOp || in.strategy == ShardingStrategy::kNoShard)
    return sum(l.padded);
  return l.padded[0] + largest_non_root(l.padded, in.max_gathered_units);
}

bool reshards_after_forward(const EstimateInput& in) {
  return in.strategy == ShardingStrategy::kFullShard ||
         in.strategy == ShardingStrategy::kHybridShard;
}

// Shard elements whose gathers can be in flight at once (FlatParam::gather holds a
// param_dtype copy of the shard until the all-gather is waited on): the root's alone,
// or up to k prefetched non-root units.
int64_t in_flight_shards(const Layout& l, int k) {
  return k < 1 ? 0 : std::max(l.shard[0], largest_non_root(l.shard, k));
}

// Prefetched gathers in flight during backward: the unit computing now is waited on,
// so at most max_gathered_units - 1 more. Under SHARD_GRAD_OP and NO_SHARD every unit is
// still gathered from forward, and there is nothing to prefetch.
int backward_prefetches(const EstimateInput& in) {
  return reshards_after_forward(in) ? in.max_gathered_units - 1 : 0;
}

// MemoryStats::comm_buffers, the larger of two moments. Forward (with mixed precision
// and no offload): each gather in flight holds its shard cast to param_dtype, up to
// max_gathered_units prefetches issued from the root. Backward: a unit's unsharded flat
// gradient (reduce dtype, padded) lives from its first parameter gradient to its
// reduce-scatter's end: the root's for the whole backward (its embeddings get theirs
// last), that of the unit computing now and that of the unit before it, whose
// reduce-scatter overlaps this one's compute (Note [Overlapped reduction] in
// src/engine/flat_param.cpp), besides the casts of the units prefetched meanwhile.
int64_t comm_buffer_bytes(const EstimateInput& in, const Layout& l, int64_t elem) {
  const bool casts = elem != 4 && !in.cpu_offload;
  const int64_t forward = casts ? in_flight_shards(l, in.max_gathered_units) * elem : 0;
  int64_t backward = 0;
  if (!direct_grads(in, l.group, elem))
    backward += (l.padded[0] + largest_non_root(l.padded, 2)) * elem;
  if (casts) backward += largest_non_root(l.shard, backward_prefetches(in)) * elem;
  return std::max(forward, backward);
}

// MemoryStats::offload_buffers, on the device: the copy (param_dtype) of each shard in
// transit to its gather, counted as above.
int64_t offload_device_bytes(const EstimateInput& in, const Layout& l, int64_t elem) {
  const int64_t forward = in_flight_shards(l, in.max_gathered_units) * elem;
  const int64_t backward = largest_non_root(l.shard, backward_prefetches(in)) * elem;
  return std::max(forward, backward);
}

// MemoryStats::offload_buffers, on the host: gradient shards (fp32) back from the device
// that wait to be added into existing gradients, at most two units' at a time (Note
// [Offload transfers] in src/engine/transfers.h).
int64_t offload_host_bytes(const Layout& l) {
  return 2 * 4 * *std::max_element(l.shard.begin(), l.shard.end());
}

// Activations of one rank's micro-batch, rough: per block s*b*h*(34 + 5*a*s/h) bytes at
// 2-byte precision (Korthikanti et al., "Reducing Activation Recomputation in Large
// Transformer Models", 2022, without tensor parallelism), scaled to the compute dtype.
// With checkpointing every block keeps only its input, and one block is recomputed at a
// time. Plus the logits and their gradient in fp32 (s*b*V*4 each).
int64_t activation_bytes(const EstimateInput& in, int64_t elem) {
  const TransformerShape& m = in.activations;
  if (m.n_layer == 0 || m.micro_batch == 0) return 0;
  const double s = static_cast<double>(m.block_size), b = static_cast<double>(m.micro_batch);
  const double h = static_cast<double>(m.d_model), a = static_cast<double>(m.n_head);
  const double scale = static_cast<double>(elem) / 2.0;
  const double per_block = s * b * h * (34.0 + 5.0 * a * s / h) * scale;
  const double block_input = s * b * h * static_cast<double>(elem);
  const double layers = static_cast<double>(m.n_layer);
  const double blocks =
      in.activation_checkpointing ? layers * block_input + per_block : layers * per_block;
  const double logits = 2.0 * s * b * static_cast<double>(m.vocab_size) * 4.0;
  return static_cast<int64_t>(blocks + logits);
}

// A term that lives on the host under cpu_offload and on the device otherwise.
MemoryTerm model_state(const std::string& key, const std::string& label, int64_t bytes,
                       bool offload) {
  return {key, label, "exact", offload ? 0 : bytes, offload ? bytes : 0};
}

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

int64_t MemoryEstimate::model_states_device() const {
  int64_t s = 0;
  for (const char* k : {"parameters", "gradients", "optimizer_state", "gathered_units"})
    s += term(k).device_bytes;
  return s;
}

int64_t MemoryEstimate::model_states_host() const {
  int64_t s = 0;
  for (const char* k : {"parameters", "gradients", "optimizer_state", "gathered_units"})
    s += term(k).host_bytes;
  return s;
}

const MemoryTerm& MemoryEstimate::term(const std::string& key) const {
  for (const auto& t : terms) {
    if (t.key == key) return t;
  }
  throw std::invalid_argument("no memory term '" + key + "'");
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "unknown";
}

MemoryEstimate estimate_memory(const EstimateInput& in) {
  validate(in);
  const int group = shard_group_size(in);
  const int64_t elem = precision_bytes(in.precision);
  const Layout l = layout_of(in, group);

  MemoryEstimate est;
  est.shard_group_size = group;
  est.total_params = sum(in.unit_params);
  est.largest_unit_params = *std::max_element(in.unit_params.begin(), in.unit_params.end());

  // Model state per rank, fp32 whatever the precision: the master shard
  // (MemoryStats::sharded_params), its gradient (grad_shards) and AdamW's exp_avg and
  // exp_avg_sq, which torch::optim::AdamW and FusedAdamW build shaped like the shard.
  const int64_t shard_elems = sum(l.shard);
  est.terms.push_back(
      model_state("parameters", "parameters (fp32 shards)", 4 * shard_elems, in.cpu_offload));
  est.terms.push_back(
      model_state("gradients", "gradients (fp32 shards)", 4 * shard_elems, in.cpu_offload));
  est.terms.push_back(model_state("optimizer_state", "optimizer state (AdamW m, v)",
                                  8 * shard_elems, in.cpu_offload));

  est.terms.push_back({"gathered_units",
                       std::string("gathered units (") + to_string(in.precision) + ")", "bound",
                       gathered_elems(in, l, elem) * elem, 0});
  // hpZ (Note [Post-forward slices]): between a training forward and its backward every
  // non-root unit keeps 1/k of its padded flat parameter in param_dtype.
  if (in.reshard_after_forward_group_size > 1) {
    int64_t slices = 0;
    for (size_t i = 1; i < l.padded.size(); ++i) {
      slices += l.padded[i] / in.reshard_after_forward_group_size;
    }
    est.terms.push_back(
        {"post_forward_slices",
         "post-forward slices (hpZ, k=" + std::to_string(in.reshard_after_forward_group_size) + ")",
         "bound", slices * elem, 0});
  }
  est.terms.push_back({"comm_buffers", "reduce/cast buffers (backward)", "bound",
                       comm_buffer_bytes(in, l, elem), 0});
  if (in.cpu_offload) {
    est.terms.push_back({"offload_buffers", "offload transit buffers", "bound",
                         offload_device_bytes(in, l, elem), offload_host_bytes(l)});
  }
  std::string act_label = "activations";
  if (in.activations.n_layer == 0 || in.activations.micro_batch == 0) {
    act_label += " (no model shape given)";
  } else if (in.activation_checkpointing) {
    act_label += " (checkpointed)";
  }
  est.terms.push_back({"activations", act_label, "rough", activation_bytes(in, elem), 0});
  // Construction peaks (per rank; docs/design.md, "Sharded construction").
  int64_t largest_other = 0;
  for (size_t i = 1; i < in.unit_params.size(); ++i) {
    largest_other = std::max(largest_other, in.unit_params[i]);
  }
  est.construction.push_back({"construction_eager", "construction, eager (fully_shard)", "bound", 0,
                              4 * est.total_params});
  MemoryTerm sharded = model_state("construction_sharded", "construction, sharded (make_sharded)",
                                   4 * shard_elems, in.cpu_offload);
  sharded.basis = "bound";
  sharded.host_bytes += 4 * (in.unit_params[0] + largest_other);
  est.construction.push_back(sharded);
  return est;
}

}  // namespace fsdp
