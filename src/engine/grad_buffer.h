#pragma once
// A trainable flat parameter's unsharded gradient while backward produces it, one
// original parameter at a time (docs/design.md, "The engine").

#include "flat_param.h"

#include <torch/torch.h>

#include <vector>

namespace fsdp::detail {

class GradBuffer {
 public:
  /// For `flat` (trainable), which must outlive the buffer.
  explicit GradBuffer(FlatParam& flat);
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  /// World size 1 in fp32 (see Note [Group of one]): gradients accumulate straight into
  /// the fp32 gradient shard and are never reduced.
  bool direct() const { return direct_; }
  /// Points each original parameter's .grad() into the gradient shard (direct only;
  /// called before backward). No-op otherwise.
  void link();
  /// After backward (direct only): drops the original parameters' .grad() views, so the
  /// gradient shard is the only owner of the bytes (zero_grad(set_to_none) frees them);
  /// link() points them again before the next backward.
  void unlink();
  /// Adds one original parameter's gradient into the flat gradient and frees it.
  /// Returns true once every slot has reported in this backward.
  bool take(size_t slot);
  /// True when some slot has reported in the current backward pass.
  bool pending() const { return taken_ > 0; }
  /// True when gradients are held unreduced (pending, or kept across passes by no_sync).
  bool unreduced() const { return taken_ > 0 || full_.defined(); }
  /// Ends a backward pass without reducing: the flat gradient stays and later passes add
  /// to it (no_sync).
  void end_pass() {
    finish_in_shard();
    taken_ = 0;
  }
  /// Hands over the flat gradient to reduce (reduce_dtype, padded_numel elements), with
  /// the slots that never reported and the padding zeroed, and starts afresh. It stays
  /// counted in comm_buffers until its reduction finishes (CommContext). Undefined when
  /// there is nothing to reduce (direct, or no gradient arrived).
  at::Tensor take_for_reduction();

 private:
  /// in_shard: at the end of a pass, zero what no slot wrote in a gradient shard this
  /// pass allocated.
  void finish_in_shard();
  /// Zeroes the slots of `flat` (padded_numel elements) that no gradient wrote
  /// (written_), and its padding.
  void zero_unwritten(const at::Tensor& flat) const;

  FlatParam& flat_;
  bool direct_;
  /// World size 1 with another compute dtype, no offload (Note [Gradients in the shard]):
  /// each parameter's gradient is cast into the gradient shard as it arrives.
  bool in_shard_;
  bool fresh_ = false;         ///< in_shard: this pass allocated the gradient shard (not zeroed)
  at::Tensor full_;            ///< reduce_dtype, padded elements, while gradients arrive
  std::vector<bool> written_;  ///< slots whose gradient arrived since the last reduction
  int taken_ = 0;              ///< slots reported in this backward
};

}  // namespace fsdp::detail
