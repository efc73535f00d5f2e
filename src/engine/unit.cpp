#include "unit.h"

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

CommContext& Unit::comm() const {
  // Every call reaches a unit through its live runtime; a wrap point whose model is gone
  // fails before that (EngineAccess::runtime), naming the fix.
  TORCH_INTERNAL_ASSERT(comm_ != nullptr, "unit ", display_name(), " used after its runtime");
  return *comm_;
}

void Unit::detach() {
  grads_.clear();  // they refer to the flat parameters
  flats_.clear();
  state_ = ShardedState::kSharded;
  comm_ = nullptr;
}

void Unit::add_flat(std::unique_ptr<FlatParam> flat) {
  FlatParam& f = *flat;
  flats_.push_back(std::move(flat));
  grads_.push_back(f.trainable() ? std::make_unique<GradBuffer>(f) : nullptr);
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
  for (auto& f : flats_) works.push_back(comm().all_gather(*f));
  comm().add_gathers(*this, std::move(works));
  state_ = ShardedState::kGathering;
}

void Unit::read_ahead() {
  if (state_ != ShardedState::kSharded) return;
  for (auto& f : flats_) f->read_ahead();
}

int64_t Unit::numel() const {
  int64_t n = 0;
  for (const auto& f : flats_) n += f->padded_numel();
  return n;
}

bool Unit::changed_since_gather() const {
  for (const auto& f : flats_) {
    if (f->changed_since_gather()) return true;
  }
  return false;
}

bool Unit::stale() const {
  for (const auto& f : flats_) {
    if (f->stale()) return true;
  }
  return false;
}

void Unit::unshard() {
  // Note [Persistent parameters]: full parameters kept across an optimizer step are
  // gathered again before use.
  if (state_ == ShardedState::kUnsharded && stale()) reshard();
  if (state_ == ShardedState::kUnsharded) return;
  start_gather();
  comm().wait_gathers(*this);
  state_ = ShardedState::kUnsharded;
}

void Unit::reshard(bool keep_slice) {
  if (state_ == ShardedState::kSharded) {
    if (!keep_slice) {
      for (auto& f : flats_) f->release();  // drops post-forward slices
    }
    return;
  }
  comm().wait_gathers(*this);
  for (auto& f : flats_) f->release(keep_slice);
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

void Unit::reduce(size_t i, bool at_end) {
  if (!comm().gradient_sync() || (defer_reduction && !at_end)) {
    grads_[i]->end_pass();  // keep the unsharded gradient; a later backward reduces it
  } else {
    comm().reduce(*flats_[i], grads_[i]->take_for_reduction());
  }
}

void Unit::on_param_grad(size_t flat, size_t slot) {
  TORCH_CHECK(state_ == ShardedState::kUnsharded, "FSDP unit ", display_name(),
              ": a gradient arrived while the unit is ", to_string(state_),
              ". Its parameters were used outside a call through its wrap point; call the "
              "wrapped module only through FullyShardedModule.");
  if (!grads_.at(flat)->take(slot)) return;
  reduce(flat, /*at_end=*/false);
  grads_reduced = true;
  // Note [Frozen parameters and reshard]
  // Frozen parameters have no accumulator to tell us when backward is done with them:
  // an op computing an input gradient may still read them after the trainable ones
  // reported. Units holding frozen parameters therefore reshard at the end of backward.
  if (!has_frozen() && reshard_after_backward) reshard();
  backward_span.close();
}

void Unit::flush_grads() {
  bool any = false;
  for (size_t i = 0; i < flats_.size(); ++i) {
    if (!grads_[i]) continue;
    if (!comm().gradient_sync()) {
      grads_[i]->end_pass();
      continue;
    }
    if (grads_[i]->unreduced()) {
      reduce(i, /*at_end=*/true);
      any = true;
    }
  }
  if (any) grads_reduced = true;
}

}  // namespace fsdp::detail
