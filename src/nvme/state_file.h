#pragma once
// The files of the NVMe offload (Note [NVMe optimizer state] in src/optim/nvme_adamw.cpp):
// the checks of OffloadConfig::nvme_path made before training, one file per optimizer
// and rank read and written with O_DIRECT, and aligned host buffers for its transfers.

#include <fsdp/process_group.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

namespace fsdp::detail::nvme {

/// Throws, naming `dir` and the fix, unless `dir` is an existing directory in which this
/// process can create files and (when `bytes` > 0) whose file system has `bytes` free for
/// this user (statvfs f_bavail). `field` names the option in messages (e.g.
/// "ShardingOptions::offload_optimizer.nvme_path"); `need` says what the bytes are for.
void check_nvme_dir(const std::string& dir, const std::string& field, int64_t bytes = 0,
                    const std::string& need = "");

/// The disk a directory lies on: the machine (its boot id, /proc/sys/kernel/random/boot_id,
/// hashed; the host name's hash where the file is absent) and the file system (st_dev),
/// and the bytes free there for this user (statvfs f_bavail). Ranks with equal `machine`
/// and `device` share the free bytes.
struct DiskSpace {
  int64_t machine = 0;
  int64_t device = 0;
  int64_t available = 0;
};
/// `dir`'s disk; throws naming `field` when statvfs fails.
DiskSpace disk_space(const std::string& dir, const std::string& field);

/// Note [Shared NVMe disk] (src/optim/nvme_adamw.cpp). Collective over `group`: the ranks
/// exchange their disk and the `bytes` each needs under `dir`; every rank throws the same
/// message when ranks sharing a disk need more together than it has free, and when a
/// rank cannot use its directory. `need` says what each rank's bytes are for, `what`
/// what every rank stops before reserving ("its optimizer state").
void check_shared_free_space(const ProcessGroup& group, const std::string& dir,
                             const std::string& field, int64_t bytes, const std::string& need,
                             const std::string& what);

/// "1.5 GiB" or "12 MiB".
std::string human_bytes(int64_t bytes);

/// `bytes` rounded up to a multiple of kIoAlign.
int64_t io_round_up(int64_t bytes);

/// Host memory aligned to kIoAlign (posix_memalign), as O_DIRECT needs.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(int64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  int64_t bytes_ = 0;
};

/// A file of `bytes` in a directory, opened with O_DIRECT where the file system allows it
/// (else buffered: tmpfs before Linux 6.6), its space reserved at once (fallocate, so a
/// full disk shows now and not mid-training), and unlinked right away: nothing is left
/// behind, even after a crash; the space returns when the file and its views are gone.
class StateFile {
 public:
  /// `what` names the contents in its name and errors ("optimizer state", "parameters").
  StateFile(const std::string& dir, int64_t bytes, const std::string& field,
            const std::string& what = "optimizer state");
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  int fd() const { return fd_; }
  /// Opened with O_DIRECT (false: the page cache serves, e.g. on tmpfs).
  bool direct() const { return direct_; }
  /// The file's name when it was made (for messages; it is no longer in the directory).
  const std::string& path() const { return path_; }
  int64_t bytes() const { return bytes_; }
  /// Where byte `offset` of the file is mapped (views there start at this address).
  const void* address(int64_t offset) const { return static_cast<char*>(map_.get()) + offset; }
  /// Byte `offset` in a second shared mapping of the file, for a few bytes at a time (the
  /// pages that an O_DIRECT transfer shares with its neighbours): the same page-cache
  /// pages as the views, but advised MADV_RANDOM, so a fault reads its own page and not
  /// the device's read-ahead window around it (megabytes: read_ahead_kb).
  char* page_access(int64_t offset) const { return static_cast<char*>(pages_.get()) + offset; }
  /// A tensor of `sizes` and `dtype` over the file from `offset` (a multiple of kIoAlign),
  /// by a shared mapping: reading it reads the file (through the page cache, which O_DIRECT
  /// transfers keep coherent), and it stays valid after this object is gone.
  at::Tensor view(int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) const;

 private:
  int fd_ = -1;
  bool direct_ = false;
  std::string path_;
  int64_t bytes_ = 0;
  std::shared_ptr<void> map_;    ///< the whole file, mapped; unmapped with its last view
  std::shared_ptr<void> pages_;  ///< the whole file again, MADV_RANDOM (page_access)
};

/// Where host memory lies in a live StateFile's mapping: a tensor there is a view of the
/// file, and a transfer can move its bytes with the file's own descriptor instead of
/// touching the mapping (Note [NVMe parameters], src/engine/flat_param.cpp).
struct FileSpan {
  const StateFile* file = nullptr;  ///< null: not in any live file
  int64_t offset = 0;               ///< of `p` in the file
};
/// The file holding all `bytes` from `p`, if one does (files register while they live).
FileSpan find_file(const void* p, int64_t bytes);

}  // namespace fsdp::detail::nvme
