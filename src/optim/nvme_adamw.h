#pragma once
// FusedAdamW's optimizer state in files (Note [NVMe optimizer state] in nvme_adamw.cpp):
// ShardingOptions::offload_optimizer with OffloadDevice::kNvme, or
// FusedAdamW::offload_state for plain parameters.

#include <fsdp/options.h>
#include <fsdp/process_group.h>

#include "adamw_kernels.h"
#include "nvme/io_engine.h"
#include "nvme/state_file.h"

#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp::detail {

class NvmeAdamState {
 public:
  /// Checks config.nvme_path (`field` names it in errors) and reserves a file there for
  /// the exp_avg and exp_avg_sq of every parameter in `params`. With `group` (the model's
  /// process group; collective then), the free space is checked for all its ranks that
  /// share a disk together (Note [Shared NVMe disk]), then for this rank's own file.
  /// `param_buffer_bytes` (the model's offload_param.buffer_bytes with offload_param =
  /// nvme) joins config.buffer_bytes when the parameters stream through the slots too.
  NvmeAdamState(const OffloadConfig& config, const std::vector<torch::Tensor>& params,
                const std::string& field, const ProcessGroup* group = nullptr,
                int64_t param_buffer_bytes = 0);
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

  std::unique_ptr<nvme::StateFile> file_;
  std::unique_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::AlignedBuffer> buffers_;     ///< 3 slots of (m, v) chunks
  std::unordered_map<const void*, Region> regions_;  ///< by parameter TensorImpl
  /// Bytes per element of a slot when parameters stream too: m, v, p, g (fp32), the copy;
  /// and the slot's pages of room for ranges that start inside a page (move()).
  static constexpr int64_t kParamSlotBytes = 18;
  static constexpr int64_t kParamSlotExtra = 6 * 4096;
  /// Bytes of one of the three slots.
  int64_t slot_bytes() const;
  /// Where a job's parameter, gradient and 16-bit copy live: in a parameter file
  /// (streamed) or in memory (null file).
  struct Places {
    nvme::FileSpan p, g, out;
    bool whole = false;  ///< p is a whole shard: its gradient and copy are whole regions too
  };
  struct Chunk {
    const Job* job;
    const Places* at;
    int64_t begin, n;
  };
  static constexpr int kStreams = 5;  ///< m, v, p, g, out
  struct Tickets {
    int64_t id[kStreams] = {-1, -1, -1, -1, -1};
  };
  std::vector<Places> place_jobs() const;
  /// Stream `which` of slot k % 3 (page-aligned), and where chunk data starts in it.
  char* stream_at(size_t k, int which) const;
  char* data_at(size_t k, int which, const nvme::FileSpan& f, int64_t begin, int esize,
                bool whole) const;
  /// Queues chunk `ch`'s transfers in slot k % 3.
  Tickets issue(nvme::IoOp op, const Chunk& ch, size_t k);
  void wait(Tickets& t);
  /// The kernel over chunk `ch` in slot k % 3.
  void step_chunk(const Chunk& ch, size_t k, KernelIsa isa);
  /// Moves bytes [s, e) of the tensor at `f` between its file and `buf` (Note [NVMe
  /// parameters]); the O_DIRECT ticket or -1.
  int64_t move(nvme::IoOp op, const nvme::FileSpan& f, bool whole, int64_t s, int64_t e, char* buf);

  std::vector<Job> jobs_;
  bool stream_params_ = false;
  int64_t chunk_ = 0;
  int64_t io_bytes_ = 0;
};

}  // namespace fsdp::detail
