#include "unit.h"

#include "runtime.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::detail {

const char* to_string(ShardedState s) {
  switch (s) {
    case ShardedState::kSharded:
      return "sharded";
    case ShardedState::kGathering:
      return "gathering";
    case ShardedState::kUnsharded:
      return "unsharded";
  }
  return "?";
}

namespace {

// Fires after AccumulateGrad has written an original parameter's .grad(): the
// post-backward trigger of docs/design.md, "The engine".
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  PostAccumulateHook(Unit* unit, size_t flat, size_t slot) : unit_(unit), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    unit_->on_param_grad(flat_, slot_);
    return outputs;
  }

 private:
  Unit* unit_;
  size_t flat_;
  size_t slot_;
};

}  // namespace

Runtime& Unit::runtime() const {
  TORCH_CHECK(rt_ != nullptr, "FSDP unit ", display_name(),
              ": the sharded model it belonged to has been destroyed; keep the handle "
              "fully_shard() returned alive while its modules are used");
  return *rt_;
}

void Unit::detach() {
  grads_.clear();  // they refer to the flat parameters
  flats_.clear();
  state_ = ShardedState::kSharded;
  rt_ = nullptr;
}

void Unit::add_flat(std::unique_ptr<FlatParam> flat) {
  const size_t index = flats_.size();
  FlatParam& f = *flat;
  flats_.push_back(std::move(flat));
  grads_.push_back(f.trainable() ? std::make_unique<GradBuffer>(f) : nullptr);
  if (!f.trainable()) return;
  for (size_t i = 0; i < f.slots().size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(f.slots()[i].param);
    TORCH_INTERNAL_ASSERT(acc != nullptr, "no grad accumulator for ", f.slots()[i].fqn);
    acc->add_post_hook(std::make_unique<PostAccumulateHook>(this, index, i));
    f.grad_accumulators().push_back(std::move(acc));
  }
}

bool Unit::has_frozen() const {
  for (const auto& f : flats_) {
    if (!f->trainable()) return true;
  }
  return false;
}

int64_t Unit::full_bytes() const {
  int64_t b = 0;
  for (const auto& f : flats_) b += f->full_bytes();
  return b;
}

void Unit::start_gather() {
  if (state_ != ShardedState::kSharded) return;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& f : flats_) works.push_back(f->gather());
  runtime().comm().add_gathers(*this, std::move(works));
  state_ = ShardedState::kGathering;
}

void Unit::unshard() {
  if (state_ == ShardedState::kUnsharded) return;
  start_gather();
  runtime().comm().wait_gathers(*this);
  state_ = ShardedState::kUnsharded;
}

void Unit::reshard() {
  if (state_ == ShardedState::kSharded) return;
  runtime().comm().wait_gathers(*this);
  for (auto& f : flats_) f->release();
  state_ = ShardedState::kSharded;
}

void Unit::link_grads() {
  for (auto& g : grads_) {
    if (g) g->link();
  }
}

void Unit::unlink_grads() {
  for (auto& g : grads_) {
    if (g) g->unlink();
  }
}

void Unit::reduce(size_t i) {
  if (runtime().no_sync()) {
    grads_[i]->end_pass();  // keep the unsharded gradient; a later backward reduces it
  } else {
    runtime().comm().reduce(*flats_[i], grads_[i]->take_for_reduction());
  }
}

void Unit::on_param_grad(size_t flat, size_t slot) {
  TORCH_CHECK(state_ == ShardedState::kUnsharded, "FSDP unit ", display_name(),
              ": a gradient arrived while the unit is ", to_string(state_),
              ". Its parameters were used outside a call through its wrap point; call the "
              "wrapped module only through FullyShardedModule.");
  runtime().queue_end_of_backward();  // also when no unit output had a pre-backward hook
  if (!grads_.at(flat)->take(slot)) return;
  reduce(flat);
  if (!runtime().no_sync()) runtime().sync_grad_counter();
  grads_reduced = true;
  // Note [Frozen parameters and reshard]
  // Frozen parameters have no accumulator to tell us when backward is done with them:
  // an op computing an input gradient may still read them after the trainable ones
  // reported. Units holding frozen parameters therefore reshard at the end of backward.
  if (!has_frozen()) reshard();
}

void Unit::flush_grads() {
  bool any = false;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (!grads_[i]) continue;
    if (runtime().no_sync()) {
      grads_[i]->end_pass();
      continue;
    }
    if (grads_[i]->unreduced()) {
      reduce(i);
      any = true;
    }
  }
  if (any) {
    grads_reduced = true;
    runtime().sync_grad_counter();
  }
}

}  // namespace fsdp::detail
