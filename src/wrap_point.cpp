// WrapPointImpl: the calls a wrap point makes into the engine, and the root's queries.
#include <fsdp/full_params.h>
#include <fsdp/fully_sharded_module.h>
#include <fsdp/fused_adamw.h>

#include "internal/sharded_model.h"
#include "runtime.h"

namespace fsdp {

// The engine's way into the public handles (src/internal.h).
detail::Unit* EngineAccess::unit(const WrapPointImpl& wp) { return static_cast<detail::Unit*>(wp.unit_.get()); }
void EngineAccess::set_unit(WrapPointImpl& wp, std::shared_ptr<detail::Unit> unit) { wp.unit_ = std::move(unit); }
void EngineAccess::set_runtime(WrapPointImpl& wp, std::shared_ptr<detail::Runtime> runtime) {
  wp.runtime_ = std::move(runtime);
}
void EngineAccess::set_casts(WrapPointImpl& wp, std::optional<torch::Dtype> inputs,
                             std::optional<torch::Dtype> outputs) {
  wp.cast_inputs_ = inputs;
  wp.cast_outputs_ = outputs;
}
void EngineAccess::set_checkpointed(WrapPointImpl& wp, const std::string& fqn) {
  wp.checkpoint_ = true;
  wp.fqn_ = fqn;
}
detail::Runtime& EngineAccess::runtime(const ShardedModel& model) {
  return *static_cast<detail::Runtime*>(model.root().runtime_.get());
}

void WrapPointImpl::pre_forward() {
  auto* u = EngineAccess::unit(*this);
  u->runtime().pre_forward(*u);
}

void WrapPointImpl::post_forward(std::vector<torch::Tensor> outputs) {
  auto* u = EngineAccess::unit(*this);
  u->runtime().post_forward(*u, outputs);
}

ShardedModel::ShardedModel(std::shared_ptr<WrapPointImpl> root, const ShardingOptions& options)
    : root_(std::move(root)) {
  detail::shard_module_tree(root_, options);
}

WrapPointImpl& ShardedModel::root() const {
  TORCH_CHECK(root_ != nullptr, "this fsdp::ShardedModel is empty: assign it what fsdp::fully_shard returns");
  return *root_;
}

torch::nn::Module& ShardedModel::as_module() const { return root(); }

namespace {
detail::Runtime& runtime_of(const ShardedModel& m) { return EngineAccess::runtime(m); }

ParamInfo info_of(const detail::Unit& u, const detail::FlatParam& f, const detail::ParamSlot& s, size_t k) {
  return ParamInfo{k == 0 ? s.fqn : s.aliases[k - 1], u.fqn(), f.trainable(), s.offset, s.numel, s.shape};
}

FlatParamInfo flat_info_of(const detail::Unit& u, const detail::FlatParam& f) {
  return FlatParamInfo{u.fqn(), f.param_dtype(), f.trainable(), f.numel(), f.padded_numel(), f.shard_numel()};
}
}  // namespace

std::vector<torch::Tensor> ShardedModel::sharded_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& u : runtime_of(*this).units()) {
    for (const auto& f : u->flats()) {
      if (f->trainable()) out.push_back(f->shard());
    }
  }
  return out;
}

MemoryStats ShardedModel::memory_stats() const {
  auto& rt = runtime_of(*this);
  rt.sync_grad_counter();
  return rt.acct().mem;
}

void ShardedModel::reset_peak_memory() {
  auto& m = runtime_of(*this).acct().mem;
  for (MemoryCounter* c : {&m.sharded_params, &m.grad_shards, &m.gathered_params, &m.comm_buffers,
                          &m.checkpoint_buffers, &m.offload_buffers, &m.checkpoint_staging}) {
    c->peak = c->current;
  }
}

CommCounters ShardedModel::comm_stats() const { return runtime_of(*this).acct().comm; }

std::vector<ParamInfo> ShardedModel::param_table() const {
  std::vector<ParamInfo> out;
  for (const auto& u : runtime_of(*this).units()) {
    for (const auto& f : u->flats()) {
      for (const auto& s : f->slots()) {
        for (size_t k = 0; k <= s.aliases.size(); ++k) out.push_back(info_of(*u, *f, s, k));
      }
    }
  }
  return out;
}

const ShardingOptions& ShardedModel::sharding_options() const { return runtime_of(*this).options(); }

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

namespace detail {

std::vector<FlatParamInfo> flat_params(const ShardedModel& model) {
  std::vector<FlatParamInfo> out;
  for (const auto& u : runtime_of(model).units()) {
    for (const auto& f : u->flats()) out.push_back(flat_info_of(*u, *f));
  }
  return out;
}

std::vector<LocalShard> local_shards(const ShardedModel& model) {
  auto& rt = runtime_of(model);
  const auto& cfg = rt.flat_config();
  std::vector<LocalShard> out;
  for (const auto& u : rt.units()) {
    for (const auto& f : u->flats()) {
      LocalShard ls;
      ls.info = flat_info_of(*u, *f);
      ls.shard_group_size = cfg.shard_group->size();
      ls.shard_rank = cfg.shard_group->rank();
      ls.writer = cfg.replicate_group->rank() == 0;
      ls.begin = std::min<int64_t>(ls.shard_rank * f->shard_numel(), f->numel());
      ls.length = std::min<int64_t>(f->numel() - ls.begin, f->shard_numel());
      ls.shard = f->shard();
      for (const auto& s : f->slots()) {
        for (size_t k = 0; k <= s.aliases.size(); ++k) ls.params.push_back(info_of(*u, *f, s, k));
      }
      out.push_back(std::move(ls));
    }
  }
  return out;
}

torch::Tensor gather_flat(const ShardedModel& model, size_t index, const torch::Tensor& shard_like) {
  auto& rt = runtime_of(model);
  size_t i = 0;
  for (const auto& u : rt.units()) {
    for (const auto& f : u->flats()) {
      if (i++ != index) continue;
      at::Tensor full = f->gather_like(shard_like);
      // Counted while the caller holds it: the deleter keeps the storage and releases the bytes.
      auto* acct = &rt.acct();
      const int64_t bytes = full.numel() * static_cast<int64_t>(sizeof(float));
      Accounting::alloc(acct->mem.checkpoint_buffers, bytes);
      void* data = full.data_ptr();
      return torch::from_blob(
          data, {f->numel()},
          [full, acct, bytes](void*) mutable {
            Accounting::release(acct->mem.checkpoint_buffers, bytes);
            full.reset();
          },
          full.options());
    }
  }
  TORCH_CHECK(false, "gather_flat: index ", index, " is out of range; the model has ", i, " flat parameters");
}

int attach_copy_out(const ShardedModel& model, FusedAdamW& optimizer) {
  int n = 0;
  for (auto& u : runtime_of(model).units()) {
    for (auto& f : u->flats()) {
      auto [out, version] = f->copy_out_target();
      if (!out.defined()) continue;
      optimizer.set_copy_out(f->shard(), out, version);
      ++n;
    }
  }
  return n;
}

void account_checkpoint_staging(const ShardedModel& model, int64_t delta) {
  auto& c = runtime_of(model).acct().mem.checkpoint_staging;
  if (delta >= 0) {
    Accounting::alloc(c, delta);
  } else {
    Accounting::release(c, -delta);
  }
}

std::map<std::string, torch::Tensor>& checkpoint_staging_pool(const ShardedModel& model) {
  return runtime_of(model).staging_pool();
}

int64_t copy_out_gathers(const ShardedModel& model) {
  int64_t n = 0;
  for (const auto& u : runtime_of(model).units()) {
    for (const auto& f : u->flats()) n += f->copy_out_gathers();
  }
  return n;
}

}  // namespace detail

Sharded<torch::nn::Sequential> shard_sequential(const torch::nn::Sequential& seq, const ShardingOptions& options) {
  return fully_shard(detail::wrap_sequential_entries(seq), options);
}

SequentialEntryImpl::SequentialEntryImpl(torch::nn::AnyModule module)
    : WrapPointImpl("fsdp::SequentialEntry"), module_(std::move(module)) {
  register_module("module", module_.ptr());
}

torch::Tensor SequentialEntryImpl::forward(torch::Tensor x) {
  return run_tensor_forward([this](const torch::Tensor& t) { return module_.forward(t); }, std::move(x));
}

torch::Tensor WrapPointImpl::run_tensor_forward(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                                torch::Tensor x) {
  if (!is_unit() && !checkpointed()) return fn(x);
  if (is_unit()) pre_forward();
  if (cast_inputs_) x = cast_floating(x, *cast_inputs_);
  torch::Tensor out = checkpointed() && torch::GradMode::is_enabled() ? fsdp::checkpoint(fn, x) : fn(x);
  if (cast_outputs_ && out.defined() && out.is_floating_point()) out = out.to(*cast_outputs_);
  if (is_unit()) post_forward({out});
  return out;
}

void WrapPointImpl::fail_checkpoint_needs_tensor_forward() const {
  TORCH_CHECK(false, "ShardingOptions::checkpoint_policy picked wrap point '", fqn_,
              "', whose forward is not Tensor -> Tensor; activation checkpointing here recomputes "
              "a forward of one tensor to one tensor. Leave it out of the policy (e.g. "
              "predicate_policy), or call fsdp::checkpoint inside its forward.");
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
std::vector<std::pair<std::string, torch::Tensor>> clean_names(const torch::nn::Module& module, const Own& own) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  auto* wp = dynamic_cast<const WrapPointImpl*>(&module);
  clean_names(wp ? *wp->wrapped() : module, "", own, out);
  return out;
}
}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> named_buffers_clean(const torch::nn::Module& module) {
  return clean_names(module, [](const torch::nn::Module& m) { return m.named_buffers(false); });
}

std::vector<std::pair<std::string, torch::Tensor>> named_parameters_clean(const torch::nn::Module& module) {
  return clean_names(module, [](const torch::nn::Module& m) { return m.named_parameters(false); });
}

NoSyncScope::NoSyncScope(ShardedModel model)
    : model_(std::move(model)), previous_(model_.requires_gradient_sync()) {
  model_.set_requires_gradient_sync(false);
}

NoSyncScope::~NoSyncScope() { model_.set_requires_gradient_sync(previous_); }

FullParamsScope::FullParamsScope(ShardedModel model, FullParamsOptions options)
    : model_(std::move(model)), options_(options) {
  auto& rt = runtime_of(model_);
  const bool keep = !options_.rank0_only || rt.options().process_group.rank() == 0;
  for (auto& u : rt.units()) {
    u->unshard();
    if (!keep) u->reshard();
  }
}

FullParamsScope::~FullParamsScope() {
  auto& rt = runtime_of(model_);
  const bool kept = !options_.rank0_only || rt.options().process_group.rank() == 0;
  const bool writeback = options_.writeback && kept && rt.options().mixed_precision.param_dtype == at::kFloat;
  at::NoGradGuard no_grad;
  for (auto& u : rt.units()) {
    if (writeback && u->state() == detail::ShardedState::kUnsharded) {
      for (auto& f : u->flats()) {
        const int64_t r = rt.flat_config().shard_group->rank();
        f->shard().copy_(f->full().narrow(0, r * f->shard_numel(), f->shard_numel()));
      }
    }
    u->reshard();
  }
  rt.wait_transfers();  // the caller may write the host shards next (an optimizer step)
}

std::vector<std::pair<std::string, torch::Tensor>> full_state_dict(const ShardedModel& model,
                                                                   FullParamsOptions options) {
  auto& rt = runtime_of(model);
  const bool keep = !options.rank0_only || rt.options().process_group.rank() == 0;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& u : rt.units()) {
    for (auto& f : u->flats()) {
      at::Tensor full = f->gather_fp32();
      if (!keep) continue;
      if (options.offload_to_cpu) full = full.to(at::kCPU);
      for (const auto& s : f->slots()) {
        at::Tensor v = full.narrow(0, s.offset, s.numel).view(s.shape).clone();
        out.emplace_back(s.fqn, v);
        for (const auto& a : s.aliases) out.emplace_back(a, v);
      }
    }
  }
  return out;
}

}  // namespace fsdp
