// The public handles' side of the engine: the calls a wrap point makes into it, the
// ShardedModel verbs, shard_sequential, clean names and NoSyncScope.
#include <fsdp/activation_checkpoint.h>

#include "engine_access.h"
#include "internal/pipeline_view.h"

#include <sstream>

namespace fsdp {

WrapPointImpl::WrapPointImpl(const std::string& name)
    : torch::nn::Module(name), state_(std::make_unique<detail::WrapPointState>()) {}
WrapPointImpl::~WrapPointImpl() = default;

void WrapPointImpl::constructed() {
  if (auto* scope = detail::active_construction()) detail::shard_at_construction(*this, *scope);
}

bool WrapPointImpl::is_unit() const { return state_->unit != nullptr; }
bool WrapPointImpl::checkpointed() const { return state_->checkpointed; }

detail::Unit* detail::EngineAccess::unit(const WrapPointImpl& wp) { return wp.state_->unit.get(); }
void detail::EngineAccess::set_unit(WrapPointImpl& wp, std::shared_ptr<detail::Unit> unit) {
  wp.state_->unit = std::move(unit);
}
void detail::EngineAccess::set_runtime(WrapPointImpl& wp,
                                       const std::shared_ptr<detail::Runtime>& runtime,
                                       bool owner) {
  wp.state_->model = runtime;
  if (owner) wp.state_->owner = runtime;
}
detail::Runtime& detail::EngineAccess::runtime(const WrapPointImpl& wp) {
  auto model = wp.state_->model.lock();
  TORCH_CHECK(model != nullptr, "FSDP unit ", unit(wp)->display_name(),
              ": the sharded model it belonged to has been destroyed; keep the handle "
              "fully_shard() returned alive while its modules are used");
  // The root's owner (or the caller's handle) keeps it alive beyond this call.
  return *model;
}
void detail::EngineAccess::set_casts(WrapPointImpl& wp, std::optional<torch::Dtype> inputs,
                                     std::optional<torch::Dtype> outputs) {
  wp.state_->cast_inputs = inputs;
  wp.state_->cast_outputs = outputs;
}
void detail::EngineAccess::set_checkpointed(WrapPointImpl& wp, const std::string& fqn) {
  wp.state_->checkpointed = true;
  wp.state_->fqn = fqn;
}
detail::Runtime& detail::EngineAccess::runtime(const ShardedModel& model) {
  return *model.root().state_->owner;
}

namespace {
void pre_forward(WrapPointImpl& wp) {
  detail::EngineAccess::runtime(wp).pre_forward(*detail::EngineAccess::unit(wp));
}
void post_forward(WrapPointImpl& wp, std::vector<torch::Tensor> outputs) {
  detail::EngineAccess::runtime(wp).post_forward(*detail::EngineAccess::unit(wp), outputs);
}
}  // namespace

std::optional<torch::Dtype> WrapPointImpl::before_forward() {
  TORCH_CHECK(!(checkpointed() && torch::GradMode::is_enabled()),
              "ShardingOptions::checkpoint_policy picked wrap point '", state_->fqn,
              "', whose forward is not Tensor -> Tensor; activation checkpointing here recomputes "
              "a forward of one tensor to one tensor. Leave it out of the policy (e.g. "
              "predicate_policy), or call fsdp::activation_checkpoint inside its forward.");
  if (is_unit()) pre_forward(*this);
  return state_->cast_inputs;
}

torch::Tensor WrapPointImpl::cast_output(torch::Tensor out) const {
  const auto& to = state_->cast_outputs;
  return to && out.defined() && out.is_floating_point() ? out.to(*to) : out;
}

void WrapPointImpl::after_forward(std::vector<torch::Tensor> outputs) {
  if (is_unit()) post_forward(*this, std::move(outputs));
}

ShardedModel::ShardedModel(std::shared_ptr<WrapPointImpl> root, const ShardingOptions& options)
    : root_(std::move(root)) {
  detail::shard_module_tree(root_, options);
}

WrapPointImpl& ShardedModel::root() const {
  TORCH_CHECK(root_ != nullptr,
              "this fsdp::ShardedModel is empty: assign it what fsdp::fully_shard returns");
  return *root_;
}

torch::nn::Module& ShardedModel::as_module() const { return root(); }

namespace {
detail::Runtime& runtime_of(const ShardedModel& m) { return detail::EngineAccess::runtime(m); }
}  // namespace

stats::MemoryStats ShardedModel::memory_stats() const {
  auto& rt = runtime_of(*this);
  rt.recount_grads();
  return rt.acct().mem;
}

void ShardedModel::reset_peak_memory() {
  auto& m = runtime_of(*this).acct().mem;
  for (stats::MemoryCounter* c : {&m.sharded_params, &m.grad_shards, &m.gathered_params,
                                  &m.post_forward_params, &m.comm_buffers, &m.checkpoint_buffers,
                                  &m.offload_buffers, &m.checkpoint_staging, &m.nvme_params}) {
    c->peak = c->current;
  }
}

stats::CommCounters ShardedModel::comm_stats() const { return runtime_of(*this).acct().comm; }

const ShardingOptions& ShardedModel::sharding_options() const {
  return runtime_of(*this).options();
}

void ShardedModel::unshard() {
  for (auto& u : runtime_of(*this).units()) u->unshard();
}

void ShardedModel::reshard() {
  auto& rt = runtime_of(*this);
  for (auto& u : rt.units()) u->reshard();
  rt.wait_transfers();  // the caller may write the host shards next (an optimizer step)
}

void ShardedModel::set_requires_gradient_sync(bool requires_gradient_sync) {
  runtime_of(*this).set_no_sync(!requires_gradient_sync);
}

bool ShardedModel::requires_gradient_sync() const { return !runtime_of(*this).no_sync(); }

void ShardedModel::set_reshard_after_backward(bool reshard_after_backward) {
  runtime_of(*this).set_reshard_after_backward(reshard_after_backward);
}

namespace {
void set_prefetch(const ShardedModel& m, bool forward, const std::string& unit_fqn,
                  const std::vector<std::string>& prefetch_fqns) {
  auto& rt = runtime_of(m);
  const char* what = forward ? "set_forward_prefetch" : "set_backward_prefetch";
  const detail::Unit& u = rt.unit_named(unit_fqn, what);
  std::vector<detail::Unit*> targets;
  for (const auto& f : prefetch_fqns) targets.push_back(&rt.unit_named(f, what));
  rt.set_prefetch(u, forward, std::move(targets));
}
}  // namespace

void ShardedModel::set_forward_prefetch(const std::string& unit_fqn,
                                        std::vector<std::string> prefetch_fqns) {
  set_prefetch(*this, /*forward=*/true, unit_fqn, prefetch_fqns);
}

void ShardedModel::set_backward_prefetch(const std::string& unit_fqn,
                                         std::vector<std::string> prefetch_fqns) {
  set_prefetch(*this, /*forward=*/false, unit_fqn, prefetch_fqns);
}

Sharded<torch::nn::Sequential> shard_sequential(const torch::nn::Sequential& seq,
                                                const ShardingOptions& options) {
  return fully_shard(detail::wrap_sequential_entries(seq), options);
}

detail::SequentialEntryImpl::SequentialEntryImpl(torch::nn::AnyModule module, bool at_construction)
    : WrapPointImpl("fsdp::SequentialEntry"), module_(std::move(module)) {
  register_module("module", module_.ptr());
  if (at_construction) constructed();
}

void detail::check_layer_made(const torch::nn::AnyModule& module, int64_t i,
                              const std::string& name) {
  TORCH_CHECK(!module.is_empty(), "pipeline: the layer factory made no module for layer ", i, " ('",
              name, "')");
}

Sharded<torch::nn::Sequential> detail::shard_layers_as_built(
    int64_t first, int64_t last,
    const std::function<std::pair<std::string, torch::nn::AnyModule>(int64_t)>& make,
    const ShardingOptions& options) {
  torch::OrderedDict<std::string, torch::nn::AnyModule> entries;
  detail::ConstructionScope scope(options);
  for (int64_t i = first; i < last; ++i) {
    auto [name, module] = make(i);
    detail::check_layer_made(module, i, name);
    entries.insert(name, torch::nn::AnyModule(std::make_shared<SequentialEntryImpl>(
                             std::move(module), /*at_construction=*/true)));
  }
  scope.finish();
  return fully_shard(torch::nn::Sequential(std::move(entries)), options);
}

torch::Tensor detail::SequentialEntryImpl::forward(torch::Tensor x) {
  return run_tensor_forward([this](const torch::Tensor& t) { return module_.forward(t); },
                            std::move(x));
}

torch::Tensor WrapPointImpl::run_tensor_forward(
    const std::function<torch::Tensor(const torch::Tensor&)>& fn, torch::Tensor x) {
  if (!is_unit() && !checkpointed()) return fn(x);
  if (is_unit()) pre_forward(*this);
  if (state_->cast_inputs) x = detail::cast_floating(x, *state_->cast_inputs);
  torch::Tensor out;
  if (checkpointed() && torch::GradMode::is_enabled()) {
    detail::trace::RegionName region(is_unit() ? detail::EngineAccess::unit(*this)->trace_name()
                                               : state_->fqn);
    ActivationCheckpointOptions co;
    detail::Runtime& rt = detail::EngineAccess::runtime(*this);
    if (rt.options().offload_activations) {
      co.offload_inputs = true;
      co.host_counter = &rt.acct().mem.offloaded_activations;
    }
    out = fsdp::activation_checkpoint(fn, x, co);
  } else {
    try {
      out = fn(x);
    } catch (const c10::Error& e) {
      if (auto hint = mixed_precision_hint(e)) TORCH_CHECK(false, *hint);
      throw;
    }
  }
  out = cast_output(std::move(out));
  if (is_unit()) post_forward(*this, {out});
  return out;
}

// Note [Dtype errors under mixed precision]
// A floating buffer the model keeps in fp32, or a tensor the unit's forward does not cast,
// meets bf16 parameters deep inside a layer, and LibTorch's message ("expected m1 and m2
// to have the same dtype") names neither the unit nor the fix. The innermost unit whose
// forward the error leaves adds both; the units around it pass it on unchanged.
std::optional<std::string> WrapPointImpl::mixed_precision_hint(const c10::Error& e) const {
  if (!is_unit()) return std::nullopt;
  const std::string what = e.what_without_backtrace();
  const bool dtype =
      what.find("dtype") != std::string::npos || what.find("scalar type") != std::string::npos;
  if (!dtype || what.find("[fsdp] unit '") != std::string::npos) return std::nullopt;
  const MixedPrecision& mp = detail::EngineAccess::runtime(*this).options().mixed_precision;
  if (mp.param_dtype == torch::kFloat) return std::nullopt;
  std::ostringstream s;
  s << what << "\n[fsdp] unit '" << (state_->fqn.empty() ? "<root>" : state_->fqn)
    << "' computes in " << mp.param_dtype
    << " (MixedPrecision::param_dtype) and a tensor of another dtype met its parameters. "
       "A floating buffer keeps its own dtype unless MixedPrecision::buffer_dtype casts it "
       "(set it to "
    << mp.param_dtype << "); floating tensor arguments of a unit's forward are cast to "
    << mp.param_dtype << " while MixedPrecision::cast_forward_inputs is true (it is "
    << (mp.cast_forward_inputs ? "true" : "false")
    << "), but tensors made inside the forward, or held in other arguments, are not.";
  return s.str();
}

namespace detail {
torch::nn::Sequential wrap_sequential_entries(const torch::nn::Sequential& seq) {
  TORCH_CHECK(!seq.is_empty(), "shard_sequential: the Sequential is empty (nullptr holder)");
  torch::OrderedDict<std::string, torch::nn::AnyModule> entries;
  const auto children = seq->named_children();
  size_t i = 0;
  for (const auto& any : *seq.get()) {
    auto entry = std::make_shared<SequentialEntryImpl>(any);
    entries.insert(children[i++].key(), torch::nn::AnyModule(entry));
  }
  return torch::nn::Sequential(std::move(entries));
}
}  // namespace detail

namespace {
// The tensors of the tree under `m` with clean FQNs: wrap-point segments ("module")
// removed. `own` lists a module's own tensors (parameters or buffers, not recursive).
template <class Own>
void clean_names(const torch::nn::Module& m, const std::string& prefix, const Own& own,
                 std::vector<std::pair<std::string, torch::Tensor>>& out) {
  auto join = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
  for (const auto& t : own(m)) out.emplace_back(join(t.key()), t.value());
  for (const auto& c : m.named_children()) {
    auto* wp = dynamic_cast<const WrapPointImpl*>(c.value().get());
    clean_names(wp ? *wp->wrapped() : *c.value(), join(c.key()), own, out);
  }
}

template <class Own>
std::vector<std::pair<std::string, torch::Tensor>> clean_names(const torch::nn::Module& module,
                                                               const Own& own) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  auto* wp = dynamic_cast<const WrapPointImpl*>(&module);
  clean_names(wp ? *wp->wrapped() : module, "", own, out);
  return out;
}
}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> named_buffers_clean(
    const torch::nn::Module& module) {
  return clean_names(module, [](const torch::nn::Module& m) { return m.named_buffers(false); });
}

std::vector<std::pair<std::string, torch::Tensor>> named_parameters_clean(
    const torch::nn::Module& module) {
  return clean_names(module, [](const torch::nn::Module& m) { return m.named_parameters(false); });
}

NoSyncScope::NoSyncScope(ShardedModel model)
    : model_(std::move(model)), previous_(model_.requires_gradient_sync()) {
  model_.set_requires_gradient_sync(false);
}

NoSyncScope::~NoSyncScope() { model_.set_requires_gradient_sync(previous_); }

}  // namespace fsdp
