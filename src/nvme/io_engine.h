#pragma once
// Asynchronous positional file I/O for the NVMe offload (Note [NVMe optimizer state] in
// src/optim/nvme_adamw.cpp): reads and writes are queued, run while the caller computes,
// and waited for by ticket. Two engines, the same contract: io_uring (liburing, when the
// build found it and the kernel allows it) and a small thread pool of pread/pwrite (any
// POSIX system). With O_DIRECT files, buffers, offsets and lengths must be multiples of
// kIoAlign.

#include <cstdint>
#include <memory>
#include <string>

namespace fsdp::detail::nvme {

/// Alignment of O_DIRECT buffers, file offsets and lengths, bytes (a page; covers the
/// logical block size of every NVMe and SATA disk).
constexpr int64_t kIoAlign = 4096;

enum class IoOp { kRead, kWrite };

/// What an I/O error of the NVMe offload says to check.
inline constexpr const char* kCheckTheDisk =
    ". Check the disk (dmesg) and the free space of OffloadConfig::nvme_path";

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  /// Queues `bytes` of `op` between `buf` and offset `offset` of `fd`; returns a ticket.
  /// `what` names the file in errors. The buffer must stay valid until wait().
  virtual int64_t submit(IoOp op, int fd, void* buf, int64_t bytes, int64_t offset,
                         const std::string* what) = 0;
  /// Blocks until the ticket's transfer is complete; throws naming the file, the offset
  /// and the OS error when it failed. Each ticket is waited for once.
  virtual void wait(int64_t ticket) = 0;
  /// "io_uring" or "threads".
  virtual const char* name() const = 0;
};

/// io_uring with `depth` entries, or nullptr (with the reason in `why`) when this build
/// has no liburing or the kernel refuses (e.g. kernel.io_uring_disabled, seccomp).
std::unique_ptr<IoEngine> make_uring_engine(unsigned depth, std::string* why);
/// `threads` workers doing pread/pwrite.
std::unique_ptr<IoEngine> make_thread_engine(int threads);
/// io_uring when available, else the thread pool. FSDP_NVME_IO=threads forces the pool.
std::unique_ptr<IoEngine> make_io_engine(unsigned depth);

/// Transfers all `bytes` now (pread/pwrite, retried over short transfers); throws as wait().
void transfer_sync(IoOp op, int fd, void* buf, int64_t bytes, int64_t offset,
                   const std::string& what);

}  // namespace fsdp::detail::nvme
