// fully_shard: walks the module tree, lets the policy pick units, assigns parameters,
// and points each wrap point at its unit. What it checks before it builds (the options,
// host memory, NVMe space) is preflight.cpp's.
#include "engine_access.h"
#include "host_heap.h"
#include "nvme/io_engine.h"
#include "nvme/state_file.h"
#include "preflight.h"

#include <cstdlib>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace fsdp::detail {
namespace {

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

/// A wrap point in the tree, before units are decided.
struct WrapNode {
  WrapPointImpl* wp = nullptr;
  std::string fqn;
  std::vector<std::pair<std::string, at::Tensor>> params;  ///< directly owned, registration order
  std::vector<std::unique_ptr<WrapNode>> children;
  bool is_unit = false;
  bool keep_fp32 = false;  ///< MixedPrecision::keep_fp32_policy picked it
  bool built = false;      ///< sharded at construction (make_sharded): its flats exist
  // Parameters (by clean FQN, in registration order) mixing own params and children's,
  // so that merged wrap points keep their place in the order.
  std::vector<std::pair<std::string, at::Tensor>> ordered;
};

void walk(torch::nn::Module& m, const std::string& prefix, WrapNode& node) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    node.ordered.emplace_back(join(prefix, p.key()), p.value());
  }
  for (const auto& c : m.named_children()) {
    const std::string fqn = join(prefix, c.key());
    if (auto* wp = dynamic_cast<WrapPointImpl*>(c.value().get())) {
      TORCH_CHECK(!wp->is_unit(), "fully_shard: the wrap point '", fqn,
                  "' is already part of a sharded model; shard each model once, from its root");
      auto child = std::make_unique<WrapNode>();
      child->wp = wp;
      child->fqn = fqn;
      child->built = EngineAccess::state(*wp).built_in != nullptr;
      walk(*wp->wrapped(), fqn, *child);
      // Marker: the child's parameters go here in order unless it becomes a unit.
      node.ordered.emplace_back("\x01" + std::to_string(node.children.size()), at::Tensor());
      node.children.push_back(std::move(child));
    } else {
      walk(*c.value(), fqn, node);
    }
  }
}

// A node sharded at construction is a unit whatever the policy says now; its parameters
// are its flats' slots (listed for the tied-parameter check). Below it, only nodes that
// were themselves built are units: the others' parameters are inside its flats.
void mark_built(WrapNode& node) {
  node.is_unit = node.built;
  if (node.built) {
    const auto& st = EngineAccess::state(*node.wp);
    node.keep_fp32 = st.built_keep_fp32;
    node.params.clear();
    for (const auto& f : st.built_flats) {
      for (const auto& s : f->slots()) {
        node.params.emplace_back(join(node.fqn, s.fqn), s.param);
        for (const auto& a : s.aliases) node.params.emplace_back(join(node.fqn, a), s.param);
      }
    }
  }
  for (auto& c : node.children) mark_built(*c);
}

// Bottom-up: decide units, and return the parameters this node passes to its parent.
std::vector<std::pair<std::string, at::Tensor>> decide(WrapNode& node,
                                                       const wrap::WrapPolicy& policy,
                                                       const wrap::WrapPolicy& keep_fp32,
                                                       bool is_root) {
  if (node.built) {
    mark_built(node);
    return {};
  }
  std::vector<std::pair<std::string, at::Tensor>> owned;
  for (auto& e : node.ordered) {
    if (!e.second.defined() && !e.first.empty() && e.first[0] == '\x01') {
      auto& child = *node.children[std::stoul(e.first.substr(1))];
      auto up = decide(child, policy, keep_fp32, false);
      owned.insert(owned.end(), up.begin(), up.end());
    } else {
      owned.push_back(e);
    }
  }
  int64_t numel = 0;
  for (const auto& p : owned) numel += p.second.numel();
  wrap::WrapContext ctx{node.fqn, *node.wp->wrapped(), numel};
  node.keep_fp32 = !is_root && keep_fp32 && keep_fp32(ctx);
  node.is_unit = is_root || node.keep_fp32 || policy(ctx);
  node.params = std::move(owned);
  if (node.is_unit) return {};
  return std::move(node.params);
}

// Pre-order, so that every_kth_policy counts wrap points in module order.
void mark_checkpointed(WrapNode& node, const wrap::WrapPolicy& policy,
                       std::vector<std::pair<WrapPointImpl*, std::string>>& out) {
  for (auto& c : node.children) {
    int64_t numel = 0;
    for (const auto& p : c->wp->wrapped()->parameters()) numel += p.numel();
    if (policy(wrap::WrapContext{c->fqn, *c->wp->wrapped(), numel}))
      out.emplace_back(c->wp, c->fqn);
    mark_checkpointed(*c, policy, out);
  }
}

void collect_units(WrapNode& node, std::vector<WrapNode*>& out) {
  if (node.is_unit) out.push_back(&node);
  for (auto& c : node.children) collect_units(*c, out);
}

// Points `wp` at its unit `u` of `rt` (and, for the root, at `rt`), with the casts of
// mixed precision.
void attach_unit(const std::shared_ptr<Runtime>& rt, WrapPointImpl& wp,
                 const std::shared_ptr<Unit>& u) {
  EngineAccess::set_unit(wp, u);
  EngineAccess::set_runtime(wp, rt, /*owner=*/u->is_root());
  const auto& mp = rt->options().mixed_precision;
  std::optional<at::ScalarType> cast_inputs, cast_outputs;
  if (mp.param_dtype != at::kFloat) {
    if (u->keep_fp32) {
      cast_inputs = at::kFloat;
      cast_outputs = mp.param_dtype;
    } else if (mp.cast_forward_inputs) {
      cast_inputs = mp.param_dtype;
    }
  }
  if (u->is_root() && mp.output_dtype) cast_outputs = *mp.output_dtype;
  EngineAccess::set_casts(wp, cast_inputs, cast_outputs);
}

// Tied parameters must land in one unit (docs/design.md, "The engine").
void check_tied_in_one_unit(const std::vector<WrapNode*>& nodes) {
  std::map<c10::TensorImpl*, std::pair<std::string, std::string>> owner;  // impl -> (fqn, unit)
  for (WrapNode* n : nodes) {
    for (const auto& p : n->params) {
      auto [it, fresh] =
          owner.emplace(p.second.unsafeGetTensorImpl(), std::make_pair(p.first, n->fqn));
      if (fresh || it->second.second == n->fqn) continue;
      auto unit_name = [](const std::string& f) {
        return f.empty() ? std::string("the root unit") : "unit '" + f + "'";
      };
      TORCH_CHECK(false, "fully_shard: parameters '", it->second.first, "' and '", p.first,
                  "' are the same tensor (tied) but fall in different units (",
                  unit_name(it->second.second), " and ", unit_name(n->fqn),
                  "). Tied parameters must live in one unit: change the wrap policy so that the "
                  "wrap points holding them are not units, or wrap their common parent.");
    }
  }
}

void cast_buffers(torch::nn::Module& root, const MixedPrecision& mp) {
  if (!mp.buffer_dtype) return;
  at::NoGradGuard no_grad;
  for (auto& b : root.buffers(/*recurse=*/true)) {
    if (b.is_floating_point()) b.set_data(b.to(*mp.buffer_dtype));
  }
}

// Note [Offload granularity]
// DeepSpeed's offload sections map onto the engine's host shards (FlatConfig::offload):
// - offload_optimizer = cpu: the fp32 shards and their gradients are host memory, so the
//   optimizer's state and its step are too (fsdp::FusedAdamW steps there). A param_dtype
//   copy of each shard stays on the device (keep_device_params) and feeds the
//   all-gathers; it is copied again only once the host shard changed, so one
//   host-to-device copy of each shard per optimizer step instead of one per gather.
// - offload_param = cpu as well (what the deprecated cpu_offload asks for): nothing of
//   the model stays on the device; every gather copies its shard from the host first
//   (twice per step under ZeRO-3: forward and backward).
// Gradient shards come back to the host after each reduce-scatter in both.

// Note [Quantized training]
// ShardingOptions::quantized_communication becomes each direction's QuantizeSpec. qgZ is
// hierarchical where hpZ groups exist and the shard group is the world (kFullShard): the
// reshard groups are the inside, and the ranks with the same index in each are split off
// here as the outside (after every other split, in the same order on every rank).
void set_quantization(const ShardingOptions& options, FlatConfig& cfg) {
  const QuantizedCommunication& q = options.quantized_communication;
  if (q.weights) cfg.quantize_weights = QuantizeSpec{q.block_size, q.weight_bits, q.scale_dtype};
  if (!q.gradients) return;
  cfg.quantize_gradients = QuantizeSpec{q.block_size, q.gradient_bits, q.scale_dtype};
  const ProcessGroup& world = options.process_group;
  const int k = options.reshard_after_forward_group_size;
  if (k > 0 && cfg.shard_group->size() == world.size()) {
    std::vector<std::vector<int>> across(static_cast<size_t>(k));
    for (int r = 0; r < world.size(); ++r) across[static_cast<size_t>(r % k)].push_back(r);
    cfg.hierarchy_inner = cfg.reshard_group;
    cfg.hierarchy_outer = GroupAccess::backend(world)->split(across);
  }
}

// What every flat parameter of the model shares: dtypes, device, offload, counters, and
// the groups. FULL_SHARD and SHARD_GRAD_OP shard over the world; HYBRID_SHARD within
// groups of hybrid_group_size and replicates across them; NO_SHARD not at all.
FlatConfig model_flat_config(const ShardingOptions& options, Runtime& rt) {
  const ProcessGroup& world = options.process_group;
  FlatConfig cfg;
  cfg.world_size = world.size();
  cfg.device = options.device;
  cfg.param_dtype = options.mixed_precision.param_dtype;
  cfg.reduce_dtype = options.mixed_precision.reduce_dtype;
  cfg.master_dtype = options.mixed_precision.master_dtype;
  // Host-resident fp32 shards: offload_optimizer to the host (Note [Offload
  // granularity]); offload_optimizer = nvme keeps them on the host too (Note [NVMe
  // optimizer state]).
  cfg.offload = options.offload_optimizer.device != OffloadDevice::kNone;
  // Not under kZero2/kZero1: their full parameters persist and are gathered once per step.
  const bool persistent =
      options.strategy == ShardingStrategy::kZero2 || options.strategy == ShardingStrategy::kZero1;
  cfg.keep_device_params =
      cfg.offload && !persistent && options.offload_param.device == OffloadDevice::kNone;
  if (cfg.offload) cfg.transfers = make_transfers(options.device);
  if (options.offload_param.device == OffloadDevice::kNvme) {  // Note [NVMe parameters]
    cfg.nvme_path = options.offload_param.nvme_path;
    cfg.nvme_io = nvme::make_io_engine(16);
  }
  cfg.acct = &rt.acct();
  cfg.shard_group = GroupAccess::backend(world);
  cfg.replicate_group = make_single_backend();
  if (options.strategy == ShardingStrategy::kNoShard) {
    cfg.shard_group = make_single_backend();
    cfg.replicate_group = GroupAccess::backend(world);
  } else if (options.strategy == ShardingStrategy::kHybridShard) {
    const int n = world.size();
    const int g = options.hybrid_group_size == 0 ? n : options.hybrid_group_size;
    std::vector<std::vector<int>> shard_groups(n / g), rep_groups(g);
    for (int r = 0; r < n; ++r) {
      shard_groups[r / g].push_back(r);
      rep_groups[r % g].push_back(r);
    }
    cfg.shard_group = GroupAccess::backend(world)->split(shard_groups);
    cfg.replicate_group = GroupAccess::backend(world)->split(rep_groups);
  }
  // Post-forward reshard groups (Note [Post-forward slices]): k consecutive ranks, which
  // lie inside one shard group since k divides its size. Split after the groups above,
  // in the same order on every rank.
  if (const int k = options.reshard_after_forward_group_size; k > 0) {
    std::vector<std::vector<int>> groups(world.size() / k);
    for (int r = 0; r < world.size(); ++r) groups[r / k].push_back(r);
    cfg.reshard_group = GroupAccess::backend(world)->split(groups);
  }
  set_quantization(options, cfg);
  return cfg;
}

/// A unit's parameters, split into trainable and frozen slots (each tensor once, its
/// later names as aliases).
struct UnitSlots {
  std::vector<ParamSlot> trainable, frozen;
};

UnitSlots unit_slots(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  UnitSlots out;
  std::map<c10::TensorImpl*, ParamSlot*> seen;
  for (auto& p : params) {
    auto* impl = p.second.unsafeGetTensorImpl();
    if (seen.count(impl)) continue;
    seen[impl] = nullptr;
    ParamSlot s;
    s.fqn = p.first;
    s.param = p.second;
    (p.second.requires_grad() ? out.trainable : out.frozen).push_back(std::move(s));
  }
  // Aliases: later FQNs of a tensor already placed.
  for (auto* v : {&out.trainable, &out.frozen}) {
    for (auto& s : *v) seen[s.param.unsafeGetTensorImpl()] = &s;
  }
  std::map<c10::TensorImpl*, bool> first;
  for (auto& p : params) {
    auto* impl = p.second.unsafeGetTensorImpl();
    if (!first.emplace(impl, true).second) seen[impl]->aliases.push_back(p.first);
  }
  return out;
}

// A unit's flat parameters: one for its trainable parameters and one for its frozen
// ones. `bcast`: the group that broadcasts rank 0's values (sync_module_states), or null.
std::vector<std::unique_ptr<FlatParam>> make_flats(
    const std::vector<std::pair<std::string, at::Tensor>>& params, const FlatConfig& cfg,
    Backend* bcast) {
  UnitSlots slots = unit_slots(params);
  FlatParam::SyncFromRank0 sync;
  if (bcast != nullptr && bcast->size() > 1) {
    sync = [bcast, acct = cfg.acct](at::Tensor& v, const std::string& label) {
      broadcast_from_rank0(*bcast, v, *acct, label);
    };
  }
  std::vector<std::unique_ptr<FlatParam>> out;
  if (!slots.trainable.empty()) {
    out.push_back(std::make_unique<FlatParam>(std::move(slots.trainable), true, cfg, sync));
  }
  if (!slots.frozen.empty()) {
    out.push_back(std::make_unique<FlatParam>(std::move(slots.frozen), false, cfg, sync));
  }
  return out;
}

// Note [NVMe parameters]: the bytes this rank's parameter files take for a unit of
// `params` (its trainable and its frozen flat parameter).
int64_t unit_file_bytes(const std::vector<std::pair<std::string, at::Tensor>>& params,
                        bool keep_fp32, const FlatConfig& cfg) {
  const int64_t g = cfg.shard_group->size();
  int64_t trainable = 0, frozen = 0;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& [name, p] : params) {
    if (seen.insert(p.unsafeGetTensorImpl()).second)
      (p.requires_grad() ? trainable : frozen) += p.numel();
  }
  const at::ScalarType compute = keep_fp32 ? at::kFloat : cfg.param_dtype;
  int64_t bytes = 0;
  for (const auto& [n, is_trainable] : {std::pair{trainable, true}, std::pair{frozen, false}}) {
    if (n > 0)
      bytes += ShardFile::layout((n + g - 1) / g, is_trainable, cfg.master_dtype, compute).bytes;
  }
  return bytes;
}

std::string unit_label(const std::string& fqn) {
  return fqn.empty() ? std::string("the root unit") : "unit '" + fqn + "'";
}

// Makes node `n` a unit of `rt`: from its parameters now, or, if it was sharded at
// construction, from the flat parameters it built then (named now that its FQN is known).
void make_unit(Runtime& rt, const WrapNode& n, const FlatConfig& cfg, Backend* bcast) {
  Unit& unit = rt.add_unit(n.fqn);
  unit.keep_fp32 = n.keep_fp32;
  std::vector<std::unique_ptr<FlatParam>> flats;
  if (n.built) {
    auto& st = EngineAccess::state(*n.wp);
    flats = std::move(st.built_flats);
    st.built_flats.clear();
    st.built_in.reset();
    for (auto& f : flats) f->set_names(n.fqn, unit_label(n.fqn));
  } else {
    FlatConfig unit_cfg = cfg;
    unit_cfg.label = unit_label(n.fqn);
    if (n.keep_fp32) unit_cfg.param_dtype = at::kFloat;
    flats = make_flats(n.params, unit_cfg, bcast);
  }
  for (auto& f : flats) rt.add_flat(unit, std::move(f));
}

// The runtime the units join: the one of make_sharded's scope when wrap points were
// sharded at construction (their flats count into it), else a new one.
std::shared_ptr<Runtime> runtime_for_units(const std::vector<WrapNode*>& nodes,
                                           const ShardingOptions& options) {
  std::shared_ptr<Runtime> built;
  for (WrapNode* n : nodes) {
    if (!n->built) continue;
    const auto& rt = EngineAccess::state(*n->wp).built_in;
    TORCH_CHECK(built == nullptr || built == rt, "fully_shard: wrap point '", n->fqn,
                "' was sharded by another fsdp::make_sharded than the rest of the model; build "
                "the model in one make_sharded call");
    built = rt;
  }
  if (built != nullptr) {
    TORCH_CHECK(GroupAccess::backend(built->options().process_group) ==
                    GroupAccess::backend(options.process_group),
                "fully_shard: the model's wrap points were sharded at construction over another "
                "process group than ShardingOptions::process_group; pass the same options");
    return built;
  }
  auto rt = std::make_shared<Runtime>(options);
  rt->set_flat_config(model_flat_config(options, *rt));
  return rt;
}

// The parameters that wrap point's module passes to its unit when sharded at
// construction: its own and those of inner modules, except inner wrap points that were
// sharded at construction themselves (registration order, names relative to `m`).
void construction_params(torch::nn::Module& m, const std::string& prefix,
                         std::vector<std::pair<std::string, at::Tensor>>& out) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    out.emplace_back(join(prefix, p.key()), p.value());
  }
  for (const auto& c : m.named_children()) {
    const std::string fqn = join(prefix, c.key());
    if (auto* wp = dynamic_cast<WrapPointImpl*>(c.value().get())) {
      if (EngineAccess::state(*wp).built_in == nullptr)
        construction_params(*wp->wrapped(), fqn, out);
    } else {
      construction_params(*c.value(), fqn, out);
    }
  }
}

thread_local ConstructionState* t_construction = nullptr;

void release_free_heap() {
  release_host_blocks();  // Note [Host heap]
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& given) {
  const ShardingOptions options = resolve_deprecated_options(given);
  TORCH_CHECK(root != nullptr, "fully_shard: the module is empty (nullptr holder)");
  TORCH_CHECK(!root->is_unit(),
              "fully_shard: this model is already sharded; call fully_shard once");
  TORCH_CHECK(t_construction == nullptr,
              "fully_shard: called while fsdp::make_sharded is constructing a model on this "
              "thread; shard the model after its construction");
  validate_sharding_options(options);
  bound_host_heap(options);  // Note [Host heap]

  // Decide the units: walk the tree, let the policies pick, check tied parameters.
  WrapNode tree;
  tree.wp = root.get();
  walk(*root->wrapped(), "", tree);
  const bool mixed = options.mixed_precision.param_dtype != at::kFloat;
  decide(tree, options.auto_wrap_policy, mixed ? options.mixed_precision.keep_fp32_policy : nullptr,
         /*is_root=*/true);
  std::vector<WrapNode*> nodes;
  collect_units(tree, nodes);
  std::vector<std::pair<WrapPointImpl*, std::string>> checkpointed;  // with its FQN
  if (options.checkpoint_policy) mark_checkpointed(tree, options.checkpoint_policy, checkpointed);
  check_tied_in_one_unit(nodes);
  auto rt = runtime_for_units(nodes, options);
  check_host_memory(*root, options, rt->acct().mem.sharded_params.current);
  if (options.offload_param.device == OffloadDevice::kNvme) {
    int64_t bytes = 0;
    for (const WrapNode* n : nodes) {
      if (!n->built) bytes += unit_file_bytes(n->params, n->keep_fp32, rt->flat_config());
    }
    check_param_file_space(bytes, options, "for the model");
  }
  cast_buffers(*root, options.mixed_precision);

  // Build them: each unit's flat parameters, and the wrap points' links.
  const FlatConfig& cfg = rt->flat_config();
  Backend* bcast =
      options.sync_module_states ? GroupAccess::backend(options.process_group).get() : nullptr;
  for (WrapNode* n : nodes) make_unit(*rt, *n, cfg, bcast);
  for (size_t i = 0; i < nodes.size(); ++i) attach_unit(rt, *nodes[i]->wp, rt->units()[i]);
  for (auto& [wp, fqn] : checkpointed) EngineAccess::set_checkpointed(*wp, fqn);
}

ConstructionState* active_construction() { return t_construction; }

void shard_at_construction(WrapPointImpl& wp, ConstructionState& scope) {
  Runtime& rt = *scope.runtime;
  const ShardingOptions& o = rt.options();
  std::vector<std::pair<std::string, at::Tensor>> params;
  construction_params(*wp.wrapped(), "", params);
  int64_t numel = 0;
  for (const auto& p : params) numel += p.second.numel();
  const wrap::WrapContext ctx{"", *wp.wrapped(), numel};
  const auto& mp = o.mixed_precision;
  const bool keep_fp32 =
      mp.param_dtype != at::kFloat && mp.keep_fp32_policy && mp.keep_fp32_policy(ctx);
  if (!keep_fp32 && !o.auto_wrap_policy(ctx)) return;  // its parameters go to its parent's unit

  FlatConfig cfg = rt.flat_config();
  cfg.label = "unit #" + std::to_string(scope.units_built) + " of make_sharded";
  if (keep_fp32) cfg.param_dtype = at::kFloat;
  check_param_file_space(unit_file_bytes(params, keep_fp32, cfg), o,
                         "for the unit it builds now (make_sharded; the disk already holds the "
                         "units built before)");
  auto& st = EngineAccess::state(wp);
  st.built_flats = make_flats(params, cfg, scope.broadcast);
  st.built_keep_fp32 = keep_fp32;
  st.built_in = scope.runtime;
  ++scope.units_built;
  // The unit's full parameters are free now; hand the pages back to the OS, or glibc keeps
  // them in its heap (blocks below its adaptive mmap threshold of up to 32 MiB) and the
  // rank's resident memory grows by a unit per unit built.
  release_free_heap();
}

ConstructionScope::ConstructionScope(const ShardingOptions& given) {
  const ShardingOptions options = resolve_deprecated_options(given);
  TORCH_CHECK(t_construction == nullptr,
              "fsdp::make_sharded: another make_sharded is already constructing a model on this "
              "thread; construct one sharded model at a time");
  validate_sharding_options(options);
  bound_host_heap(options);  // Note [Host heap]
  state_ = std::make_shared<ConstructionState>();
  state_->runtime = std::make_shared<Runtime>(options);
  state_->runtime->set_flat_config(model_flat_config(options, *state_->runtime));
  if (options.sync_module_states) {
    state_->broadcast = GroupAccess::backend(options.process_group).get();
  }
  t_construction = state_.get();
}

ConstructionScope::~ConstructionScope() { finish(); }

void ConstructionScope::finish() {
  if (t_construction == state_.get()) t_construction = nullptr;
}

}  // namespace fsdp::detail
