#pragma once
// What the fuzz targets share: a scratch directory in memory and writing the input there.
#include <c10/util/Exception.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace fuzz {

/// A directory of this process's own under /dev/shm (or /tmp), made once and removed at
/// exit. The path is never destroyed: the exit handler runs after static objects made
/// before it was registered are gone.
inline const std::string& scratch() {
  static const std::string* dir = [] {
    const char* base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
    auto* d = new std::string(std::string(base) + "/fsdp_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(*d);
    return d;
  }();
  static const bool cleanup = [] {
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return true;
  }();
  (void)cleanup;
  return *dir;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

/// Runs `fn`: a clear error (c10::Error, std::exception) is the reader's right answer to
/// malformed input; anything else (a crash, a sanitizer report, a hang) is a finding.
template <class Fn>
void expect_error_or_success(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception&) {
  }
}

/// Open file descriptors of this process.
inline int open_fds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
    n += e.is_symlink() ? 1 : 0;
  return n;
}

/// Aborts (a finding) when the reader left a file descriptor open: one leaked per
/// rejected file ends a long job with "Too many open files".
struct NoFdLeak {
  int before = open_fds();
  ~NoFdLeak() {
    if (open_fds() != before) {
      std::fprintf(stderr, "fuzz: the reader leaked %d file descriptor(s)\n", open_fds() - before);
      std::abort();
    }
  }
};

}  // namespace fuzz
