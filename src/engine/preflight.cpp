// What fully_shard and make_sharded check before they build anything (preflight.h): the
// options, by the options core's rules (Note [Options core]), and the machine: host
// memory for the shards, the NVMe directories and their free space.
#include "preflight.h"

#include "nvme/io_engine.h"
#include "nvme/state_file.h"

#include <fsdp/core/options.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace fsdp::detail {
namespace {

// The option rules are the options core's (Note [Options core]), in the API's words;
// its std::invalid_argument becomes the c10::Error the engine's other checks throw.
template <class Fn>
auto core_checked(Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

Precision precision_of(at::ScalarType t, core::Option option) {
  if (t == at::kFloat) return Precision::kFp32;
  if (t == at::kBFloat16) return Precision::kBf16;
  if (t == at::kHalf) return Precision::kFp16;
  core_checked([&] { core::unsupported_dtype(option, c10::toString(t), core::Surface::kApi); });
  return Precision::kFp32;  // not reached
}

core::Options core_options(const ShardingOptions& o, bool cpu_offload) {
  core::Options c;
  c.strategy = o.strategy;
  c.world_size = o.process_group.size();
  c.hybrid_group_size = o.hybrid_group_size;
  c.hpz_group_size = o.reshard_after_forward_group_size;
  c.offload_optimizer = o.offload_optimizer.device;
  c.offload_param = o.offload_param.device;
  c.cpu_offload = cpu_offload;
  const MixedPrecision& mp = o.mixed_precision;
  c.param = precision_of(mp.param_dtype, core::Option::kPrecision);
  c.reduce = precision_of(mp.reduce_dtype, core::Option::kReduceDtype);
  c.master = precision_of(mp.master_dtype, core::Option::kMasterDtype);
  c.keep_fp32 = mp.keep_fp32_policy != nullptr;
  c.max_gathered_units = o.max_gathered_units;
  c.activation_checkpointing = o.checkpoint_policy != nullptr;
  c.offload_activations = o.offload_activations;
  const QuantizedCommunication& q = o.quantized_communication;
  c.quantize_weights = q.weights;
  c.quantize_gradients = q.gradients;
  c.weight_bits = q.weight_bits;
  c.gradient_bits = q.gradient_bits;
  c.quantize_block = q.block_size;
  return c;
}

// Bytes the OS says it can still give (MemAvailable), or -1 when unknown.
int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoll(line.substr(13)) * 1024;
  }
  return -1;
}

std::string gib(double bytes) {
  std::ostringstream os;
  os.precision(3);
  os << bytes / (1024.0 * 1024 * 1024) << " GiB";
  return os.str();
}

}  // namespace

// ShardingOptions::cpu_offload (deprecated) as what it means, offload_optimizer and
// offload_param on the host; the engine reads only those.
ShardingOptions resolve_deprecated_options(const ShardingOptions& given) {
  ShardingOptions o = given;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  const bool cpu_offload = o.cpu_offload;
  o.cpu_offload = false;
#pragma GCC diagnostic pop
  if (!cpu_offload) return o;
  core_checked([&] { core::validate(core_options(given, true), core::Surface::kApi); });
  TORCH_WARN_ONCE(
      "ShardingOptions::cpu_offload is deprecated and goes in the next release: "
      "set offload_optimizer.device and offload_param.device to "
      "fsdp::OffloadDevice::kCpu (the same thing)");
  o.offload_optimizer.device = OffloadDevice::kCpu;
  o.offload_param.device = OffloadDevice::kCpu;
  return o;
}

void validate_sharding_options(const ShardingOptions& o) {
  TORCH_CHECK(o.auto_wrap_policy != nullptr,
              "ShardingOptions::auto_wrap_policy is empty; use fsdp::wrap::never_wrap_policy() to "
              "shard everything as one unit");
  core_checked([&] { core::validate(core_options(o, false), core::Surface::kApi); });
  const QuantizedCommunication& q = o.quantized_communication;
  TORCH_CHECK(
      !(q.weights || q.gradients) || q.scale_dtype == at::kFloat || q.scale_dtype == at::kBFloat16,
      "QuantizedCommunication::scale_dtype=", q.scale_dtype,
      " is unsupported; use Float or BFloat16");
  // The directories' existence and writability now, before anything is built; the free
  // space when the files are reserved (the bytes are known then).
  if (o.offload_optimizer.device == OffloadDevice::kNvme)
    nvme::check_nvme_dir(o.offload_optimizer.nvme_path,
                         "ShardingOptions::offload_optimizer.nvme_path");
  if (o.offload_param.device == OffloadDevice::kNvme)
    nvme::check_nvme_dir(o.offload_param.nvme_path, "ShardingOptions::offload_param.nvme_path");
}

// Refuses, before any allocation, a sharding whose host-resident state cannot fit:
// per rank 4 bytes of fp32 shard + 4 of gradient + 8 of Adam state per sharded element,
// less the shards make_sharded already built (`built_bytes`, no longer available), times
// the ranks on this node (LOCAL_WORLD_SIZE), against MemAvailable. DeepSpeed users meet
// this as a silent SIGKILL from the OOM killer partway into training. A model that was
// constructed in full (fully_shard) already holds 4 bytes per parameter on every rank;
// the message says so and names make_sharded.
void check_host_memory(const WrapPointImpl& root, const ShardingOptions& o, int64_t built_bytes) {
  const bool host_shards = o.offload_optimizer.device != OffloadDevice::kNone || o.device.is_cpu();
  // Note [NVMe parameters]: nothing per element stays in host memory.
  if (!o.check_host_memory || !host_shards || o.offload_param.device == OffloadDevice::kNvme)
    return;
  // Note [NVMe optimizer state]: Adam's moments are in files, the shard and gradient not.
  const bool nvme_state = o.offload_optimizer.device == OffloadDevice::kNvme;
  const double per_element = nvme_state ? 8.0 : 16.0;
  int64_t numel = 0;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : root.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
  }
  const int group = core::shard_group_size(core_options(o, false));
  int local = 1;
  if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) local = std::max(1, std::atoi(l));
  const double per_rank = per_element * static_cast<double>((numel + group - 1) / group);
  const double need = std::max(0.0, per_rank - static_cast<double>(built_bytes)) * local;
  const int64_t avail = host_available_bytes();
  if (avail < 0) return;
  const std::string eager =
      built_bytes > 0 ? std::string()
                      : " This model was constructed in full on every rank (" +
                            gib(4.0 * static_cast<double>(numel)) +
                            " of fp32 parameters per rank before sharding); fsdp::make_sharded "
                            "constructs it already sharded.";
  TORCH_CHECK(
      need <= static_cast<double>(avail), "fully_shard: not enough host memory. ", numel,
      " parameters sharded over ", group, " ranks need ", gib(per_rank), " per rank in host RAM (",
      nvme_state ? "fp32 shard and gradient, the Adam state being in files: 8"
                 : "fp32 shard, gradient and Adam state: 16",
      " bytes per element)",
      built_bytes > 0
          ? ", of which make_sharded built " + gib(static_cast<double>(built_bytes)) + " already"
          : std::string(),
      local > 1 ? ", times " + std::to_string(local) + " ranks on this node = " + gib(need)
                : std::string(),
      ", but only ", gib(static_cast<double>(avail)),
      " is available (MemAvailable). Use more nodes or fewer ranks per node, a smaller "
      "model, or set "
      "ShardingOptions::check_host_memory = false to try anyway.",
      eager);
}

// Note [Shared NVMe disk], for the parameter files that `bytes` are (`what`: of which
// units): collective. fully_shard checks the units still to build at once; make_sharded
// each unit as it builds it (the model's size is unknown until then).
void check_param_file_space(int64_t bytes, const ShardingOptions& options,
                            const std::string& what) {
  if (options.offload_param.device != OffloadDevice::kNvme) return;
  const std::string field = "ShardingOptions::offload_param.nvme_path";
  const std::string files =
      "parameter files " + what +
      " (the fp32 master shards and their gradients, 8 bytes for each trainable shard element, "
      "4 for a frozen one, and the 16-bit copies the gathers read; each region aligned to 4096 "
      "bytes)";
  if (options.process_group.size() > 1)
    nvme::check_shared_free_space(options.process_group, options.offload_param.nvme_path, field,
                                  bytes, "its " + files, "its parameter files");
  nvme::check_nvme_dir(options.offload_param.nvme_path, field, bytes, "this rank's " + files);
}

}  // namespace fsdp::detail
