// WrapPointImpl: the calls a wrap point makes into the engine, and the root's queries.
#include <fsdp/full_params.h>
#include <fsdp/fully_sharded_module.h>
#include <fsdp/fused_adamw.h>

#include "runtime.h"

namespace fsdp {

void WrapPointImpl::pre_forward() { unit_->runtime().pre_forward(*unit_); }

void WrapPointImpl::post_forward(std::vector<torch::Tensor> outputs) {
  unit_->runtime().post_forward(*unit_, outputs);
}

detail::Runtime& WrapPointImpl::runtime() const {
  TORCH_CHECK(runtime_ != nullptr,
              "this call needs the root of a sharded model: use the module that fsdp::fully_shard "
              "returned", is_unit() ? " (this wrap point is an inner unit)" : " (this wrap point is not sharded)");
  return *runtime_;
}

std::vector<torch::Tensor> WrapPointImpl::sharded_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& u : runtime().units()) {
    for (const auto& f : u->flats()) {
      if (f->trainable()) out.push_back(f->shard());
    }
  }
  return out;
}

MemoryStats WrapPointImpl::memory_stats() const {
  runtime().sync_grad_counter();
  return runtime().acct().mem;
}

void WrapPointImpl::reset_peak_memory() {
  auto& m = runtime().acct().mem;
  for (MemoryCounter* c : {&m.sharded_params, &m.grad_shards, &m.gathered_params, &m.comm_buffers,
                          &m.checkpoint_buffers, &m.offload_buffers}) {
    c->peak = c->current;
  }
}

CommCounters WrapPointImpl::comm_stats() const { return runtime().acct().comm; }

std::vector<ParamInfo> WrapPointImpl::param_table() const {
  std::vector<ParamInfo> out;
  for (const auto& u : runtime().units()) {
    for (const auto& f : u->flats()) {
      for (const auto& s : f->slots()) {
        for (size_t k = 0; k <= s.aliases.size(); ++k) {
          out.push_back(ParamInfo{k == 0 ? s.fqn : s.aliases[k - 1], u->fqn(), f->trainable(),
                                  s.offset, s.numel, s.shape});
        }
      }
    }
  }
  return out;
}

std::vector<FlatParamInfo> WrapPointImpl::flat_params() const {
  std::vector<FlatParamInfo> out;
  for (const auto& u : runtime().units()) {
    for (const auto& f : u->flats()) {
      out.push_back(FlatParamInfo{u->fqn(), f->param_dtype(), f->trainable(), f->numel(), f->padded_numel(),
                                  f->shard_numel()});
    }
  }
  return out;
}

std::vector<LocalShard> WrapPointImpl::local_shards() const {
  const auto& cfg = runtime().flat_config();
  std::vector<LocalShard> out;
  for (const auto& u : runtime().units()) {
    for (const auto& f : u->flats()) {
      LocalShard ls;
      ls.info = FlatParamInfo{u->fqn(), f->param_dtype(), f->trainable(), f->numel(), f->padded_numel(),
                              f->shard_numel()};
      ls.shard_group_size = cfg.shard_group->size();
      ls.shard_rank = cfg.shard_group->rank();
      ls.writer = cfg.replicate_group->rank() == 0;
      ls.begin = std::min<int64_t>(ls.shard_rank * f->shard_numel(), f->numel());
      ls.length = std::min<int64_t>(f->numel() - ls.begin, f->shard_numel());
      ls.shard = f->shard();
      for (const auto& s : f->slots()) {
        for (size_t k = 0; k <= s.aliases.size(); ++k) {
          ls.params.push_back(ParamInfo{k == 0 ? s.fqn : s.aliases[k - 1], u->fqn(), f->trainable(), s.offset,
                                        s.numel, s.shape});
        }
      }
      out.push_back(std::move(ls));
    }
  }
  return out;
}

torch::Tensor WrapPointImpl::gather_flat(size_t index, const torch::Tensor& shard_like) const {
  auto& rt = runtime();
  size_t i = 0;
  for (const auto& u : rt.units()) {
    for (const auto& f : u->flats()) {
      if (i++ != index) continue;
      at::Tensor full = f->gather_like(shard_like);
      // Counted while the caller holds it: the deleter keeps the storage and releases the bytes.
      auto* acct = &rt.acct();
      const int64_t bytes = full.numel() * static_cast<int64_t>(sizeof(float));
      detail::Accounting::alloc(acct->mem.checkpoint_buffers, bytes);
      void* data = full.data_ptr();
      return torch::from_blob(
          data, {f->numel()},
          [full, acct, bytes](void*) mutable {
            detail::Accounting::release(acct->mem.checkpoint_buffers, bytes);
            full.reset();
          },
          full.options());
    }
  }
  TORCH_CHECK(false, "gather_flat: index ", index, " is out of range; the model has ", i, " flat parameters");
}

int WrapPointImpl::attach_copy_out(FusedAdamW& optimizer) {
  int n = 0;
  for (auto& u : runtime().units()) {
    for (auto& f : u->flats()) {
      auto [out, version] = f->copy_out_target();
      if (!out.defined()) continue;
      optimizer.set_copy_out(f->shard(), out, version);
      ++n;
    }
  }
  return n;
}

int64_t WrapPointImpl::copy_out_gathers() const {
  int64_t n = 0;
  for (const auto& u : runtime().units()) {
    for (const auto& f : u->flats()) n += f->copy_out_gathers();
  }
  return n;
}

const ShardingOptions& WrapPointImpl::sharding_options() const { return runtime().options(); }

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
  if (cast_inputs_) x = detail::cast_floating(x, *cast_inputs_);
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

NoSyncScope::NoSyncScope(WrapPointImpl& root) : root_(root), previous_(root.runtime().no_sync()) {
  root_.runtime().set_no_sync(true);
}

NoSyncScope::~NoSyncScope() { root_.runtime().set_no_sync(previous_); }

FullParamsScope::FullParamsScope(WrapPointImpl& root, FullParamsOptions options)
    : root_(root), options_(options) {
  auto& rt = root_.runtime();
  const bool keep = !options_.rank0_only || rt.options().process_group.rank() == 0;
  for (auto& u : rt.units()) {
    u->unshard();
    if (!keep) u->reshard();
  }
}

FullParamsScope::~FullParamsScope() {
  auto& rt = root_.runtime();
  const bool kept = !options_.rank0_only || rt.options().process_group.rank() == 0;
  const bool writeback = options_.writeback && kept && rt.options().mixed_precision.param_dtype == at::kFloat;
  at::NoGradGuard no_grad;
  for (auto& u : rt.units()) {
    if (writeback && u->state() == detail::UnitState::kUnsharded) {
      for (auto& f : u->flats()) {
        const int64_t r = rt.flat_config().shard_group->rank();
        f->shard().copy_(f->full().narrow(0, r * f->shard_numel(), f->shard_numel()));
      }
    }
    u->reshard();
  }
  rt.wait_transfers();  // the caller may write the host shards next (an optimizer step)
}

std::vector<std::pair<std::string, torch::Tensor>> full_state_dict(WrapPointImpl& root,
                                                                   FullParamsOptions options) {
  auto& rt = root.runtime();
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
