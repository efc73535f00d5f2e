#include "runtime.h"

#include "comm/collective_ring.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>

namespace fsdp::detail {

const char* to_string(Phase s) {
  switch (s) {
    case Phase::kIdle:
      return "idle";
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
  }
  return "?";
}

Runtime::Runtime(ShardingOptions options) : options_(std::move(options)) {
  const std::string dir = trace::directory_from(options_.trace);
  if (!dir.empty()) {
    // Note [Per-unit trace]: the ranks leave this barrier together, which is where the
    // merge tool aligns their clocks.
    const ProcessGroup& pg = options_.process_group;
    // Files are named by the job's rank: a model over a subgroup (a pipeline's stage)
    // has ranks that repeat across the subgroups.
    int rank = pg.rank(), world = pg.size();
    try {
      const LaunchEnv env = read_launch_env();
      if (env.world_size > world) rank = env.rank, world = env.world_size;
    } catch (const c10::Error&) {  // no consistent launcher environment: the group's ranks
    }
    trace::start(dir, rank, world);
    barrier(*GroupAccess::backend(pg));
    trace::mark_sync();
  }
}

Runtime::~Runtime() {
  comm_.reset();  // waits for gathers in flight into the flat parameters' buffers
  for (auto& u : units_) {
    u->forward_span.close();
    u->backward_span.close();
  }
  if (trace::on()) trace::flush();
  flats_.clear();
  for (auto& u : units_) u->detach();
}

void Runtime::set_flat_config(const FlatConfig& cfg) {
  TORCH_INTERNAL_ASSERT(comm_ == nullptr, "set_flat_config: the runtime is configured once");
  flat_cfg_ = cfg;
  comm_ = std::make_unique<CommContext>(&acct_, cfg.transfers);
}

Unit& Runtime::add_unit(const std::string& fqn) {
  TORCH_INTERNAL_ASSERT(comm_ != nullptr, "add_unit before set_flat_config");
  units_.push_back(std::make_shared<Unit>(fqn, static_cast<int>(units_.size()), *comm_));
  Unit& u = *units_.back();
  u.defer_reduction = options_.strategy == ShardingStrategy::kZero1;
  return u;
}

namespace {

// Fires after AccumulateGrad has written an original parameter's .grad(): the
// post-backward trigger of docs/design.md, "The engine". It holds the runtime weakly:
// a graph may outlive the model it was built with.
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  PostAccumulateHook(std::weak_ptr<Runtime> runtime, Unit* unit, size_t flat, size_t slot)
      : runtime_(std::move(runtime)), unit_(unit), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    auto rt = runtime_.lock();
    TORCH_CHECK(rt != nullptr,
                "FSDP: a gradient arrived for a sharded model that has been destroyed; keep the "
                "handle fully_shard() returned alive while its modules are used");
    rt->on_param_grad(*unit_, flat_, slot_);
    return outputs;
  }

 private:
  std::weak_ptr<Runtime> runtime_;
  Unit* unit_;
  size_t flat_;
  size_t slot_;
};

}  // namespace

void Runtime::add_flat(Unit& u, std::unique_ptr<FlatParam> flat) {
  // Units get their flats in turn, so flats_ keeps the model view's (unit) order.
  TORCH_INTERNAL_ASSERT(!units_.empty() && &u == units_.back().get(),
                        "flat parameters are added to the newest unit only");
  const size_t index = u.flats().size();
  FlatParam& f = *flat;
  u.add_flat(std::move(flat));
  flats_.push_back(&f);
  // Note [Persistent parameters]: by strategy, or by size (decided once the unit holds
  // all its flats: nothing runs before).
  const int64_t threshold = options_.persistence_threshold_numel;
  u.persistent = persistent() || (threshold > 0 && u.numel() < threshold);
  u.reshard_after_backward = !u.persistent;
  if (!f.trainable()) return;
  for (size_t i = 0; i < f.slots().size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(f.slots()[i].param);
    TORCH_INTERNAL_ASSERT(acc != nullptr, "no grad accumulator for ", f.slots()[i].fqn);
    acc->add_post_hook(std::make_unique<PostAccumulateHook>(weak_from_this(), &u, index, i));
    f.grad_accumulators().push_back(std::move(acc));
  }
}

void Runtime::on_param_grad(Unit& u, size_t flat, size_t slot) {
  queue_end_of_backward();  // also when no unit output had a pre-backward hook
  u.on_param_grad(flat, slot);
}

int Runtime::gathered_non_root() const {
  int n = 0;
  for (const auto& u : units_) {
    if (!u->is_root() && !u->persistent && u->state() != ShardedState::kSharded) ++n;
  }
  return n;
}

int64_t Runtime::gathered_non_root_numel(bool gathering_only) const {
  int64_t n = 0;
  for (const auto& u : units_) {
    if (u->is_root() || u->persistent || u->state() == ShardedState::kSharded) continue;
    if (!gathering_only || u->state() == ShardedState::kGathering) n += u->numel();
  }
  return n;
}

// Note [Persistent parameters]
// DeepSpeed's ZeRO-2 and ZeRO-1 (kZero2, kZero1) keep every rank's full parameters in
// param_dtype between steps: a unit is gathered once and stays gathered through forward,
// backward, eval forwards and further steps. An optimizer step changes the fp32 shards,
// which bumps their version counters; such a unit is stale (FlatParam::stale()). The
// root's forward reshards the stale units so that they are gathered again in order,
// with prefetch, as under kShardGradOp; a unit used before that gathers again in
// unshard(). Gradient accumulation without a step, and eval, gather nothing. The
// parameters' bytes (gathered_params, param_dtype) stay allocated across the step, as
// in DeepSpeed's 2Ψ term for fp16 parameters. set_reshard_after_backward(true) and
// ShardedModel::reshard() still free them on request.
bool Runtime::persistent() const {
  return options_.strategy == ShardingStrategy::kZero2 ||
         options_.strategy == ShardingStrategy::kZero1;
}

bool Runtime::reshard_after_forward(const Unit& u) const {
  if (u.persistent) return false;
  if (!at::GradMode::is_enabled()) return true;  // no backward will need them
  if (u.is_root()) return false;                 // needed again at once by backward
  return options_.strategy == ShardingStrategy::kFullShard ||
         options_.strategy == ShardingStrategy::kHybridShard;
}

Unit* Runtime::neighbour(const Unit& u, int step) const {
  auto it = std::find(forward_order_.begin(), forward_order_.end(), &u);
  if (it == forward_order_.end()) return nullptr;
  auto pos = (it - forward_order_.begin()) + step;
  if (pos < 0 || pos >= static_cast<long>(forward_order_.size())) return nullptr;
  return forward_order_[pos];
}

// Note [Prefetch bound]
// Prefetching gathers the next units (in forward order, or reverse order in backward)
// while the current one computes. It goes ahead only while fewer than
// max_gathered_units non-root units are gathered (the computing one included), so
// prefetching never holds more than that many units' full parameters.
// The root is gathered from its forward through backward, as in PyTorch FSDP, and units
// nested inside each other must be gathered together: those needs are met regardless.
// The root comes first in forward order, but its backward (the output layers) runs
// first: from the root, backward prefetch starts at the last unit in forward order.
// Two element bounds may stop it earlier (DeepSpeed's names): max_live_numel, the
// elements of the gathered non-root units with the next one added
// (stage3_max_live_parameters), and prefetch_bucket_numel, the elements of gathers issued
// ahead and not yet waited for (stage3_prefetch_bucket_size; the first prefetch always
// goes). Persistent units (Note [Persistent parameters]) count towards neither bound.
// Explicit lists (set_prefetch) replace this for their unit: each unit listed is gathered
// when the unit starts, whatever the bound, options_.prefetch or the recorded order say.
void Runtime::prefetch_from(const Unit& u, int direction) {
  prefetch_gathers(u, direction);
  if (flat_config().nvme_path.empty() || !options_.prefetch || (direction > 0 && !order_frozen_))
    return;
  // Note [NVMe parameters]: the first unit after those gathering reads its inputs from
  // the files now, beside the compute, so that its gather finds them read.
  for (int k = 1;; ++k) {
    Unit* next = prefetch_candidate(u, direction, k);
    if (next == nullptr) return;
    if (next->is_root() || next->state() != ShardedState::kSharded || next->grads_reduced) continue;
    next->read_ahead();
    return;
  }
}

Unit* Runtime::prefetch_candidate(const Unit& u, int direction, int k) const {
  // From the root, backward prefetch starts at the last unit in forward order.
  if (u.is_root() && direction < 0) {
    const long i = static_cast<long>(forward_order_.size()) - k;
    return i >= 0 ? forward_order_[static_cast<size_t>(i)] : nullptr;
  }
  return neighbour(u, direction * k);
}

void Runtime::prefetch_gathers(const Unit& u, int direction) {
  const auto& lists = explicit_prefetch_[direction > 0 ? 0 : 1];
  if (auto it = lists.find(&u); it != lists.end()) {
    for (Unit* next : it->second) {
      if (next->state() == ShardedState::kSharded && !next->grads_reduced) next->start_gather();
    }
    return;
  }
  if (!options_.prefetch || (direction > 0 && !order_frozen_)) return;
  // Persistent strategies hold every unit anyway: no bound (Note [Persistent parameters]).
  const int bound = persistent() ? std::numeric_limits<int>::max() : options_.max_gathered_units;
  const int64_t max_live = persistent() ? 0 : options_.max_live_numel;
  const int64_t bucket = options_.prefetch_bucket_numel;
  for (int k = 1; gathered_non_root() < bound; ++k) {
    Unit* next = prefetch_candidate(u, direction, k);
    if (next == nullptr) return;
    if (next->is_root() || next->state() != ShardedState::kSharded || next->grads_reduced) continue;
    // The element bounds (DeepSpeed's stage3_max_live_parameters and
    // stage3_prefetch_bucket_size); persistent units are gathered as needed, unbounded.
    if (!next->persistent) {
      if (max_live > 0 && gathered_non_root_numel(false) + next->numel() > max_live) return;
      const int64_t ahead = gathered_non_root_numel(true);
      if (bucket > 0 && ahead > 0 && ahead + next->numel() > bucket) return;
    }
    next->start_gather();
  }
}

// Note [Writes the version counter misses]: units still gathered from before (persistent
// ones) are gathered again when their shards changed on any rank of the shard group, which
// the ranks agree on in one small all-reduce (max) of a flag per such unit.
void Runtime::reshard_changed() {
  std::vector<Unit*> kept;
  for (auto& x : units_) {
    if (x->state() == ShardedState::kSharded) {
      x->reshard();
    } else {
      kept.push_back(x.get());
    }
  }
  if (kept.empty()) return;
  at::NoGradGuard no_grad;
  at::Tensor flags = at::zeros({static_cast<int64_t>(kept.size())}, at::kInt);
  for (size_t i = 0; i < kept.size(); ++i)
    flags[static_cast<int64_t>(i)] = kept[i]->changed_since_gather() ? 1 : 0;
  Backend& group = *flats_.front()->config().shard_group;
  if (group.size() > 1) {
    at::Tensor agreed = flags.to(options_.device);
    all_reduce(group, agreed, ReduceKind::kMax, &acct_, "the change check of units kept gathered");
    flags = agreed.to(at::kCPU);
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    if (flags[static_cast<int64_t>(i)].item<int>() != 0) kept[i]->reshard();
  }
}

void Runtime::pre_forward(Unit& u) {
  if (u.is_root() && at::GradMode::is_enabled() && phase_ == Phase::kIdle) {
    phase_ = Phase::kForward;  // a new iteration: its own step counters
    acct_.comm.step = stats::CommStats();
  }
  if (u.is_root() && phase_ != Phase::kBackward) {
    // Slices a forward left for a backward that never came (Note [Post-forward slices])
    // are not reused: an optimizer step may have come between.
    reshard_changed();
  }
  u.forward_span.open("forward", [&]() {
    return (phase_ == Phase::kBackward ? "recompute " : "forward ") + u.trace_name();
  });
  if (!order_frozen_ &&
      std::find(forward_order_.begin(), forward_order_.end(), &u) == forward_order_.end()) {
    forward_order_.push_back(&u);
  }
  u.unshard();
  prefetch_from(u, +1);
}

void Runtime::post_forward(Unit& u, std::vector<at::Tensor>& outputs) {
  if (at::GradMode::is_enabled()) {
    auto self = shared_from_this();
    Unit* unit = &u;
    for (auto& t : outputs) {
      if (!t.requires_grad()) continue;
      t.register_hook([self, unit](const at::Tensor&) { self->pre_backward(*unit); });
    }
  }
  // A training forward keeps post-forward slices where configured (Note [Post-forward slices]).
  if (reshard_after_forward(u)) u.reshard(/*keep_slice=*/at::GradMode::is_enabled());
  if (u.is_root() && !at::GradMode::is_enabled()) {
    // Eval forward: nothing stays gathered, and the order seen is the order to prefetch.
    // No copy from the host shards may still be in flight once it returns: the caller
    // may write them (Note [Offload transfers]).
    for (auto& x : units_) {
      if (!x->persistent) x->reshard();
    }
    wait_transfers();
    order_frozen_ = true;
  }
  u.forward_span.close();
}

void Runtime::queue_end_of_backward() {
  if (phase_ == Phase::kBackward) return;
  phase_ = Phase::kBackward;
  for (auto& f : backward_observers_) f(true);
  recount_grads();  // before this backward gives any shard a gradient
  auto self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [self]() { self->end_of_backward(); });
}

void Runtime::pre_backward(Unit& u) {
  queue_end_of_backward();
  if (u.grads_reduced) return;  // its gradients are done; nothing left to compute with it
  if (!u.backward_span.is_open()) {
    u.backward_span.open("backward", [&]() { return "backward " + u.trace_name(); });
  }
  u.link_grads();
  u.unshard();
  prefetch_from(u, -1);
}

void Runtime::end_of_backward() {
  TORCH_INTERNAL_ASSERT(phase_ == Phase::kBackward, "end of backward while ", to_string(phase_));
  // Reduce in unit order so that every rank issues the same collectives.
  for (auto& u : units_) u->flush_grads();
  // Spans still open (the root's, units with frozen or unused parameters) end here,
  // innermost (last opened) first.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) (*it)->backward_span.close();
  trace::Scope finishing("backward", []() { return std::string("end of backward"); });
  comm_->finish_backward();
  for (auto& u : units_) {
    // set_reshard_after_backward(false) keeps gathered units for the next forward.
    if (u->reshard_after_backward || u->state() == ShardedState::kSharded) u->reshard();
    u->unlink_grads();
    u->grads_reduced = false;
  }
  phase_ = Phase::kIdle;
  order_frozen_ = true;
  for (auto& f : backward_observers_) f(false);
  recount_grads();
  shard_change_barrier();  // the step comes next
}

void Runtime::wait_transfers() { comm_->wait_transfers(); }

Unit& Runtime::unit_named(const std::string& fqn, const char* what) const {
  std::string names;
  Unit* found = nullptr;
  for (const auto& u : units_) {
    if (u->fqn() == fqn) found = u.get();
    names += (names.empty() ? "" : ", ") + ("'" + u->fqn() + "'");
  }
  TORCH_CHECK(found != nullptr, what, ": no unit is named '", fqn,
              "'; use one of the units' FQNs (clean names, '' for the root): ", names);
  return *found;
}

void Runtime::set_prefetch(const Unit& u, bool forward, std::vector<Unit*> targets) {
  explicit_prefetch_[forward ? 0 : 1][&u] = std::move(targets);
}

void Runtime::set_reshard_after_backward(bool on) {
  for (auto& u : units_) u->reshard_after_backward = on;
}

std::vector<at::Tensor> Runtime::grad_shards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    for (const auto& f : u->flats()) {
      if (f->trainable() && f->shard().grad().defined()) out.push_back(f->shard().grad());
    }
  }
  return out;
}

void Runtime::recount_grads() {
  // Decreases first: the peak never counts a freed gradient beside a new one.
  for (bool grow : {false, true}) {
    for (const auto& u : units_) {
      for (const auto& f : u->flats()) f->count_grad(grow);
    }
  }
}

}  // namespace fsdp::detail
