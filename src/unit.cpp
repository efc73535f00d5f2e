#include "unit.h"

#include "runtime.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::detail {

const char* to_string(UnitState s) {
  switch (s) {
    case UnitState::kSharded:
      return "sharded";
    case UnitState::kGathering:
      return "gathering";
    case UnitState::kUnsharded:
      return "unsharded";
  }
  return "?";
}

Unit::~Unit() {
  for (auto& w : pending_) {
    try {
      w->wait();
    } catch (const std::exception&) {
      // A failed collective (e.g. a peer died) leaves nothing in flight to wait for.
    }
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
  if (state_ != UnitState::kSharded) return;
  for (auto& f : flats_) pending_.push_back(f->gather());
  state_ = UnitState::kGathering;
}

void Unit::unshard() {
  if (state_ == UnitState::kUnsharded) return;
  start_gather();
  for (auto& w : pending_) w->wait();
  pending_.clear();
  state_ = UnitState::kUnsharded;
}

void Unit::reshard() {
  if (state_ == UnitState::kSharded) return;
  for (auto& w : pending_) w->wait();
  pending_.clear();
  for (auto& f : flats_) f->release();
  state_ = UnitState::kSharded;
}

namespace {

// Fires after AccumulateGrad has written an original parameter's .grad(): the
// post-backward trigger of docs/design.md, "The engine".
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  PostAccumulateHook(Unit* unit, FlatParam* flat, size_t slot) : unit_(unit), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    unit_->on_param_grad(*flat_, slot_);
    return outputs;
  }

 private:
  Unit* unit_;
  FlatParam* flat_;
  size_t slot_;
};

}  // namespace

void Unit::register_grad_hooks() {
  for (auto& f : flats_) {
    if (!f->trainable()) continue;
    for (size_t i = 0; i < f->slots().size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(f->slots()[i].param);
      TORCH_INTERNAL_ASSERT(acc != nullptr, "no grad accumulator for ", f->slots()[i].fqn);
      acc->add_post_hook(std::make_unique<PostAccumulateHook>(this, f.get(), i));
      f->grad_accumulators().push_back(std::move(acc));
    }
  }
}

void Unit::on_param_grad(FlatParam& flat, size_t slot) {
  TORCH_CHECK(state_ == UnitState::kUnsharded, "FSDP unit ", display_name(),
              ": a gradient arrived while the unit is ", to_string(state_),
              ". Its parameters were used outside a call through its wrap point; call the "
              "wrapped module only through FullyShardedModule.");
  rt_->queue_end_of_backward();  // also when no unit output had a pre-backward hook
  if (!flat.take_grad(slot)) return;
  if (rt_->no_sync()) {
    flat.end_pass();  // keep the unsharded gradient; a later backward reduces it
  } else {
    flat.reduce_grad();
    rt_->reduce_started(flat);
    rt_->sync_grad_counter();
  }
  grads_reduced = true;
  // Note [Frozen parameters and reshard]
  // Frozen parameters have no accumulator to tell us when backward is done with them:
  // an op computing an input gradient may still read them after the trainable ones
  // reported. Units holding frozen parameters therefore reshard at the end of backward.
  if (!has_frozen()) reshard();
}

void Unit::flush_grads() {
  bool any = false;
  for (auto& f : flats_) {
    if (!f->trainable()) continue;
    if (rt_->no_sync()) {
      f->end_pass();
      continue;
    }
    if (f->has_unreduced_grad()) {
      f->reduce_grad();
      rt_->reduce_started(*f);
      any = true;
    }
  }
  if (any) {
    grads_reduced = true;
    rt_->sync_grad_counter();
  }
}

}  // namespace fsdp::detail
