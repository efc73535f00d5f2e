#pragma once
// What checkpoint files and their readers share, without LibTorch: the format version
// and the attribute value type. The offline tools (fsdp-consolidate, fsdp-inspect) are
// built on this and HDF5 alone, so they start fast and stay small in memory.

#include <cstdint>
#include <string>
#include <variant>

namespace fsdp {
/// Checkpoints: sharded saves and loads, consolidated and safetensors exports, the offline
/// tools (as torch.distributed.checkpoint).
namespace ckpt {

/// The newest version of the file formats this build reads.
constexpr int64_t kCheckpointFormatVersion = 2;
/// The version this build writes, except in a pipelined model's sharded checkpoint:
/// builds that read only version 1 read these files.
constexpr int64_t kCheckpointFormatBaseVersion = 1;
/// A pipelined model's sharded checkpoint: its rank files are one part per pipeline stage
/// (attributes pipeline_stages, pipeline_stage), which a version-1 reader would take for
/// stage 0's alone.
constexpr int64_t kCheckpointFormatPipelinedVersion = 2;

/// A scalar attribute: model configuration values and the like.
using AttrValue = std::variant<int64_t, double, std::string>;

}  // namespace ckpt

// The names before they moved into fsdp::ckpt (issue 54: concepts in nested namespaces).
// They stay one release, deprecated.
[[deprecated(
    "renamed fsdp::ckpt::kCheckpointFormatVersion")]] constexpr int64_t kCheckpointFormatVersion =
    ckpt::kCheckpointFormatVersion;
[[deprecated("renamed fsdp::ckpt::kCheckpointFormatBaseVersion")]] constexpr int64_t
    kCheckpointFormatBaseVersion = ckpt::kCheckpointFormatBaseVersion;
[[deprecated("renamed fsdp::ckpt::kCheckpointFormatPipelinedVersion")]] constexpr int64_t
    kCheckpointFormatPipelinedVersion = ckpt::kCheckpointFormatPipelinedVersion;
using AttrValue [[deprecated("renamed fsdp::ckpt::AttrValue")]] = ckpt::AttrValue;

}  // namespace fsdp
