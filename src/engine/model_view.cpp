// The model view (src/internal/model_view.h and its views, one per client): what the engine lends
// about a sharded model to checkpoints, the optimizer and the training helpers, and the
// ShardedModel queries that read the same tables.
#include "engine_access.h"
#include "internal/sharded_model.h"

#include <map>

namespace fsdp {

namespace {
detail::Runtime& model_runtime(const ShardedModel& m) { return detail::EngineAccess::runtime(m); }

ParamInfo info_of(const detail::Unit& u, const detail::FlatParam& f, const detail::ParamSlot& s,
                  size_t k) {
  return ParamInfo{
      k == 0 ? s.fqn : s.aliases[k - 1], u.fqn(), f.trainable(), s.offset, s.numel, s.shape};
}

FlatParamInfo flat_info_of(const detail::Unit& u, const detail::FlatParam& f) {
  return FlatParamInfo{u.fqn(),   f.param_dtype(),  f.trainable(),
                       f.numel(), f.padded_numel(), f.shard_numel()};
}

// Flat parameter `index` in flat_params() order, or an error naming the count.
detail::FlatParam& flat_at(const ShardedModel& model, size_t index, const char* what) {
  const auto& flats = model_runtime(model).flats();
  TORCH_CHECK(index < flats.size(), what, ": index ", index, " is out of range; the model has ",
              flats.size(), " flat parameters");
  return *flats[index];
}
}  // namespace

std::vector<torch::Tensor> ShardedModel::sharded_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& u : model_runtime(*this).units()) {
    for (const auto& f : u->flats()) {
      if (f->trainable()) out.push_back(f->shard());
    }
  }
  return out;
}

std::vector<ParamInfo> ShardedModel::param_table() const {
  std::vector<ParamInfo> out;
  for (const auto& u : model_runtime(*this).units()) {
    for (const auto& f : u->flats()) {
      for (const auto& s : f->slots()) {
        for (size_t k = 0; k <= s.aliases.size(); ++k) out.push_back(info_of(*u, *f, s, k));
      }
    }
  }
  return out;
}

namespace detail {

std::vector<FlatParamInfo> flat_params(const ShardedModel& model) {
  std::vector<FlatParamInfo> out;
  for (const auto& u : model_runtime(model).units()) {
    for (const auto& f : u->flats()) out.push_back(flat_info_of(*u, *f));
  }
  return out;
}

void add_backward_observer(const ShardedModel& model, std::function<void(bool)> f) {
  model_runtime(model).add_backward_observer(std::move(f));
}

void set_shard_change_barrier(const ShardedModel& model, std::function<void()> barrier) {
  model_runtime(model).set_shard_change_barrier(std::move(barrier));
}

void set_save_hook(const ShardedModel& model,
                   std::function<void(const std::string&, const std::string&)> hook) {
  model_runtime(model).set_save_hook(std::move(hook));
}

void call_save_hook(const ShardedModel& model, const char* step, const std::string& what) {
  const auto& hook = model_runtime(model).save_hook();
  if (hook) hook(step, what);
}

std::function<void()> shard_change_barrier_of(const ShardedModel& model) {
  // Weakly: a FusedAdamW or a scope may outlive the model, whose barrier then has nothing
  // left to guard.
  std::weak_ptr<Runtime> runtime = model_runtime(model).shared_from_this();
  return [runtime] {
    if (auto r = runtime.lock()) r->shard_change_barrier();
  };
}

void rename_parameters(ShardedModel& model,
                       const std::function<std::string(const std::string&)>& name) {
  std::map<std::string, std::string> seen;  // new name -> old
  auto rename = [&](std::string& fqn) {
    std::string to = name(fqn);
    const auto [it, fresh] = seen.emplace(to, fqn);
    TORCH_CHECK(fresh, "renaming parameters: '", it->second, "' and '", fqn,
                "' would both be named '", to, "'; give each parameter a name of its own");
    fqn = std::move(to);
  };
  for (const auto& f : model_runtime(model).flats()) {
    for (auto& s : f->mutable_slots()) {
      rename(s.fqn);
      for (auto& a : s.aliases) rename(a);
    }
  }
}

std::vector<LocalShard> local_shards(const ShardedModel& model) {
  auto& rt = model_runtime(model);
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

torch::Tensor gather_flat(const ShardedModel& model, size_t index,
                          const torch::Tensor& shard_like) {
  detail::FlatParam& f = flat_at(model, index, "gather_flat");
  at::Tensor full = gather_like(f, shard_like);
  // Counted while the caller holds it: the deleter keeps the storage and releases the bytes.
  auto* acct = &model_runtime(model).acct();
  const int64_t bytes = full.numel() * static_cast<int64_t>(sizeof(float));
  Accounting::alloc(acct->mem.checkpoint_buffers, bytes);
  void* data = full.data_ptr();
  return torch::from_blob(
      data, {f.numel()},
      [full, acct, bytes](void*) mutable {
        Accounting::release(acct->mem.checkpoint_buffers, bytes);
        full.reset();
      },
      full.options());
}

std::vector<CopyOutTarget> copy_out_targets(const ShardedModel& model) {
  std::vector<CopyOutTarget> out;
  for (auto& u : model_runtime(model).units()) {
    for (auto& f : u->flats()) {
      auto [copy, version] = f->copy_out_target();
      if (copy.defined()) out.push_back({f->shard(), copy, version});
    }
  }
  return out;
}

void account_checkpoint_staging(const ShardedModel& model, int64_t delta) {
  auto& c = model_runtime(model).acct().mem.checkpoint_staging;
  if (delta >= 0) {
    Accounting::alloc(c, delta);
  } else {
    Accounting::release(c, -delta);
  }
}

std::map<std::string, torch::Tensor>& checkpoint_staging_pool(const ShardedModel& model) {
  return model_runtime(model).staging_pool();
}

int64_t copy_out_gathers(const ShardedModel& model) {
  int64_t n = 0;
  for (const auto& u : model_runtime(model).units()) {
    for (const auto& f : u->flats()) n += f->copy_out_gathers();
  }
  return n;
}

std::vector<torch::Tensor> grad_shards(const ShardedModel& model) {
  return model_runtime(model).grad_shards();
}

void visit_grad_shards(const ShardedModel& model, bool write,
                       const std::function<void(torch::Tensor&)>& fn) {
  for (auto& u : model_runtime(model).units()) {
    for (auto& f : u->flats()) {
      if (f->trainable() && f->shard().grad().defined()) f->visit_grad(write, fn);
    }
  }
}

void shard_group_all_reduce(const ShardedModel& model, const torch::Tensor& tensor, bool max) {
  all_reduce(*model_runtime(model).flat_config().shard_group, tensor,
             max ? ReduceKind::kMax : ReduceKind::kSum, nullptr,
             "a reduction over the shard group");
}

void gather_units(const ShardedModel& model, bool keep) {
  for (auto& u : model_runtime(model).units()) {
    u->unshard();
    if (!keep) u->reshard();
  }
}

void release_units(const ShardedModel& model, bool writeback) {
  auto& rt = model_runtime(model);
  at::NoGradGuard no_grad;
  for (auto& u : rt.units()) {
    if (writeback && u->state() == ShardedState::kUnsharded) {
      for (auto& f : u->flats()) {
        const int64_t r = rt.flat_config().shard_group->rank();
        f->shard().copy_(f->full().narrow(0, r * f->shard_numel(), f->shard_numel()));
      }
    }
    u->reshard();
  }
  rt.wait_transfers();  // the caller may write the host shards next (an optimizer step)
}

torch::Tensor full_flat_fp32(const ShardedModel& model, size_t index) {
  const FlatParam& f = flat_at(model, index, "full_flat_fp32");
  return gather_like(f, f.shard());
}

std::vector<FlatSlot> flat_slots(const ShardedModel& model, size_t index) {
  std::vector<FlatSlot> out;
  for (const auto& s : flat_at(model, index, "flat_slots").slots()) {
    FlatSlot fs{{s.fqn}, s.offset, s.numel, s.shape};
    fs.names.insert(fs.names.end(), s.aliases.begin(), s.aliases.end());
    out.push_back(std::move(fs));
  }
  return out;
}

}  // namespace detail

}  // namespace fsdp
