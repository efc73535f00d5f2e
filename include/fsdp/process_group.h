#pragma once
// The process group: who this process is, and the collectives the engine uses.
// A public handle: every folder may use it.

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {
class BackendCore;  // the collectives' implementation: declared here, defined inside the library
struct GroupAccess;
}  // namespace detail

/// Where this process sits in the job, read from the launcher's environment.
struct LaunchEnv {
  int rank = 0;                           ///< global rank, 0-based
  int world_size = 1;                     ///< number of processes in the job
  int local_rank = 0;                     ///< rank within this node
  std::string master_addr = "127.0.0.1";  ///< rendezvous host (rank 0 serves it)
  int master_port = 29500;                ///< rendezvous TCP port
  std::string source = "single-process";  ///< "torchrun", "slurm", "openmpi" or "single-process"
};

/// Reads the launch environment. torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
/// MASTER_PORT come first, then Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, then
/// Open MPI's OMPI_COMM_WORLD_*; with none of them, a single process. Throws a
/// c10::Error naming the variable and the fix when the environment is incomplete or
/// inconsistent.
LaunchEnv read_launch_env();

/// How to build the process group.
struct ProcessGroupOptions {
  /// Seconds to wait for all ranks at rendezvous and for any one collective.
  /// The environment variable FSDP_TIMEOUT_S overrides the default.
  double timeout_s = 300.0;
  /// "gloo" (CPU; CUDA tensors too, staged through pinned host buffers, so that ranks may
  /// share a GPU), "nccl" (CUDA) or "auto": nccl when LibTorch has CUDA and every rank
  /// of this node has a GPU of its own (LOCAL_WORLD_SIZE <= GPUs visible), else gloo.
  /// At world 1 the group is in-process, unless "nccl" is named under a launcher.
  std::string backend = "auto";
};

/// A group of ranks and the collectives over it. Cheap to copy (shared handle).
/// A default-constructed group is a single process (rank 0 of 1).
class ProcessGroup {
 public:
  ProcessGroup();

  int rank() const;
  int size() const;
  /// "gloo", "nccl" or "single".
  std::string backend_name() const;
  /// How long a collective waits for the other ranks before it fails, in seconds
  /// (ProcessGroupOptions::timeout_s, or FSDP_TIMEOUT_S when set); 300 for a single process.
  double timeout_s() const;

  /// Gathers every rank's `shard` into `full` (size() * shard.numel() elements, rank
  /// order). Both tensors are contiguous and of the same dtype.
  void all_gather(const torch::Tensor& full, const torch::Tensor& shard) const;
  /// Sums `full` over ranks and writes this rank's chunk of the sum into `shard`.
  void reduce_scatter_sum(const torch::Tensor& full, const torch::Tensor& shard) const;
  /// Sums `tensor` over ranks, in place.
  void all_reduce_sum(const torch::Tensor& tensor) const;
  /// Elementwise maximum over ranks, in place.
  void all_reduce_max(const torch::Tensor& tensor) const;
  /// Copies `root`'s `tensor` to every rank, in place.
  void broadcast(const torch::Tensor& tensor, int root = 0) const;
  void barrier() const;

  /// Splits into subgroups. `groups` lists disjoint rank lists that cover the world;
  /// every rank must call this with the same lists, and gets the group it belongs to.
  ProcessGroup split(const std::vector<std::vector<int>>& groups) const;

 private:
  friend struct detail::GroupAccess;
  std::shared_ptr<detail::BackendCore> impl_;
};

/// The device this process computes on, from a user's choice `spec`:
///   "cpu";
///   "cuda": cuda:(local_rank % torch::cuda::device_count()), local_rank from
///           read_launch_env() (LOCAL_RANK under torchrun and fsdp-run); an error when
///           LOCAL_WORLD_SIZE exceeds the GPUs (NCCL refuses two ranks on one GPU), unless
///           `backend` is "gloo", whose ranks may share a GPU (CUDA tensors staged
///           through host memory);
///   "cuda:N": that GPU;
///   "auto" or "": "cuda" when a GPU is visible for each of this node's ranks
///           (LOCAL_WORLD_SIZE, 1 when unset, at most torch::cuda::device_count()), else
///           "cpu" (NCCL refuses two ranks on one GPU).
/// Throws a c10::Error naming `what` and the value, and the fix, when the value is
/// unknown, when no GPU is visible, when GPU N does not exist, or when this library is
/// built against a LibTorch without CUDA. `what` names the setting in messages (e.g.
/// "--device": "--device cuda: no CUDA device is visible ...; ... or use --device cpu").
/// `backend`: the process group's (ProcessGroupOptions::backend: auto, gloo or nccl).
torch::Device choose_device(const std::string& spec, const std::string& what = "device",
                            const std::string& backend = "auto");
/// The backend for a process group whose tensors live on `device`: "nccl" for CUDA,
/// "gloo" otherwise (ProcessGroupOptions::backend).
std::string backend_for(const torch::Device& device);
/// `choice` (auto, gloo or nccl) resolved for `device`: auto is backend_for(device), and
/// nccl with a CPU device is an error naming `what` and the fix. Gloo with a CUDA device
/// stages the tensors through pinned host buffers (docs/design.md, "Gloo with CUDA
/// tensors"), so that several ranks can share one GPU.
std::string backend_for(const torch::Device& device, const std::string& choice,
                        const std::string& what = "backend");

/// Builds the global process group from the launch environment (see LaunchEnv) and
/// waits until every rank has arrived. Errors name the missing ranks, a busy port or
/// a bad variable, and say how to fix it.
ProcessGroup init_process_group(const ProcessGroupOptions& options = {});

}  // namespace fsdp
