#pragma once
// HDF5 checkpoints (docs/design.md, "Contracts").
// Implemented in checkpoint.
//
// Sharded: a directory per checkpoint, one HDF5 file per rank (rank_00000.h5, ...),
// written by all ranks at once. Each file describes itself (format version, world size,
// rank, every flat parameter's FQN -> (offset, numel, shape) table), so a checkpoint
// loads at any world size and under any wrap policy. Saves are atomic: files go to a
// temporary directory that is renamed into place, then the `latest` marker is updated.
//
// Consolidated: one HDF5 file, `/model/<FQN>` datasets with full shapes, readable with
// h5py and nothing else; optional `/optimizer/<FQN>/<state>`.

#include <fsdp/checkpoint_format.h>
#include <fsdp/fully_sharded_module.h>
#include <fsdp/loss_scaler.h>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace fsdp {

class PipelinedModel;  // fsdp/pipeline.h
class AsyncSaveJob;    // the engine's (opaque)

namespace ckpt {

/// Everything besides parameters and optimizer state that a resume needs.
struct TrainingState {
  int64_t step = 0;  ///< optimizer steps taken
  /// Loss-scaler state (fp16 training); saved when set.
  std::optional<LossScalerState> loss_scaler;
  /// Learning-rate scheduler state, by name (e.g. {"last_step", 1200}). The optimizer's
  /// current per-group learning rates are saved and restored with its state anyway.
  std::map<std::string, double> scheduler;
  /// The user's own state: data-loader position, seeds, anything (strings).
  std::map<std::string, std::string> extra;
  /// Model description (e.g. n_layer, d_model), copied into consolidated exports. A string
  /// under "hf_config" is a Hugging Face config.json: safetensors exports (live, and
  /// offline from a checkpoint that carries it) write it as config.json beside the
  /// weights, so that transformers loads the directory as a model.
  std::map<std::string, AttrValue> model_attrs;
};

struct SaveOptions {
  /// Keep the newest K complete checkpoints in the directory; 0 keeps all.
  int keep_last = 0;
  /// Print progress on rank 0.
  bool verbose = false;
  /// Asynchronous saves: keep the host staging buffers once the save is written, for the
  /// next asynchronous save to copy into. Copying into memory already touched is several
  /// times faster than into fresh pages, and that copy is what training waits for. The
  /// kept bytes (one snapshot at most) stay in MemoryStats::checkpoint_staging;
  /// release_checkpoint_staging() frees them. False: freed when the save is waited for.
  bool keep_staging = true;
  /// Asynchronous saves: return before copying the shards and the optimizer state into
  /// staging memory; the background thread copies them first, while the next forward and
  /// backward run. Buffers, RNG and training state are still copied in the call, and so
  /// are tensors on a GPU and shards or state that are not fp32. They must not change
  /// until that copy is done: the end of every backward of a sharded model waits for it,
  /// as do FusedAdamW::step, import_consolidated, a FullParamsScope's writeback and a load;
  /// a program that changes them any other way (another optimizer stepping with no
  /// backward before it, an edit by hand) calls AsyncSave::wait_staged() first. A change
  /// the version counters see (in-place ops; not writes through .data()) fails the save,
  /// naming the tensor. False: everything is copied in the call.
  bool background_staging = false;
};

struct LoadOptions {
  /// Restore this rank's RNG states (CPU, and CUDA when present). Only when the
  /// checkpoint was saved at the same world size; otherwise they are left alone.
  bool restore_rng = true;
  /// Parameters missing from, or unexpected in, the checkpoint are an error (listed).
  /// When false they are reported in the result instead and left unchanged.
  bool strict = true;
};

/// What a load matched. Shape mismatches are always an error.
struct LoadReport {
  std::vector<std::string> missing;     ///< model parameters/buffers the file lacks
  std::vector<std::string> unexpected;  ///< file entries the model lacks
  std::string path;                     ///< the checkpoint directory or file actually read
};

/// Saves a sharded checkpoint of `model` (and of `optimizer`'s state: Adam, AdamW or
/// SGD over model.sharded_parameters(); may be null) as `dir`/step_<step>. Collective:
/// every rank calls it. Returns the checkpoint's path. The previous complete checkpoint
/// is never touched; `dir`/latest names the new one only once every rank's file is on disk.
std::string save_sharded_checkpoint(const std::string& dir, const ShardedModel& model,
                                    torch::optim::Optimizer* optimizer = nullptr,
                                    const TrainingState& state = {},
                                    const SaveOptions& options = {});

/// The same for a pipelined model (fsdp::pipeline): one checkpoint of every stage,
/// collective over the whole job (PipelinedModel::world). Each rank writes its stage's
/// shards under the names PipelineOptions::parameter_names gives them, so the checkpoint
/// loads into the model with any number of stages, or none, at any world size.
std::string save_sharded_checkpoint(const std::string& dir, const PipelinedModel& model,
                                    torch::optim::Optimizer* optimizer = nullptr,
                                    const TrainingState& state = {},
                                    const SaveOptions& options = {});

/// The handle of a save_sharded_checkpoint_async: one save in flight per process.
/// Destroying it (or assigning another to it) waits for the save; a failure is then
/// reported by the next save, on every rank.
class [[nodiscard]] AsyncSave {
 public:
  AsyncSave() = default;  ///< no save
  AsyncSave(AsyncSave&&) noexcept;
  AsyncSave& operator=(AsyncSave&&) noexcept;  ///< waits for the save this handle held
  ~AsyncSave();                                ///< waits for the save (never throws)

  /// Blocks until this rank's file is on disk (on rank 0: until the checkpoint is
  /// published and `latest` names it) and returns the checkpoint's path. Throws if the
  /// save failed, naming the file; `latest` then still names the checkpoint before it.
  /// Not collective.
  std::string wait();
  /// Blocks until the shards and optimizer state are copied into staging memory
  /// (SaveOptions::background_staging; returns at once otherwise, or for no save). After
  /// it, training may change them. Not collective.
  void wait_staged();
  /// Seconds the program has waited for this save's background staging so far, in
  /// wait_staged() and at the end of backwards, on this rank (the call's own time not
  /// included).
  double staging_wait_s() const;
  /// Whether the background work has finished (successfully or not), without waiting.
  bool done() const;
  /// Where the checkpoint will be: `dir`/step_<step>.
  std::string path() const;

 private:
  explicit AsyncSave(std::shared_ptr<AsyncSaveJob> job);
  friend AsyncSave save_sharded_checkpoint_async(const std::string&, const ShardedModel&,
                                                 torch::optim::Optimizer*, const TrainingState&,
                                                 const SaveOptions&);
  friend AsyncSave save_sharded_checkpoint_async(const std::string&, const PipelinedModel&,
                                                 torch::optim::Optimizer*, const TrainingState&,
                                                 const SaveOptions&);
  std::shared_ptr<AsyncSaveJob> job_;
};

/// save_sharded_checkpoint that returns as soon as this rank's shards, optimizer state,
/// RNG and training state are copied into host staging memory (pinned when they come from
/// a GPU; counted in MemoryStats::checkpoint_staging, and kept for the next save unless
/// SaveOptions::keep_staging is false); with SaveOptions::background_staging, before the
/// shards and optimizer state are copied (see there). A
/// background thread writes the same files as save_sharded_checkpoint, with the same
/// checksums and atomic publish; training may change the model meanwhile. Collective.
/// One save in flight: the next save (either kind) first waits for this one and, if it
/// failed on any rank, throws on every rank, naming the file, without saving; `latest`
/// never names a checkpoint that is not complete.
AsyncSave save_sharded_checkpoint_async(const std::string& dir, const ShardedModel& model,
                                        torch::optim::Optimizer* optimizer = nullptr,
                                        const TrainingState& state = {},
                                        const SaveOptions& options = {});

/// The same for a pipelined model: the files of save_sharded_checkpoint(PipelinedModel),
/// staged on every rank of the job, written and published in the background.
AsyncSave save_sharded_checkpoint_async(const std::string& dir, const PipelinedModel& model,
                                        torch::optim::Optimizer* optimizer = nullptr,
                                        const TrainingState& state = {},
                                        const SaveOptions& options = {});

/// Waits for the asynchronous save in flight, if any, and frees the staging buffers that
/// `model`'s asynchronous saves keep for the next one (SaveOptions::keep_staging). Not
/// collective; the next asynchronous save allocates afresh.
void release_checkpoint_staging(const ShardedModel& model);

/// Loads a sharded checkpoint saved at any world size and under any wrap policy.
/// `path` is a checkpoint directory or a directory holding a `latest` marker. Each rank
/// reads only the slices it keeps. Collective. `state` (may be null) receives the
/// training state; `optimizer` (may be null) its state and hyperparameters.
LoadReport load_sharded_checkpoint(const std::string& path, ShardedModel& model,
                                   torch::optim::Optimizer* optimizer = nullptr,
                                   TrainingState* state = nullptr, const LoadOptions& options = {});

/// The same for a pipelined model: every stage reads its own parameters (by the names
/// PipelineOptions::parameter_names gives them) from a checkpoint of the model saved with
/// any number of stages, or none. Under LoadOptions::strict only a name this stage lacks
/// is an error (the checkpoint's other names are the other stages'). Collective over the
/// job.
LoadReport load_sharded_checkpoint(const std::string& path, PipelinedModel& model,
                                   torch::optim::Optimizer* optimizer = nullptr,
                                   TrainingState* state = nullptr, const LoadOptions& options = {});

/// The newest complete checkpoint under `dir` (from its `latest` marker), or nullopt when
/// `dir` holds none. Throws when the marker exists but is bad.
std::optional<std::string> latest_checkpoint(const std::string& dir);

struct ExportOptions {
  /// Dtype of the exported parameters: kFloat32, kBFloat16 or kFloat16.
  torch::Dtype dtype = torch::kFloat32;
  /// Also write /optimizer/<FQN>/<state> (needs the optimizer).
  bool with_optimizer = false;
  /// Print progress.
  bool verbose = false;
};

/// Writes one consolidated HDF5 file from a live sharded model. Collective; rank 0
/// writes, gathering one flat parameter at a time, so its extra memory is at most one
/// unit's full fp32 parameters (MemoryStats::checkpoint_buffers counts it). The file is
/// written to a temporary name and renamed into place.
void export_consolidated(const std::string& file, const ShardedModel& model,
                         torch::optim::Optimizer* optimizer = nullptr,
                         const TrainingState& state = {}, const ExportOptions& options = {});

/// The same for a pipelined model (fsdp::pipeline): one file of the whole model, the
/// stages' parameters under the names PipelineOptions::parameter_names gives them.
/// Collective over the job. Written in two passes: a sharded checkpoint of every stage
/// into `file`.stages.tmp beside it (so that much disk, the parameters in fp32 and, with
/// ExportOptions::with_optimizer, the optimizer state), then consolidated by job rank 0
/// (consolidate_checkpoint, one parameter at a time); the temporary checkpoint is removed
/// either way, and every rank throws alike if either pass failed.
void export_consolidated(const std::string& file, const PipelinedModel& model,
                         torch::optim::Optimizer* optimizer = nullptr,
                         const TrainingState& state = {}, const ExportOptions& options = {});

/// Loads consolidated weights into a sharded model: each rank reads only its own slice
/// (HDF5 hyperslabs, or byte ranges of safetensors), no full copy anywhere, no
/// communication. `file` is the HDF5 file of export_consolidated, or safetensors: a
/// .safetensors file, a model.safetensors.index.json, or a directory holding either
/// (what export_safetensors writes, or any other writer's, in F32, BF16, F16 or F64).
LoadReport import_consolidated(const std::string& file, ShardedModel& model,
                               const LoadOptions& options = {});

/// The same for a pipelined model: each stage reads its own parameters (by the names
/// PipelineOptions::parameter_names gives them); the file's other names are the other
/// stages'. Under LoadOptions::strict a name no stage finds is an error. Collective over
/// the job: every rank throws alike when any rank's stage does not match the file.
LoadReport import_consolidated(const std::string& file, PipelinedModel& model,
                               const LoadOptions& options = {});

/// Loads consolidated weights (HDF5 or safetensors, as import_consolidated) into a plain
/// (unsharded) module, e.g. for inference.
LoadReport load_consolidated(const std::string& file, torch::nn::Module& module,
                             const LoadOptions& options = {});

/// Reads the root attributes of a consolidated file (format, dtype, step, model attrs);
/// for safetensors, its __metadata__ (numbers as numbers).
std::map<std::string, AttrValue> consolidated_attributes(const std::string& file);

struct SafetensorsOptions {
  /// Dtype of the exported parameters: kFloat32, kBFloat16 or kFloat16, rounded as
  /// tensor.to(dtype) rounds.
  torch::Dtype dtype = torch::kFloat32;
  /// Most bytes of tensor data in one file (Hugging Face's default, 5 GB). A larger model
  /// is split into model-00001-of-0000N.safetensors, ... with model.safetensors.index.json.
  uint64_t max_shard_size = 5'000'000'000;
  /// Print progress on rank 0.
  bool verbose = false;
  /// Another framework's layout (live export only): the name each parameter and buffer
  /// is written under (from its clean FQN; "" leaves it out), and which 2-D ones are
  /// written transposed (e.g. GPT-2's Conv1D weights). Unset: clean FQNs, as they are.
  std::function<std::string(const std::string& fqn)> name_for;
  std::function<bool(const std::string& fqn)> transpose;
};

/// Writes the model's weights as safetensors, the format inference tools load, into the
/// directory `dir` (created when missing): model.safetensors, or shards and an index in
/// Hugging Face's layout. Names are clean FQNs; floating buffers take `dtype` too. The
/// header's __metadata__ holds "format" = "pt", fsdp_format, dtype, step and
/// state.model_attrs (as strings). Collective; rank 0 writes, gathering one flat
/// parameter at a time, so its extra memory is about one unit's full fp32 parameters.
/// Files are written under temporary names and published by rename, the index last.
void export_safetensors(const std::string& dir, const ShardedModel& model,
                        const TrainingState& state = {}, const SafetensorsOptions& options = {});

/// The same for a pipelined model, in two passes as export_consolidated(PipelinedModel)
/// (a temporary sharded checkpoint in `dir`.stages.tmp, then consolidate_checkpoint on
/// job rank 0 with the options' layout): the tensors, names, dtypes and metadata that
/// export_safetensors writes from the model unpipelined, in the order of the stages' units
/// (byte for byte where that order is the unpipelined model's).
void export_safetensors(const std::string& dir, const PipelinedModel& model,
                        const TrainingState& state = {}, const SafetensorsOptions& options = {});

/// The formats consolidated weights are written in.
enum class WeightsFormat {
  kHdf5,         ///< one HDF5 file (docs/design.md, "Contracts"), optionally with optimizer state
  kSafetensors,  ///< a directory as export_safetensors writes it
};

struct ConsolidateOptions {
  /// Dtype of the written parameters: kFloat32, kBFloat16 or kFloat16.
  torch::Dtype dtype = torch::kFloat32;
  /// Also write /optimizer/<FQN>/<state> (the checkpoint must hold optimizer state).
  bool with_optimizer = false;
  /// kSafetensors: `out_file` names a directory, written as export_safetensors writes it.
  WeightsFormat format = WeightsFormat::kHdf5;
  /// kSafetensors: most bytes of tensor data in one file.
  uint64_t max_shard_size = 5'000'000'000;
  /// Called after each parameter: (done, total, fqn).
  std::function<void(size_t, size_t, const std::string&)> progress;
  /// kSafetensors: another framework's layout, as SafetensorsOptions has it. Unset: clean
  /// FQNs, as they are. The name each tensor is written under ("" leaves it out):
  std::function<std::string(const std::string& fqn)> name_for;
  /// Which 2-D tensors are written transposed (e.g. GPT-2's Conv1D weights).
  std::function<bool(const std::string& fqn)> transpose;
};

/// Offline: turns a sharded checkpoint into a consolidated file with no process group,
/// one parameter at a time (peak memory about one parameter). The output equals what
/// export_consolidated (or, for kSafetensors, export_safetensors) writes from the live
/// model, byte for byte for safetensors.
void consolidate_checkpoint(const std::string& sharded, const std::string& out_file,
                            const ConsolidateOptions& options = {});

/// Reads every dataset of a sharded checkpoint (directory or parent with `latest`) or a
/// consolidated file, verifying checksums and structure, and describes it. Throws a
/// c10::Error naming the file and the problem.
std::string inspect_checkpoint(const std::string& path, bool verify = true);

}  // namespace ckpt

// The names before they moved into fsdp::ckpt (issue 54: concepts in nested namespaces, as
// torch.distributed.checkpoint). They stay one release, deprecated.
using TrainingState [[deprecated("renamed fsdp::ckpt::TrainingState")]] = ckpt::TrainingState;
using SaveOptions [[deprecated("renamed fsdp::ckpt::SaveOptions")]] = ckpt::SaveOptions;
using LoadOptions [[deprecated("renamed fsdp::ckpt::LoadOptions")]] = ckpt::LoadOptions;
using LoadReport [[deprecated("renamed fsdp::ckpt::LoadReport")]] = ckpt::LoadReport;
using AsyncSave [[deprecated("renamed fsdp::ckpt::AsyncSave")]] = ckpt::AsyncSave;
using ExportOptions [[deprecated("renamed fsdp::ckpt::ExportOptions")]] = ckpt::ExportOptions;
using SafetensorsOptions [[deprecated("renamed fsdp::ckpt::SafetensorsOptions")]] =
    ckpt::SafetensorsOptions;
using WeightsFormat [[deprecated("renamed fsdp::ckpt::WeightsFormat")]] = ckpt::WeightsFormat;
using ConsolidateOptions [[deprecated("renamed fsdp::ckpt::ConsolidateOptions")]] =
    ckpt::ConsolidateOptions;
[[deprecated("renamed fsdp::ckpt::save_sharded_checkpoint")]] inline std::string
save_sharded_checkpoint(const std::string& dir, const ShardedModel& model,
                        torch::optim::Optimizer* optimizer = nullptr,
                        const ckpt::TrainingState& state = {},
                        const ckpt::SaveOptions& options = {}) {
  return ckpt::save_sharded_checkpoint(dir, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::save_sharded_checkpoint")]] inline std::string
save_sharded_checkpoint(const std::string& dir, const PipelinedModel& model,
                        torch::optim::Optimizer* optimizer = nullptr,
                        const ckpt::TrainingState& state = {},
                        const ckpt::SaveOptions& options = {}) {
  return ckpt::save_sharded_checkpoint(dir, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::save_sharded_checkpoint_async")]] inline ckpt::AsyncSave
save_sharded_checkpoint_async(const std::string& dir, const ShardedModel& model,
                              torch::optim::Optimizer* optimizer = nullptr,
                              const ckpt::TrainingState& state = {},
                              const ckpt::SaveOptions& options = {}) {
  return ckpt::save_sharded_checkpoint_async(dir, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::save_sharded_checkpoint_async")]] inline ckpt::AsyncSave
save_sharded_checkpoint_async(const std::string& dir, const PipelinedModel& model,
                              torch::optim::Optimizer* optimizer = nullptr,
                              const ckpt::TrainingState& state = {},
                              const ckpt::SaveOptions& options = {}) {
  return ckpt::save_sharded_checkpoint_async(dir, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::release_checkpoint_staging")]] inline void
release_checkpoint_staging(const ShardedModel& model) {
  ckpt::release_checkpoint_staging(model);
}
[[deprecated("renamed fsdp::ckpt::load_sharded_checkpoint")]] inline ckpt::LoadReport
load_sharded_checkpoint(const std::string& path, ShardedModel& model,
                        torch::optim::Optimizer* optimizer = nullptr,
                        ckpt::TrainingState* state = nullptr,
                        const ckpt::LoadOptions& options = {}) {
  return ckpt::load_sharded_checkpoint(path, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::load_sharded_checkpoint")]] inline ckpt::LoadReport
load_sharded_checkpoint(const std::string& path, PipelinedModel& model,
                        torch::optim::Optimizer* optimizer = nullptr,
                        ckpt::TrainingState* state = nullptr,
                        const ckpt::LoadOptions& options = {}) {
  return ckpt::load_sharded_checkpoint(path, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::latest_checkpoint")]] inline std::optional<std::string>
latest_checkpoint(const std::string& dir) {
  return ckpt::latest_checkpoint(dir);
}
[[deprecated("renamed fsdp::ckpt::export_consolidated")]] inline void export_consolidated(
    const std::string& file, const ShardedModel& model,
    torch::optim::Optimizer* optimizer = nullptr, const ckpt::TrainingState& state = {},
    const ckpt::ExportOptions& options = {}) {
  ckpt::export_consolidated(file, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::export_consolidated")]] inline void export_consolidated(
    const std::string& file, const PipelinedModel& model,
    torch::optim::Optimizer* optimizer = nullptr, const ckpt::TrainingState& state = {},
    const ckpt::ExportOptions& options = {}) {
  ckpt::export_consolidated(file, model, optimizer, state, options);
}
[[deprecated("renamed fsdp::ckpt::import_consolidated")]] inline ckpt::LoadReport
import_consolidated(const std::string& file, ShardedModel& model,
                    const ckpt::LoadOptions& options = {}) {
  return ckpt::import_consolidated(file, model, options);
}
[[deprecated("renamed fsdp::ckpt::import_consolidated")]] inline ckpt::LoadReport
import_consolidated(const std::string& file, PipelinedModel& model,
                    const ckpt::LoadOptions& options = {}) {
  return ckpt::import_consolidated(file, model, options);
}
[[deprecated("renamed fsdp::ckpt::load_consolidated")]] inline ckpt::LoadReport load_consolidated(
    const std::string& file, torch::nn::Module& module, const ckpt::LoadOptions& options = {}) {
  return ckpt::load_consolidated(file, module, options);
}
[[deprecated(
    "renamed fsdp::ckpt::consolidated_attributes")]] inline std::map<std::string, ckpt::AttrValue>
consolidated_attributes(const std::string& file) {
  return ckpt::consolidated_attributes(file);
}
[[deprecated("renamed fsdp::ckpt::export_safetensors")]] inline void export_safetensors(
    const std::string& dir, const ShardedModel& model, const ckpt::TrainingState& state = {},
    const ckpt::SafetensorsOptions& options = {}) {
  ckpt::export_safetensors(dir, model, state, options);
}
[[deprecated("renamed fsdp::ckpt::export_safetensors")]] inline void export_safetensors(
    const std::string& dir, const PipelinedModel& model, const ckpt::TrainingState& state = {},
    const ckpt::SafetensorsOptions& options = {}) {
  ckpt::export_safetensors(dir, model, state, options);
}
[[deprecated("renamed fsdp::ckpt::consolidate_checkpoint")]] inline void consolidate_checkpoint(
    const std::string& sharded, const std::string& out_file,
    const ckpt::ConsolidateOptions& options = {}) {
  ckpt::consolidate_checkpoint(sharded, out_file, options);
}
[[deprecated("renamed fsdp::ckpt::inspect_checkpoint")]] inline std::string inspect_checkpoint(
    const std::string& path, bool verify = true) {
  return ckpt::inspect_checkpoint(path, verify);
}

}  // namespace fsdp
