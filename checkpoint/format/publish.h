#pragma once
// Publishing a finished file or directory under its final name, so that a crash at any
// moment leaves either the old state or the new one, whole (Note [Atomic publish]).
// Every writer in checkpoint/ uses these: sharded checkpoints, `latest`, consolidated
// HDF5 files, safetensors files and their index.

#include <filesystem>
#include <string>

namespace fsdp::ckpt {

/// What the error of a file that cannot be created says to check.
inline constexpr const char* kCheckTheDirectory =
    ". Check that the directory exists, is writable and has free space.";

/// fsyncs a file or a directory. Throws naming `path` when it cannot be opened or synced.
void fsync_path(const std::filesystem::path& path);

/// Renames `tmp` (a finished file or directory whose data is already fsynced) to
/// `target`, then fsyncs the directory holding `target`, so that the new name survives
/// a crash. Throws naming both on failure.
void publish_atomically(const std::filesystem::path& tmp, const std::filesystem::path& target);

/// Writes `text` to `target` atomically: `target`.tmp, fsync, publish_atomically.
void write_atomically(const std::filesystem::path& target, const std::string& text);

}  // namespace fsdp::ckpt
