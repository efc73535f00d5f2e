// Memory estimator (see include/fsdp/estimate.h). Every rule below mirrors a place in
// the engine; the comments name it, so that a change there shows what to change here.
#include <fsdp/tools/estimate.h>

#include "rules.h"

#include <fsdp/core/options.h>

#include <algorithm>
#include <functional>
#include <stdexcept>

namespace fsdp {
namespace {

using estimate_rules::bad;
using estimate_rules::precision_bytes;
using estimate_rules::round_up;

// The options the rules read (src/core/options.h), as the estimator holds them.
core::Options core_options(const EstimateInput& in);

// Ranks each flat parameter is split over, as the engine splits them.
int shard_group_size(const EstimateInput& in) { return core::shard_group_size(core_options(in)); }

// DeepSpeed's offload_optimizer / offload_param as the engine resolves them: the legacy
// cpu_offload is both to the host.
struct Offload {
  OffloadDevice optimizer = OffloadDevice::kNone;
  OffloadDevice param = OffloadDevice::kNone;
  bool persistent = false;  ///< kZero2, kZero1: the full parameters stay on the device
  bool any() const { return optimizer != OffloadDevice::kNone; }
  // A param_dtype copy of every shard stays on the device (Note [Offload granularity]),
  // except under ZeRO-1/2, whose full parameters are gathered once per step anyway.
  bool device_copy() const { return any() && param == OffloadDevice::kNone && !persistent; }
};

// EstimateInput::cpu_offload, deprecated: read here only.
bool legacy_cpu_offload(const EstimateInput& in) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return in.cpu_offload;
#pragma GCC diagnostic pop
}

Offload offload_of(const EstimateInput& in) {
  const bool persistent =
      in.strategy == ShardingStrategy::kZero2 || in.strategy == ShardingStrategy::kZero1;
  if (legacy_cpu_offload(in)) return {OffloadDevice::kCpu, OffloadDevice::kCpu, persistent};
  return {in.offload_optimizer, in.offload_param, persistent};
}

bool reshards_after_forward(const EstimateInput& in) {
  return core::reshards_after_forward(in.strategy);
}

bool keeps_params(const EstimateInput& in) { return core::keeps_params(in.strategy); }

void require_positive(const char* flag, int64_t v) {
  core::check_positive(v, flag, core::Surface::kFlags);
}

core::Options core_options(const EstimateInput& in) {
  core::Options o;
  o.strategy = in.strategy;
  o.world_size = in.world_size;
  o.hybrid_group_size = in.hybrid_group_size;
  o.hpz_group_size = in.reshard_after_forward_group_size;
  o.offload_optimizer = in.offload_optimizer;
  o.offload_param = in.offload_param;
  o.cpu_offload = legacy_cpu_offload(in);
  o.nvme_buffer_bytes = in.nvme_buffer_bytes;
  o.param = o.reduce = in.precision;
  o.master = in.pure_bf16 ? Precision::kBf16 : Precision::kFp32;
  o.max_gathered_units = in.max_gathered_units;
  o.activation_checkpointing = in.activation_checkpointing;
  o.offload_activations = in.offload_activations;
  o.quantize_weights = in.quantized_weights;
  o.quantize_gradients = in.quantized_gradients;
  o.weight_bits = in.weight_bits;
  o.gradient_bits = in.gradient_bits;
  o.quantize_block = in.quantization_block;
  return o;
}

// The options' rules are the core's (in the flags' words: fsdp-estimate passes the
// messages on as they are); the model's shape and the nodes are the estimator's own.
void validate(const EstimateInput& in) {
  if (in.unit_params.empty()) {
    bad("no model given; give a GPT shape (--n-layer --n-head --d-model --block-size) or --params "
        "N");
  }
  for (int64_t n : in.unit_params) {
    if (n < 0)
      bad("a unit of " + std::to_string(n) + " parameters is invalid; counts must not be negative");
  }
  core::validate(core_options(in), core::Surface::kFlags);
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
  if (in.gpus_per_node < 0 || (in.gpus_per_node > 0 && in.world_size % in.gpus_per_node != 0)) {
    bad("--gpus-per-node " + std::to_string(in.gpus_per_node) +
        " is invalid; it must divide the world size " + std::to_string(in.world_size) +
        " (or be 0: every rank on one node)");
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
  return group == 1 && elem == 4 && !offload_of(in).any();
}

// At world size 1 without offload, gradients go straight into the gradient shard, in
// any compute dtype (Note [Group of one], Note [Gradients in the shard] in
// src/engine/grad_buffer.cpp): no unsharded flat gradient to reduce.
bool direct_grads(const EstimateInput& in) { return in.world_size == 1 && !offload_of(in).any(); }

// Full parameters held at once, in elements. Runtime::reshard_after_forward frees
// non-root units after forward only under FULL_SHARD and HYBRID_SHARD; the root stays
// gathered through backward. Under SHARD_GRAD_OP and NO_SHARD every unit is gathered
// at the end of forward; under ZeRO-1/2 every unit stays gathered between steps.
// Otherwise Note [Prefetch bound] (src/engine/runtime.cpp) keeps at most
// max_gathered_units non-root units gathered, the computing one included.
int64_t gathered_elems(const EstimateInput& in, const Layout& l, int64_t elem) {
  if (aliased(in, l.group, elem)) return 0;
  if (!reshards_after_forward(in)) return sum(l.padded);
  return l.padded[0] + largest_non_root(l.padded, in.max_gathered_units);
}

// Shard elements whose gathers can be in flight at once (FlatParam::gather holds a
// param_dtype copy of the shard until the all-gather is waited on): the root's alone,
// or up to k prefetched non-root units.
int64_t in_flight_shards(const Layout& l, int k) {
  return k < 1 ? 0 : std::max(l.shard[0], largest_non_root(l.shard, k));
}

// The gathers forward may have in flight at once: max_gathered_units, or every unit
// under ZeRO-1/2, whose prefetch bound is lifted (Note [Persistent parameters]).
int forward_in_flight(const EstimateInput& in, const Layout& l) {
  const bool persistent =
      in.strategy == ShardingStrategy::kZero2 || in.strategy == ShardingStrategy::kZero1;
  return persistent ? static_cast<int>(l.shard.size()) : in.max_gathered_units;
}

// Prefetched gathers in flight during backward: the unit computing now is waited on,
// so at most max_gathered_units - 1 more. Under SHARD_GRAD_OP and NO_SHARD every unit is
// still gathered from forward, and there is nothing to prefetch.
int backward_prefetches(const EstimateInput& in) {
  return reshards_after_forward(in) ? in.max_gathered_units - 1 : 0;
}

// MemoryStats::comm_buffers: the unsharded flat gradients of backward. A unit's
// (reduce dtype, padded) lives from its first parameter gradient to its reduce-scatter's
// end: the root's for the whole backward (its embeddings get theirs last), that of the
// unit computing now and that of the unit before it, whose reduce-scatter overlaps this
// one's compute (Note [Overlapped reduction] in src/engine/flat_param.cpp). A gather's
// cast to param_dtype writes the gathered buffer itself (Note [Gather in place]): no cast
// buffer. ZeRO-1's flat gradients are all held at the end of backward: they are the
// full_gradients term, not counted here again.
int64_t comm_buffer_bytes(const EstimateInput& in, const Layout& l, int64_t elem) {
  if (in.strategy == ShardingStrategy::kZero1) return 0;
  if (direct_grads(in)) return 0;
  return (l.padded[0] + largest_non_root(l.padded, 2)) * elem;
}

// ZeRO++ (Note [Quantized training]): what the quantized collectives hold besides the
// engine's counted buffers, on the device. qwZ: per gather in flight, the shard packed
// (int8 or int4 and fp32 scales) and the group's packed parts. qgZ: per reduction in
// flight (the unit's and the one before it, Note [Overlapped reduction]), the packed
// chunks sent and received, and the fp32 shard the sum lands in. Quantizing's own fp32
// temporaries (a shard's or a chunk's at a time) are left out: rough.
int64_t quantization_bytes(const EstimateInput& in, const Layout& l) {
  const auto packed = [&](int64_t elems, int bits) {
    const int64_t blocks = (elems + in.quantization_block - 1) / in.quantization_block;
    return (bits == 8 ? elems : (elems + 1) / 2) + 4 * blocks;
  };
  int64_t bytes = 0;
  if (in.quantized_weights) {
    const int64_t shard = in_flight_shards(l, forward_in_flight(in, l));
    bytes += (l.group + 1) * packed(shard, in.weight_bits);
  }
  if (in.quantized_gradients) {
    const int64_t shard = std::max(l.shard[0], largest_non_root(l.shard, 2));
    bytes += 2 * l.group * packed(shard, in.gradient_bits) + 4 * shard;
  }
  return bytes;
}

// MemoryStats::offload_buffers, on the device: the copy (param_dtype) of each shard in
// transit to its gather, counted as above. None without offload_param: the gathers read
// the device copy of the shard (device_param_shards).
int64_t offload_device_bytes(const EstimateInput& in, const Layout& l, int64_t elem) {
  if (offload_of(in).device_copy()) return 0;
  const int64_t forward = in_flight_shards(l, forward_in_flight(in, l)) * elem;
  const int64_t backward = largest_non_root(l.shard, backward_prefetches(in)) * elem;
  return std::max(forward, backward);
}

// FusedAdamW's slots with its state in files (src/optim/nvme_adamw.cpp, NvmeAdamState):
// OffloadConfig::buffer_bytes, and with offload_param nvme the parameters' buffer_bytes
// beside it (the masters, gradients and copies stream through the same slots: 18 bytes
// per element and 6 pages a slot, against 8 bytes). Three slots of a chunk no larger than
// the largest shard, rounded up (the engine's tensors are the shards, or segments of them
// under parameter groups: at most as large).
int64_t nvme_buffer_bytes(const EstimateInput& in, const Layout& l) {
  const int64_t largest = std::max<int64_t>(1, *std::max_element(l.shard.begin(), l.shard.end()));
  if (offload_of(in).param == OffloadDevice::kNvme) {
    const int64_t buffer = 2 * in.nvme_buffer_bytes;
    const int64_t chunk =
        std::min((buffer / 3 - 6 * 4096) / 18 / 2048 * 2048, (largest + 2047) / 2048 * 2048);
    return chunk > 0 ? 3 * (18 * chunk + 6 * 4096) : buffer;
  }
  const int64_t chunk =
      std::min(in.nvme_buffer_bytes / 24 / 1024 * 1024, (largest + 1023) / 1024 * 1024);
  return chunk > 0 ? 24 * chunk : in.nvme_buffer_bytes;
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
  // With offload_activations the block inputs are on the host (offloaded_activation_bytes).
  const double kept_inputs = in.offload_activations ? 0.0 : layers * block_input;
  const double blocks = in.activation_checkpointing ? kept_inputs + per_block : layers * per_block;
  const double logits = 2.0 * s * b * static_cast<double>(m.vocab_size) * 4.0;
  return static_cast<int64_t>(blocks + logits);
}

// ShardingOptions::offload_activations: every checkpointed block's input (s, b, h) in the
// compute dtype, in host memory from forward to backward (Note [Activation offload]).
int64_t offloaded_activation_bytes(const EstimateInput& in, int64_t elem) {
  const TransformerShape& m = in.activations;
  if (!in.offload_activations || m.n_layer == 0 || m.micro_batch == 0) return 0;
  return m.n_layer * m.block_size * m.micro_batch * m.d_model * elem;
}

// A model-state term on the device, the host or in NVMe files.
MemoryTerm model_state(const std::string& key, const std::string& label, int64_t bytes,
                       OffloadDevice where) {
  MemoryTerm t{key, label, "exact", 0, 0, 0};
  (where == OffloadDevice::kNone  ? t.device_bytes
   : where == OffloadDevice::kCpu ? t.host_bytes
                                  : t.nvme_bytes) = bytes;
  return t;
}

const char* const kModelStateKeys[] = {"parameters",          "gradients",      "optimizer_state",
                                       "device_param_shards", "gathered_units", "full_gradients"};

int64_t model_states(const MemoryEstimate& est, int64_t MemoryTerm::*column) {
  int64_t s = 0;
  for (const auto& t : est.terms) {
    for (const char* k : kModelStateKeys) {
      if (t.key == k) s += t.*column;
    }
  }
  return s;
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

int64_t MemoryEstimate::nvme_total() const {
  int64_t s = 0;
  for (const auto& t : terms) s += t.nvme_bytes;
  return s;
}

int64_t MemoryEstimate::model_states_device() const {
  return model_states(*this, &MemoryTerm::device_bytes);
}
int64_t MemoryEstimate::model_states_host() const {
  return model_states(*this, &MemoryTerm::host_bytes);
}
int64_t MemoryEstimate::model_states_nvme() const {
  return model_states(*this, &MemoryTerm::nvme_bytes);
}

const MemoryTerm& MemoryEstimate::term(const std::string& key) const {
  for (const auto& t : terms) {
    if (t.key == key) return t;
  }
  throw std::invalid_argument("no memory term '" + key + "'");
}

// The model-state terms of estimate_memory: masters, gradients, AdamW's moments, and the
// copies of the shards the gathers read (on the device with offload_optimizer alone, in
// files with offload_param nvme).
void add_model_states(MemoryEstimate& est, const EstimateInput& in, const Layout& l,
                      const Offload& off, int64_t elem) {
  // Model state per rank, fp32 whatever the precision: the master shard
  // (MemoryStats::sharded_params), its gradient (grad_shards) and AdamW's exp_avg and
  // exp_avg_sq, which torch::optim::AdamW and FusedAdamW build shaped like the shard.
  // offload_optimizer moves all three off the device (the AdamW state to files with nvme,
  // the masters and gradients to the host); offload_param nvme puts the masters, their
  // gradients and the optimizer's param_dtype copies in files (Note [NVMe parameters]).
  const int64_t shard_elems = sum(l.shard);
  const OffloadDevice host_side = off.any() ? OffloadDevice::kCpu : OffloadDevice::kNone;
  const OffloadDevice masters = off.param == OffloadDevice::kNvme ? off.param : host_side;
  // Pure bf16 (MixedPrecision::master_dtype): all three in bf16, half the bytes.
  const int64_t master = in.pure_bf16 ? 2 : 4;
  const std::string mdt = to_string(in.pure_bf16 ? Precision::kBf16 : Precision::kFp32);
  est.terms.push_back(
      model_state("parameters", "parameters (" + mdt + " shards)", master * shard_elems, masters));
  est.terms.push_back(
      model_state("gradients", "gradients (" + mdt + " shards)", master * shard_elems, masters));
  if (off.param == OffloadDevice::kNvme && elem < master) {
    est.terms.push_back(model_state("param_copies",
                                    std::string("param_dtype copies of the shards (") +
                                        to_string(in.precision) + ", for the gathers)",
                                    elem * shard_elems, OffloadDevice::kNvme));
  }
  est.terms.push_back(
      model_state("optimizer_state",
                  "optimizer state (AdamW m, v" + std::string(in.pure_bf16 ? ", bf16" : "") + ")",
                  2 * master * shard_elems, off.optimizer));
  // offload_optimizer alone: a param_dtype copy of each shard stays on the device, the
  // all-gathers' input, refreshed after each step (MemoryStats::device_param_shards).
  if (off.device_copy()) {
    est.terms.push_back(
        model_state("device_param_shards",
                    std::string("parameter shards on device (") + to_string(in.precision) + ")",
                    elem * shard_elems, OffloadDevice::kNone));
  }
}

MemoryEstimate estimate_memory(const EstimateInput& in) {
  validate(in);
  const int group = shard_group_size(in);
  const int64_t elem = precision_bytes(in.precision);
  const Layout l = layout_of(in, group);

  const Offload off = offload_of(in);
  MemoryEstimate est;
  est.shard_group_size = group;
  est.gpus_per_node = in.gpus_per_node == 0 ? in.world_size : in.gpus_per_node;
  est.nodes = in.world_size / est.gpus_per_node;
  est.total_params = sum(in.unit_params);
  est.largest_unit_params = *std::max_element(in.unit_params.begin(), in.unit_params.end());

  add_model_states(est, in, l, off, elem);

  // ZeRO-1/2: every unit's full parameters persist between steps: exact, not a bound.
  est.terms.push_back({"gathered_units",
                       std::string(keeps_params(in) ? "full parameters (" : "gathered units (") +
                           to_string(in.precision) + ")",
                       keeps_params(in) ? "exact" : "bound", gathered_elems(in, l, elem) * elem, 0,
                       0});
  // ZeRO-1: the full unsharded gradients (reduce dtype, padded), all held at the end of
  // backward, which reduces them (MemoryStats::comm_buffers' peak; DeepSpeed's 2Ψ
  // gradient term), besides the fp32 gradient shards.
  if (in.strategy == ShardingStrategy::kZero1) {
    est.terms.push_back({"full_gradients",
                         std::string("full gradients (") + to_string(in.precision) + ")", "exact",
                         direct_grads(in) ? 0 : sum(l.padded) * elem, 0, 0});
  }
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
         "bound", slices * elem, 0, 0});
  }
  est.terms.push_back(
      {"comm_buffers", "reduce buffers", "bound", comm_buffer_bytes(in, l, elem), 0, 0});
  if (in.quantized_weights || in.quantized_gradients) {
    est.terms.push_back({"quantization_buffers", "quantized communication (ZeRO++)", "rough",
                         quantization_bytes(in, l), 0, 0});
  }
  if (off.any()) {
    est.terms.push_back({"offload_buffers", "offload transit buffers", "bound",
                         offload_device_bytes(in, l, elem), offload_host_bytes(l), 0});
  }
  if (off.optimizer == OffloadDevice::kNvme) {
    est.terms.push_back(
        {"nvme_buffers", "NVMe chunks in flight", "bound", 0, nvme_buffer_bytes(in, l), 0});
  }
  std::string act_label = "activations";
  if (in.activations.n_layer == 0 || in.activations.micro_batch == 0) {
    act_label += " (no model shape given)";
  } else if (in.activation_checkpointing) {
    act_label += " (checkpointed)";
  }
  if (in.offload_activations) act_label += ", inputs offloaded";
  est.terms.push_back({"activations", act_label, "rough", activation_bytes(in, elem),
                       offloaded_activation_bytes(in, elem), 0});
  // Construction peaks (per rank; docs/design.md, "Sharded construction"): make_sharded
  // writes the fp32 masters where the parameters term keeps them.
  const int64_t shard_elems = sum(l.shard);
  const OffloadDevice masters = off.param == OffloadDevice::kNvme ? off.param
                                : off.any()                       ? OffloadDevice::kCpu
                                                                  : OffloadDevice::kNone;
  int64_t largest_other = 0;
  for (size_t i = 1; i < in.unit_params.size(); ++i) {
    largest_other = std::max(largest_other, in.unit_params[i]);
  }
  est.construction.push_back({"construction_eager", "construction, eager (fully_shard)", "bound", 0,
                              4 * est.total_params, 0});
  MemoryTerm sharded = model_state("construction_sharded", "construction, sharded (make_sharded)",
                                   4 * shard_elems, masters);
  sharded.basis = "bound";
  sharded.host_bytes += 4 * (in.unit_params[0] + largest_other);
  est.construction.push_back(sharded);
  return est;
}

// DeepSpeed's formulas (deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs,
// stage_1_and_2.py estimate_zero2_model_states_mem_needs), in the same operations and order
// (Python's int * float is a double here; int() truncates), so the figures are its own to
// the byte. tests/interop/compare_estimate.py checks them against DeepSpeed's functions.
std::vector<DeepSpeedRow> deepspeed_table(const EstimateInput& in, int* stage,
                                          double additional_buffer_factor) {
  validate(in);
  const bool zero3 = in.strategy == ShardingStrategy::kFullShard;
  if (!zero3 && !keeps_params(in)) {
    bad("--deepspeed-table needs --sharding zero3 (full), zero2 or zero1: DeepSpeed estimates "
        "stages 2 and 3 only (its stage-2 formula stands for stage 1 too)");
  }
  if (stage != nullptr) *stage = zero3 ? 3 : 2;
  const MemoryEstimate base = estimate_memory(in);
  const int64_t P = base.total_params;
  const int64_t L = base.largest_unit_params;
  const int64_t gpn = base.gpus_per_node, nodes = base.nodes, gpus = gpn * nodes;
  const double factor = additional_buffer_factor;
  const double gpus_factor = 1.0 / static_cast<double>(nodes);
  auto trunc = [](double v) { return static_cast<int64_t>(v); };

  std::vector<DeepSpeedRow> rows;
  auto ours = [&](DeepSpeedRow& row) {
    EstimateInput r = in;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    r.cpu_offload = false;
#pragma GCC diagnostic pop
    r.offload_optimizer = row.offload_optimizer;
    r.offload_param = row.offload_param;
    const MemoryEstimate est = estimate_memory(r);
    const MemoryTerm& built = est.construction[row.zero_init ? 1 : 0];
    row.host_states_per_node = gpn * est.model_states_host();
    row.host_construction_per_node = gpn * built.host_bytes;
    row.host_per_node = std::max(row.host_states_per_node, row.host_construction_per_node);
    row.device_per_gpu = est.model_states_device();
    row.nvme_per_node = gpn * est.model_states_nvme();
  };
  const OffloadDevice cpu = OffloadDevice::kCpu, none = OffloadDevice::kNone;
  if (zero3) {
    const int64_t largest_layer_memory = 4 * L;
    for (bool cpu_offload : {true, false}) {
      for (bool cpu_offload_params : {true, false}) {
        if (!cpu_offload && cpu_offload_params) continue;
        for (bool zero_init : {true, false}) {
          DeepSpeedRow row;
          row.offload_param = cpu_offload_params ? cpu : none;
          row.offload_optimizer = cpu_offload ? cpu : none;
          row.zero_init = zero_init;
          double cpu_mem = 0;
          int64_t gpu_mem = 0;
          if (cpu_offload) {
            const int64_t per = cpu_offload_params ? 18 : 16;
            gpu_mem = cpu_offload_params ? largest_layer_memory
                                         : largest_layer_memory + trunc(static_cast<double>(2 * P) /
                                                                        static_cast<double>(gpus));
            cpu_mem = zero_init ? static_cast<double>(P * per) * gpus_factor * factor
                                : static_cast<double>(P) *
                                      std::max(static_cast<double>(4 * gpn),
                                               static_cast<double>(per) * gpus_factor) *
                                      factor;
          } else {
            gpu_mem = largest_layer_memory +
                      trunc(static_cast<double>(18 * P) / static_cast<double>(gpus));
            cpu_mem = zero_init ? static_cast<double>(L * 4 * gpn) * factor
                                : static_cast<double>(P * 4 * gpn) * factor;
          }
          row.deepspeed_cpu_bytes = trunc(cpu_mem);
          row.deepspeed_gpu_bytes = gpu_mem;
          ours(row);
          rows.push_back(row);
        }
      }
    }
  } else {
    for (bool cpu_offload : {true, false}) {
      DeepSpeedRow row;
      row.offload_optimizer = cpu_offload ? cpu : none;
      if (cpu_offload) {
        row.deepspeed_gpu_bytes = 2 * P;
        row.deepspeed_cpu_bytes =
            trunc(static_cast<double>(P * std::max<int64_t>(4 * gpus, 16)) * factor);
      } else {
        row.deepspeed_gpu_bytes =
            2 * P + trunc(static_cast<double>(18 * P) / static_cast<double>(gpus));
        row.deepspeed_cpu_bytes = trunc(static_cast<double>(P * 4 * gpn) * factor);
      }
      ours(row);
      rows.push_back(row);
    }
  }
  return rows;
}

}  // namespace fsdp
