#pragma once
// FusedAdamW's optimizer state in files (Note [NVMe optimizer state] in nvme_adamw.cpp):
// ShardingOptions::offload_optimizer with OffloadDevice::kNvme, or
// FusedAdamW::offload_state for plain parameters.

#include <fsdp/options.h>
#include <fsdp/process_group.h>

#include "adamw_kernels.h"

#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp::detail {

namespace offload {
class IoEngine;
class StateFile;
class AlignedBuffer;
struct FileSpan;
enum class IoOp;
}  // namespace offload

class NvmeAdamState {
 public:
  /// Checks config.nvme_path (`field` names it in errors) and reserves a file there for
  /// the exp_avg and exp_avg_sq of every parameter in `params`. With `group` (the model's
  /// process group; collective then), the free space is checked for all its ranks that
  /// share a disk together (Note [Shared NVMe disk]), then for this rank's own file.
  NvmeAdamState(const OffloadConfig& config, const std::vector<torch::Tensor>& params,
                const std::string& field, const ProcessGroup* group = nullptr);
  ~NvmeAdamState();

  /// A new state for `p`: step 0, moments zero, as views of its region of the file.
  std::unique_ptr<torch::optim::AdamWParamState> fresh_state(const torch::Tensor& p);
  /// Moments that are not `p`'s views (a checkpoint's, loaded into the optimizer) go to
  /// the file, and the state holds the views again, so host memory is given back.
  void adopt(const torch::Tensor& p, torch::optim::AdamWParamState& st);
  /// Queues `p`'s update (its fp32 gradient `g`, the step's constants, the optional
  /// 16-bit copy) for run().
  void queue(const torch::Tensor& p, torch::Tensor g, const AdamWConstants& c, uint16_t* out,
             CopyOutDtype kind, std::shared_ptr<std::atomic<int64_t>> written);
  /// Steps everything queued, streaming the moments through the buffers.
  void run(KernelIsa isa);

  /// Elements per chunk of each moment (from OffloadConfig::buffer_bytes).
  int64_t chunk_elements() const { return chunk_; }
  /// "io_uring" or "threads".
  const char* io_engine_name() const;
  /// Whether the file uses O_DIRECT.
  bool direct_io() const;
  /// Bytes read and written by run() so far.
  int64_t io_bytes() const { return io_bytes_; }
  /// Whether the parameters are views of parameter files, streamed with the moments
  /// (offload_param = nvme; Note [NVMe parameters]).
  bool streams_params() const { return stream_params_; }

 private:
  struct Region {
    int64_t m = 0, v = 0;  ///< byte offsets of exp_avg and exp_avg_sq in the file
    int64_t numel = 0;
    bool zero = true;  ///< still as reserved (zeros): a fresh state needs no write
  };
  struct Job {
    torch::Tensor p, g;
    const Region* region;
    AdamWConstants c;
    uint16_t* out;
    CopyOutDtype kind;
    std::shared_ptr<std::atomic<int64_t>> written;
  };
  Region& region(const torch::Tensor& p);
  /// Writes `numel` floats of `src` to the file at `offset` (through the I/O buffers).
  void write_through(const float* src, int64_t numel, int64_t offset);

  std::unique_ptr<offload::StateFile> file_;
  std::unique_ptr<offload::IoEngine> io_;
  std::unique_ptr<offload::AlignedBuffer> buffers_;  ///< 3 slots of (m, v) chunks
  std::unordered_map<const void*, Region> regions_;  ///< by parameter TensorImpl
  /// Bytes per element of a slot when parameters stream too: m, v, p, g (fp32), the copy;
  /// and the slot's pages of room for ranges that start inside a page (move()).
  static constexpr int64_t kParamSlotBytes = 18;
  static constexpr int64_t kParamSlotExtra = 6 * 4096;
  /// Bytes of one of the three slots.
  int64_t slot_bytes() const;
  /// Moves bytes [s, e) of the tensor at `f` between its file and `buf` (Note [NVMe
  /// parameters]); the O_DIRECT ticket or -1.
  int64_t move(offload::IoOp op, const offload::FileSpan& f, bool whole, int64_t s, int64_t e,
               char* buf);

  std::vector<Job> jobs_;
  bool stream_params_ = false;
  int64_t chunk_ = 0;
  int64_t io_bytes_ = 0;
};

}  // namespace fsdp::detail
