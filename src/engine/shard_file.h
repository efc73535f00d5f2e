#pragma once
// One flat parameter's file (Note [NVMe parameters], in flat_param.cpp): where a flat
// parameter keeps its master shard, its gradient and its param_dtype copy when
// offload_param is on NVMe, and the transfers between that file and host buffers. The
// flat parameter decides what is current and when; this type moves the bytes.

#include "accounting.h"

#include <torch/torch.h>

#include <memory>
#include <string>

namespace fsdp::detail::nvme {
class StateFile;
class IoEngine;
}  // namespace fsdp::detail::nvme

namespace fsdp::detail {

class ShardFile {
 public:
  /// Where the file keeps its parts (byte offsets; the master at 0) and its size: each
  /// region padded to 4096 bytes; a gradient for a trainable flat parameter, and a
  /// param_dtype copy when it computes in another dtype than its master's.
  struct Layout {
    int64_t grad = 0, copy = 0, bytes = 0;
  };
  static Layout layout(int64_t shard_numel, bool trainable, at::ScalarType master_dtype,
                       at::ScalarType param_dtype);

  /// Reserves the file under `dir` (unlinked at once) with `master`'s values written at
  /// offset 0; counted in MemoryStats::nvme_params while it lives. `io` queues the
  /// transfers read_ahead() and store_grad() do not wait for; host buffers are pinned when
  /// `device` is a GPU.
  ShardFile(const std::string& dir, const at::Tensor& master, bool trainable,
            at::ScalarType param_dtype, at::Device device, std::shared_ptr<nvme::IoEngine> io,
            Accounting* acct);
  /// Waits for the read and the write in flight (never throws).
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  /// The master shard, its gradient and the param_dtype copy as tensors over the file's
  /// shared mapping (what optimizers, checkpoints and clipping read and write).
  at::Tensor master_view() const;
  at::Tensor grad_view() const;
  at::Tensor copy_view() const;

  /// Queues the read of the copy (`fresh`) or the master into a host buffer, recording the
  /// shard's `version`; no-op while one is queued.
  void read_ahead(bool fresh, int64_t version);
  /// The next gather's input: the queued read when it is of the same part at the same
  /// version (waited for, counted as read ahead), else a read now.
  at::Tensor take_read(bool fresh, int64_t version);
  /// Waits for a queued read and drops it.
  void drop_read();

  /// Writes the gradient: `grad` as it is (`first`), or added to the one in the file.
  /// Queued, not waited for: settle_grad_write() waits.
  void store_grad(const at::Tensor& grad, bool first);
  /// Waits for store_grad()'s write, if one is queued, and frees its buffer.
  void settle_grad_write();
  /// The gradient read into a host buffer, and written back from one.
  at::Tensor read_grad() const;
  void write_grad(const at::Tensor& host) const;

 private:
  /// A host tensor of `numel` `dtype` elements over a new page-aligned buffer of whole
  /// pages (the tail zeroed), counted in offload_buffers while it lives: what the file's
  /// O_DIRECT transfers move.
  at::Tensor host_buffer(int64_t numel, at::ScalarType dtype) const;
  /// A host_buffer() read from byte `offset` of the file.
  at::Tensor read(int64_t offset, int64_t numel, at::ScalarType dtype) const;
  /// Writes a host_buffer() tensor (its whole pages) at byte `offset`.
  void write(const at::Tensor& host, int64_t offset) const;

  int64_t shard_numel_;
  at::ScalarType master_dtype_, param_dtype_;
  at::Device device_;
  std::shared_ptr<nvme::IoEngine> io_;
  Accounting* acct_;
  Layout layout_;
  std::unique_ptr<nvme::StateFile> file_;
  /// A gather's input read ahead (read_ahead()), until take_read() takes it.
  struct ReadAhead {
    int64_t ticket = -1;   ///< the queued read; -1: none
    at::Tensor buf;        ///< a host_buffer() the read fills
    bool fresh = false;    ///< of the copy (else the master)
    int64_t version = -1;  ///< the shard's version when queued
  } ahead_;
  /// store_grad()'s write in flight: its ticket (-1: none) and the host_buffer() it writes.
  struct GradWrite {
    int64_t ticket = -1;
    at::Tensor buf;
  } grad_write_;
};

}  // namespace fsdp::detail
