#pragma once
// A fresh, empty directory under /tmp for a test's files (the NVMe offload's nvme_path),
// optionally with a tmpfs mounted on it; removed, and unmounted, by the destructor.

#include <gtest/gtest.h>

#include <sys/mount.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace fsdp::testing {

struct TempDir {
  std::string path;
  bool mounted = false;
  TempDir() {
    std::string t = "/tmp/fsdp_nvme_XXXXXX";
    EXPECT_NE(mkdtemp(t.data()), nullptr);
    path = t;
  }
  ~TempDir() {
    if (mounted) umount(path.c_str());
    rmdir(path.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// Mounts a tmpfs of `size` ("64k"), read-only when `extra` is "ro"; false (errno set)
  /// when mount fails (it needs root).
  bool mount_tmpfs(const std::string& size, const std::string& extra = "") {
    const std::string data = "size=" + size;
    mounted =
        mount("tmpfs", path.c_str(), "tmpfs", extra == "ro" ? MS_RDONLY : 0, data.c_str()) == 0;
    return mounted;
  }
};

}  // namespace fsdp::testing
