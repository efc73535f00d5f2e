#include "publish.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace fs = std::filesystem;

namespace fsdp::ckpt {

// Note [Atomic publish]
// A writer puts everything under a temporary name beside the final one, fsyncs the data,
// renames, and fsyncs the directory that holds the new name: rename(2) is atomic, but
// the new directory entry is itself only durable once its directory is synced. Without
// that last fsync a power loss can bring back the old name (or neither, for a new file)
// after the writer reported success.

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open ", path.string(), " to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of ", path.string(), " failed: ", std::strerror(err),
              ". The disk may be full or failing.");
}

void publish_atomically(const fs::path& tmp, const fs::path& target) {
  TORCH_CHECK(::rename(tmp.c_str(), target.c_str()) == 0, "cannot rename ", tmp.string(), " to ",
              target.string(), ": ", std::strerror(errno));
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fsync_path(dir);
}

void write_atomically(const fs::path& target, const std::string& text) {
  const fs::path tmp = target.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    TORCH_CHECK(out.good(), "cannot write ", tmp.string(), ": is the disk full?");
  }
  fsync_path(tmp);
  publish_atomically(tmp, target);
}

}  // namespace fsdp::ckpt
