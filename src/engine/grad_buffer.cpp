#include "grad_buffer.h"

namespace fsdp::detail {

GradBuffer::GradBuffer(FlatParam& flat)
    : flat_(flat),
      direct_(flat.aliased() && flat.config().world_size == 1 &&
              flat.config().reduce_dtype == flat.config().master_dtype),
      // Note [Gradients in the shard]
      // At world size 1 nothing is reduced, so the unsharded flat gradient (reduce_dtype)
      // and its cast into the gradient shard afterwards are a copy too many: each
      // parameter's gradient is cast into its slice of the gradient shard as it arrives
      // (the same values: a reduction over one rank in any dtype is the identity). With
      // offload or NVMe parameters the shard lives elsewhere, and CommContext moves it.
      in_shard_(!direct_ && flat.config().world_size == 1 && !flat.config().offload &&
                !flat.in_file()) {
  TORCH_INTERNAL_ASSERT(flat.trainable());
}

void GradBuffer::zero_unwritten(const at::Tensor& flat) const {
  at::NoGradGuard no_grad;
  const auto& slots = flat_.slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!written_[i]) flat.narrow(0, slots[i].offset, slots[i].numel).zero_();
  }
  const int64_t numel = flat_.numel(), padded = flat_.padded_numel();
  if (padded > numel) flat.narrow(0, numel, padded - numel).zero_();
}

void GradBuffer::finish_in_shard() {
  if (!in_shard_ || !fresh_) return;
  fresh_ = false;
  zero_unwritten(flat_.shard().grad());
}

void GradBuffer::link() {
  if (!direct_) return;
  at::NoGradGuard no_grad;
  const at::Tensor& shard = flat_.shard();
  if (!shard.grad().defined()) {
    shard.mutable_grad() = at::zeros_like(shard);
    flat_.count_grad();
  }
  const auto& g = shard.grad();
  for (const auto& s : flat_.slots()) {
    const auto& pg = s.param.grad();
    if (pg.defined() && pg.data_ptr() == g.narrow(0, s.offset, 1).data_ptr()) continue;
    s.param.mutable_grad() = g.narrow(0, s.offset, s.numel).view(s.shape);
  }
}

void GradBuffer::unlink() {
  if (!direct_) return;
  for (const auto& s : flat_.slots()) s.param.mutable_grad() = at::Tensor();
}

bool GradBuffer::take(size_t slot) {
  const auto& slots = flat_.slots();
  TORCH_INTERNAL_ASSERT(slot < slots.size());
  at::NoGradGuard no_grad;
  const ParamSlot& s = slots[slot];
  if (direct_) {
    // Normally already accumulated in place into the gradient shard (link()); a
    // gradient that arrived elsewhere (no pre-backward hook ran) is added here.
    const at::Tensor& shard = flat_.shard();
    const auto& pg = s.param.grad();
    if (!shard.grad().defined()) {
      shard.mutable_grad() = at::zeros_like(shard);
      flat_.count_grad();
    }
    const auto& g = shard.grad();
    if (pg.defined() && pg.data_ptr() != g.narrow(0, s.offset, 1).data_ptr()) {
      g.narrow(0, s.offset, s.numel).view(s.shape).add_(pg);
      s.param.mutable_grad() = g.narrow(0, s.offset, s.numel).view(s.shape);
    }
    return ++taken_ == static_cast<int>(slots.size());
  }
  const FlatConfig& cfg = flat_.config();
  if (in_shard_) {
    const at::Tensor& shard = flat_.shard();
    if (!shard.grad().defined()) {
      // Not zero-filled: finish_in_shard() zeroes what no slot wrote.
      shard.mutable_grad() = at::empty_like(shard);
      flat_.count_grad();
      fresh_ = true;
      written_.assign(slots.size(), false);
    }
    if (s.param.grad().defined()) {
      auto dst = shard.grad().narrow(0, s.offset, s.numel).view(s.shape);
      if (fresh_ && !written_[slot]) {
        dst.copy_(s.param.grad());
      } else {
        dst.add_(s.param.grad());
      }
      if (fresh_) written_[slot] = true;
      s.param.mutable_grad() = at::Tensor();
    }
    return ++taken_ == static_cast<int>(slots.size());
  }
  if (!full_.defined()) {
    // Not zero-filled: each slot is written once below, and take_for_reduction() zeroes
    // the slots that never reported and the padding.
    full_ = at::empty({flat_.padded_numel()}, flat_.shard().options().dtype(cfg.reduce_dtype));
    written_.assign(slots.size(), false);
    Accounting::alloc(cfg.acct->mem.comm_buffers, static_cast<int64_t>(full_.nbytes()));
  }
  auto dst = full_.narrow(0, s.offset, s.numel).view(s.shape);
  if (s.param.grad().defined()) {
    if (written_[slot]) {
      dst.add_(s.param.grad());
    } else {
      dst.copy_(s.param.grad());
    }
    written_[slot] = true;
    s.param.mutable_grad() = at::Tensor();
  }
  return ++taken_ == static_cast<int>(slots.size());
}

at::Tensor GradBuffer::take_for_reduction() {
  taken_ = 0;
  finish_in_shard();
  if (direct_ || !full_.defined()) return {};
  zero_unwritten(full_);
  return std::exchange(full_, at::Tensor());
}

}  // namespace fsdp::detail
