// Files and buffers of the NVMe offload (see state_file.h).
#include "state_file.h"

#include "io_engine.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace fsdp::detail::nvme {
namespace {

std::string unique_name(const std::string& dir, const char* stem) {
  static std::atomic<int> counter{0};
  return dir + "/" + stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

// The mappings of the live StateFiles, by start address (find_file).
struct Registry {
  std::mutex mu;
  std::map<uintptr_t, std::pair<uintptr_t, const StateFile*>> spans;  // start -> (end, file)
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: files may outlive static teardown
  return *r;
}

}  // namespace

FileSpan find_file(const void* p, int64_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.spans.upper_bound(a);
  if (it == r.spans.begin()) return {};
  --it;
  if (a + static_cast<uintptr_t>(bytes) > it->second.first) return {};
  return FileSpan{it->second.second, static_cast<int64_t>(a - it->first)};
}

void check_shared_free_space(const ProcessGroup& group, const std::string& dir,
                             const std::string& field, int64_t bytes, const std::string& need,
                             const std::string& what) {
  DiskSpace disk;
  std::string local_error;
  try {
    check_nvme_dir(dir, field);
    disk = disk_space(dir, field);
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
    disk.available = -1;
  }
  const int n = group.size();
  auto mine = at::tensor({disk.machine, disk.device, bytes, disk.available}, at::kLong);
  auto all = at::empty({4 * n}, at::kLong);
  group.all_gather(all, mine);
  TORCH_CHECK(local_error.empty(), local_error);
  const auto a = all.accessor<int64_t, 1>();
  for (int r = 0; r < n; ++r) {
    TORCH_CHECK(a[4 * r + 3] >= 0, field, "='", dir, "': rank ", r,
                " cannot use its directory (its own error says why); every rank stops before "
                "reserving ",
                what);
  }
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int r = 0; r < n; ++r) {
    if (seen[static_cast<size_t>(r)]) continue;
    std::vector<int> members;
    int64_t total = 0, available = a[4 * r + 3];
    for (int q = r; q < n; ++q) {
      if (a[4 * q] != a[4 * r] || a[4 * q + 1] != a[4 * r + 1]) continue;
      seen[static_cast<size_t>(q)] = true;
      members.push_back(q);
      total += a[4 * q + 2];
      available = std::min(available, a[4 * q + 3]);
    }
    if (members.size() < 2 || total <= available) continue;
    std::string names;
    for (size_t i = 0; i < members.size(); ++i)
      names += (i == 0 ? "" : ", ") + std::to_string(members[i]);
    TORCH_CHECK(false, "not enough free space in ", field, "='", dir, "' on the disk that ranks ",
                names, " share (one machine, one file system): together they need ", total,
                " bytes (", human_bytes(total), "), each rank ", need, ", but only ", available,
                " bytes (", human_bytes(available),
                ") are available there. Free space on that disk, point nvme_path at a larger one "
                "(or give each rank a disk of its own), or shard over more ranks");
  }
}

std::string human_bytes(int64_t bytes) {
  std::ostringstream os;
  os.precision(3);
  if (bytes >= (int64_t{1} << 30)) {
    os << static_cast<double>(bytes) / (1 << 30) << " GiB";
  } else {
    os << static_cast<double>(bytes) / (1 << 20) << " MiB";
  }
  return os.str();
}

DiskSpace disk_space(const std::string& dir, const std::string& field) {
  DiskSpace d;
  struct stat st {};
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0, field, "='", dir,
              "': stat failed: ", std::strerror(errno));
  d.device = static_cast<int64_t>(st.st_dev);
  std::string machine;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) machine = buf;
    std::fclose(f);
  }
  if (machine.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    machine = host;
  }
  d.machine = static_cast<int64_t>(std::hash<std::string>{}(machine));
  struct statvfs vfs {};
  TORCH_CHECK(::statvfs(dir.c_str(), &vfs) == 0, field, "='", dir,
              "': statvfs failed: ", std::strerror(errno));
  d.available = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
  return d;
}

int64_t io_round_up(int64_t bytes) { return (bytes + kIoAlign - 1) / kIoAlign * kIoAlign; }

void check_nvme_dir(const std::string& dir, const std::string& field, int64_t bytes,
                    const std::string& need) {
  TORCH_CHECK(!dir.empty(), field,
              " is empty: set it to a directory on the NVMe disk (e.g. /local_nvme/fsdp), in "
              "which each rank makes its own files");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    TORCH_CHECK(false, field, "='", dir, "' cannot be used: ", std::strerror(errno),
                ". Create it (mkdir -p ", dir,
                ") or point it at an existing directory on the NVMe disk");
  }
  TORCH_CHECK(S_ISDIR(st.st_mode), field, "='", dir,
              "' is not a directory; point it at a directory on the NVMe disk, in which each "
              "rank makes its own files");
  // Root passes permission checks, not a read-only mount: a real file tells both.
  const std::string probe = unique_name(dir, ".fsdp-nvme-probe");
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd < 0) {
    TORCH_CHECK(false, field, "='", dir,
                "' is not writable: creating a file there failed: ", std::strerror(errno),
                ". Make the directory writable by this user (chmod, chown, or remount it "
                "read-write), or choose another one");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  if (bytes <= 0) return;
  const int64_t avail = disk_space(dir, field).available;
  TORCH_CHECK(bytes <= avail, "not enough free space in ", field, "='", dir, "': ", need, " needs ",
              bytes, " bytes (", human_bytes(bytes), ") but only ", avail, " bytes (",
              human_bytes(avail),
              ") are available there. Free space on that disk, point nvme_path at a larger "
              "one, or shard over more ranks");
}

AlignedBuffer::AlignedBuffer(int64_t bytes) : bytes_(io_round_up(bytes)) {
  void* p = nullptr;
  const int r = ::posix_memalign(&p, kIoAlign, static_cast<size_t>(bytes_));
  TORCH_CHECK(r == 0, "NVMe offload: cannot allocate ", bytes_,
              " bytes of I/O buffers (OffloadConfig::buffer_bytes): ", std::strerror(r));
  data_ = static_cast<char*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

StateFile::StateFile(const std::string& dir, int64_t bytes, const std::string& field,
                     const std::string& what)
    : path_(unique_name(dir, what == "parameters" ? "fsdp-params" : "fsdp-optim-state")),
      bytes_(io_round_up(bytes)) {
  fd_ = ::open(path_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_DIRECT, 0600);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL)  // the file system has no O_DIRECT
    fd_ = ::open(path_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd_ >= 0, field, "='", dir, "': cannot create ", path_, ": ", std::strerror(errno),
              ". Make the directory writable by this user, or choose another one");
  ::unlink(path_.c_str());
  if (bytes_ == 0) return;
  int r = ::fallocate(fd_, 0, 0, bytes_);
  if (r != 0 && errno == EOPNOTSUPP) r = ::ftruncate(fd_, bytes_);
  if (r != 0) {
    const int err = errno;
    ::close(fd_);
    TORCH_CHECK(false, field, "='", dir, "': reserving ", bytes_, " bytes (", human_bytes(bytes_),
                ") for ", what, " failed: ", std::strerror(err),
                err == ENOSPC ? ". Free space on that disk (other ranks of this node share it), "
                                "point nvme_path at a larger one, or shard over more ranks"
                              : "");
  }
  const auto len = static_cast<size_t>(bytes_);
  auto map = [&] {
    void* m = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd_);
      TORCH_CHECK(false, "NVMe offload: mapping ", path_, " failed: ", std::strerror(err));
    }
    return std::shared_ptr<void>(m, [len](void* p) { ::munmap(p, len); });
  };
  map_ = map();
  // Note [NVMe parameters]: a fault in a normal mapping reads the device's whole read-ahead
  // window around the page (read_ahead_kb: 8 MiB on this project's VMs), into a page cache
  // that the job's memory cgroup is charged for. The few pages moved through a mapping
  // while training go through this one, which reads only the page it faults on.
  pages_ = map();
  if (::madvise(pages_.get(), len, MADV_RANDOM) != 0) {
    TORCH_WARN_ONCE("NVMe offload: madvise(MADV_RANDOM) failed: ", std::strerror(errno));
  }
  void* m = map_.get();
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const auto a = reinterpret_cast<uintptr_t>(m);
  reg.spans[a] = {a + len, this};
}

StateFile::~StateFile() {
  if (map_) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.spans.erase(reinterpret_cast<uintptr_t>(map_.get()));
  }
  if (fd_ >= 0) ::close(fd_);
}

at::Tensor StateFile::view(int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype) const {
  TORCH_INTERNAL_ASSERT(offset % kIoAlign == 0, "unaligned state view");
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  const auto esize = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_INTERNAL_ASSERT(offset + n * esize <= bytes_, "state view past the end of its file");
  if (n == 0) return at::empty(sizes, dtype);
  auto keep = map_;
  return at::from_blob(
      static_cast<char*>(map_.get()) + offset, sizes, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions(dtype));
}

}  // namespace fsdp::detail::nvme
