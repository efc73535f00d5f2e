#pragma once
// The sharded checkpoint layout, shared by save, load, offline consolidation and inspect.
//
//   <dir>/latest                  text: the name of the newest complete checkpoint
//   <dir>/step_00000100/          one checkpoint
//       rank_00000.h5 ...         one file per rank, all written at once
//
// Each rank file:
//   attrs  format="fsdp.sharded", format_version, world_size, rank, step,
//          shard_group_size, num_flats, optimizer ("none", "adam", "adamw", "sgd")
//   /flats/<k>                    flat parameter k (root first, then units in module order)
//       attrs unit_fqn, requires_grad, numel, shard_numel, begin, length, param_dtype
//       fqns, offsets, numels, ndims, dims   its FQN -> (offset, numel, shape) table
//       param                     fp32 elements [begin, begin + length) of the flat parameter
//       optim/<state>             optimizer state over the same elements (attr step)
//   /optimizer/group_<g>          attrs: that param group's hyperparameters
//   /state                        attrs step; groups scheduler, extra, loss_scaler (attrs)
//   /model_attrs                  attrs: model description (n_layer, ...)
//   /rng/cpu, /rng/cuda_<i>       this rank's generator states (uint8)
//   /buffers/<fqn>                module buffers (rank 0's file only)
//
// The flat parameter is split into shard_group_size chunks of shard_numel elements;
// rank r < shard_group_size writes chunk r (replicas of HYBRID/NO_SHARD write nothing).
//
// A pipelined model's checkpoint (format_version 2, Note [Pipelined checkpoints] in
// sharded_save.cpp) adds the attributes pipeline_stages S and pipeline_stage s: its
// world_size files are S parts of world_size / S consecutive ranks, one per stage; each
// part is laid out as above over its own flats (rank r's chunk is r - the part's first
// rank), its first file holds the part's /buffers, and world_size and rank are the job's.

#include "h5/h5.h"
#include "weights.h"

#include <functional>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::ckpt {

constexpr const char* kShardedFormat = "fsdp.sharded";
constexpr const char* kConsolidatedFormat = "fsdp.consolidated";

std::string rank_file_name(int rank);
std::string flat_group(size_t k);

/// One parameter entry of a flat parameter's table.
struct TableEntry {
  std::string fqn;
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

void write_table(hid_t group, const std::vector<TableEntry>& t, const std::string& where);
std::vector<TableEntry> read_table(hid_t group, const std::string& where);

/// Rejects a file whose format is not `format` or whose version is newer than this build's.
void check_format(hid_t file, const std::string& format, const std::string& where);

/// One flat parameter as the checkpoint records it.
struct SourceFlat {
  std::string unit_fqn;
  bool trainable = true;
  int64_t numel = 0;
  int64_t shard_numel = 0;
  std::vector<TableEntry> table;
  std::vector<std::string> optim_states;  ///< names under optim/ (empty when none saved)
  int part = 0;                           ///< the pipeline stage whose files hold it
  size_t local = 0;                       ///< its index among that part's flats
  int group = 1;                          ///< that part's shard_group_size
};

/// A sharded checkpoint opened for reading: its index (from rank 0's file, and each
/// pipeline stage's first file) and the rank files, opened on first use.
class ShardedReader {
 public:
  /// `path`: a checkpoint directory, or a directory with a `latest` marker.
  explicit ShardedReader(const std::string& path, size_t cache_bytes = 16u << 20);
  ShardedReader(const ShardedReader&) = delete;
  ShardedReader& operator=(const ShardedReader&) = delete;
  /// Ends the reads ahead in its files (h5::end_read_ahead).
  ~ShardedReader();

  const std::string& dir() const { return dir_; }
  int world_size() const { return world_; }
  int shard_group_size() const { return group_; }
  int64_t step() const { return step_; }
  const std::string& optimizer() const { return optimizer_; }
  const std::vector<SourceFlat>& flats() const { return flats_; }
  /// FQN -> (flat, entry) over every table.
  const std::map<std::string, std::pair<size_t, size_t>>& by_fqn() const { return by_fqn_; }

  std::string file_path(int rank) const;
  /// The rank file, opened and checked on first use.
  hid_t file(int rank);
  /// Pipeline stages the checkpoint was saved from (1 without a pipeline), and the first
  /// rank file of stage `part`.
  int parts() const { return parts_; }
  int part_first(int part) const { return part * (world_ / parts_); }
  /// Flat `k`'s group in its part's files ("flats/<local>"), and the first of those files.
  std::string flat_path(size_t k) const { return flat_group(flats_.at(k).local); }
  int flat_file(size_t k) const { return part_first(flats_.at(k).part); }
  /// Reads elements [pos, pos + n) of flat `k`'s dataset `name` ("param", "optim/exp_avg")
  /// from whichever rank files hold them.
  void read(size_t k, const std::string& name, int64_t pos, int64_t n, float* out);

 private:
  /// Appends the flats of pipeline stage `part` (all of them without a pipeline), from
  /// its first file.
  void read_part(int part);

  std::string dir_;
  size_t cache_bytes_;
  int world_ = 1;
  int group_ = 1;
  int parts_ = 1;
  int64_t step_ = 0;
  std::string optimizer_;
  std::vector<SourceFlat> flats_;
  std::map<std::string, std::pair<size_t, size_t>> by_fqn_;
  std::vector<std::unique_ptr<h5::Obj>> files_;
};

/// The checkpoint directory `path` names: itself when it holds rank files, else the one
/// its `latest` marker names. Errors name the path and what is wrong.
std::string resolve_checkpoint_dir(const std::string& path);

/// "[2, 3]".
std::string describe_shape(const std::vector<int64_t>& s);

/// Writes a consolidated file (docs/design.md, "Contracts"); the live export and the offline
/// consolidation make the same calls in the same order, so their files are identical.
/// The file is written under a temporary name and renamed into place by finish().
struct ConsolidatedWriter {
  std::string path;
  std::string tmp;
  h5::Obj file;
  h5::Obj model;
  h5::Obj optim;

  ConsolidatedWriter(const std::string& out, h5::Elem dtype, int64_t step,
                     const std::map<std::string, ckpt::AttrValue>& attrs,
                     const std::string& optimizer_kind);
  /// /optimizer/<fqn> with its step and hyperparameters.
  void optim_group(const std::string& fqn, int64_t step,
                   const std::map<std::string, ckpt::AttrValue>& hp);
  void finish();
  /// Closes and deletes the temporary file (after an error).
  void abandon();
};

/// The element type of `d` in files.
h5::Elem elem_of(ExportDtype d);

/// Safetensors exports (Note [Safetensors]): the dtype name of an element type ("F32",
/// "BF16", "F16", "F64", "I64", "U8").
const char* safetensors_dtype(h5::Elem e);
/// The "__metadata__" of a safetensors export, the same live and offline: "format" = "pt"
/// (what transformers checks), fsdp_format, fsdp_format_version, dtype, step and the
/// model attributes, all as strings.
std::map<std::string, std::string> safetensors_metadata(
    h5::Elem dtype, int64_t step, const std::map<std::string, ckpt::AttrValue>& attrs);

/// The model attribute (TrainingState::model_attrs) whose string is a Hugging Face
/// config.json: safetensors exports, live and offline, write it beside the weights (and
/// not into __metadata__), so that transformers loads the directory as a model.
inline constexpr const char* kHfConfigAttr = "hf_config";
/// Writes `dir`/config.json from attrs[kHfConfigAttr], atomically; nothing without it.
void write_hf_config(const std::string& dir, const std::map<std::string, ckpt::AttrValue>& attrs);
}  // namespace fsdp::ckpt
