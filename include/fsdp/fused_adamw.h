#pragma once
// Fused AdamW: torch::optim::AdamW's arithmetic, fused. Host (CPU) parameters, e.g. the
// shards of CPU training or offload_optimizer, take one SIMD pass per parameter (AVX-512, AVX2
// or scalar, chosen at run time), threaded over LibTorch's intra-op pool. Parameters on a
// device (CUDA shards) take ATen's fused multi-tensor kernel, at::_fused_adamw_ (the op
// behind Python's torch.optim.AdamW(fused=True)), one launch per device and dtype of a
// parameter group.
//
// It is a torch::optim::AdamW: same options (per-group lr, betas, eps, weight_decay),
// same AdamWParamState (step, exp_avg, exp_avg_sq) whichever kernel steps a parameter,
// so checkpoints save, load and reshard its state like AdamW's.
// Optionally it writes a bf16 or fp16 copy of each updated parameter in the same pass
// (set_copy_out), e.g. the input of the next all-gather. Parameters it updates get their
// version counter bumped, as in-place torch ops do.
//
// With NVMe state (the model's ShardingOptions::offload_optimizer.device = kNvme, or
// offload_state), exp_avg and exp_avg_sq live in a file and each step streams them
// through OffloadConfig::buffer_bytes of host memory, reading ahead and writing behind
// while the kernel runs; the results are bit-identical to in-memory state.

#include <fsdp/fully_sharded_module.h>
#include <fsdp/param_groups.h>

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

namespace fsdp {

namespace detail {
class NvmeAdamState;
}

class FusedAdamW : public torch::optim::AdamW {
 public:
  enum class Isa { kAuto, kAvx512, kAvx2, kScalar };
  /// Which kernel steps a parameter. kAuto: the SIMD kernels for CPU parameters,
  /// at::_fused_adamw_ for the others. kAten: at::_fused_adamw_ for every parameter (on
  /// the CPU that needs a LibTorch with its CPU kernel: aten_kernel_available).
  enum class Kernel { kAuto, kAten };

  FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
             torch::optim::AdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {});
  /// Over `model`'s sharded parameters. Where the model gathers 16-bit parameters from
  /// CPU shards (bf16/fp16 param_dtype, CPU training or offload_optimizer), each step also
  /// writes the 16-bit copy that the next all-gather sends, so gathers skip their cast.
  /// With offload_optimizer.device = kNvme in the model's options, the Adam state goes to
  /// files under its nvme_path (see offload_state).
  explicit FusedAdamW(const ShardedModel& model, torch::optim::AdamWOptions defaults = {});
  /// Over the segments of `groups` (include/fsdp/param_groups.h): one group per spec group,
  /// each with its lr and weight_decay over `defaults`; each segment, a contiguous range of
  /// a shard, is stepped in one pass. (No 16-bit copy-out: gathers cast the shard.)
  explicit FusedAdamW(const ShardParamGroups& groups, torch::optim::AdamWOptions defaults = {});
  ~FusedAdamW() override;

  torch::Tensor step(LossClosure closure = nullptr) override;

  /// After each step, `out` (a contiguous CPU bf16 or fp16 tensor with param's numel)
  /// holds the updated `param`, written in the same pass. An undefined `out` removes it.
  /// `written` (optional) receives param._version() right after each such write, so a
  /// reader can tell whether `out` still matches `param` (the sharded engine does this
  /// for its gathers: see the constructor over a ShardedModel).
  void set_copy_out(const torch::Tensor& param, torch::Tensor out,
                    std::shared_ptr<std::atomic<int64_t>> written = nullptr);

  /// How CPU bf16 parameters (pure bf16 shards: MixedPrecision::master_dtype) are written
  /// back after each update, which is computed in fp32 from the bf16 values (the moments
  /// are kept in bf16 too):
  /// - kNearest: round to nearest even; an update below half a bf16 ulp of the parameter
  ///   is lost, so small learning rates stall.
  /// - kStochastic: round up with probability equal to the remainder's share of an ulp,
  ///   so updates survive on average (an unbiased rounding); its random bits are a hash
  ///   of `seed` (give each rank its own), the parameter's position in the groups, its
  ///   step count and the element's index: the same whatever the number of threads.
  /// - kCompensated: a bf16 compensation buffer per parameter (Kahan) keeps what
  ///   rounding dropped and adds it back at the next update: 2 more bytes per parameter.
  ///   The buffer is not saved in checkpoints; a resumed run starts it at zero.
  enum class Bf16Rounding { kNearest, kStochastic, kCompensated };
  void set_bf16_rounding(Bf16Rounding rounding, uint64_t seed = 0);
  Bf16Rounding bf16_rounding() const { return bf16_rounding_; }
  /// Bytes of kCompensated's buffers.
  int64_t compensation_bytes() const;
  /// Keeps exp_avg and exp_avg_sq of every trainable parameter in a file under
  /// config.nvme_path (config.device must be kNvme) and streams them through
  /// config.buffer_bytes of host memory at each step. Checks the directory and reserves
  /// the file now: a missing, unwritable or too full directory throws here, naming the
  /// bytes needed and available. Parameters must be contiguous fp32 CPU tensors. Call
  /// before the first step. The state map still holds AdamW state (its moments are views
  /// of the file), so checkpoints save and load it as usual.
  void offload_state(const OffloadConfig& config);
  /// Whether the state lives in files (offload_state, or the model's options).
  bool state_offloaded() const { return nvme_ != nullptr; }
  /// How the state is offloaded, for logs: the I/O engine (io_uring or threads), whether
  /// the file is opened with O_DIRECT, and the chunk size; "" when it is in memory.
  std::string state_offload_info() const;

  /// Chooses the kernel of this optimizer's steps (default kAuto).
  void set_kernel(Kernel kernel) { kernel_ = kernel; }
  Kernel kernel() const { return kernel_; }
  /// Whether this LibTorch has at::_fused_adamw_ for fp32 tensors on `device` (tried on
  /// one element; CUDA needs a visible GPU, the CPU kernel is in LibTorch 2.4 and newer).
  static bool aten_kernel_available(const torch::Device& device);

  /// Forces an instruction set for every FusedAdamW in the process (kAuto: the best the
  /// CPU has). Throws when the CPU lacks the one asked for. FSDP_ADAMW_ISA=avx512|avx2|
  /// scalar in the environment does the same at start-up.
  static void force_isa(Isa isa);
  /// The instruction set steps use now.
  static Isa active_isa();
  static bool isa_supported(Isa isa);
  static const char* isa_name(Isa isa);

 private:
  /// One parameter's update: its fp32 gradient, state and the kernels (and its copy-out).
  void step_param(torch::Tensor& p, const torch::optim::AdamWOptions& o, Isa isa);
  /// A CPU bf16 parameter: the update in fp32 over its bf16 values and moments, written
  /// back as bf16_rounding_ says. `position`: p's index in the groups, in order.
  void step_bf16(torch::Tensor& p, const torch::optim::AdamWOptions& o, int64_t position);
  /// One group's parameters through at::_fused_adamw_, a launch per device and dtype.
  void step_aten(const std::vector<torch::Tensor>& params, const torch::optim::AdamWOptions& o);

  /// The model's barrier before its shards change (Note [Background staging]): over a
  /// ShardedModel or its ShardParamGroups; over plain tensors none (the end of each
  /// backward waits for a save's copies, as it does for any optimizer).
  std::function<void()> shard_change_barrier_;
  Kernel kernel_ = Kernel::kAuto;
  Bf16Rounding bf16_rounding_ = Bf16Rounding::kNearest;
  uint64_t rounding_seed_ = 0;  ///< set_bf16_rounding's seed (kStochastic's random bits)
  std::unordered_map<const void*, torch::Tensor> compensation_;
  struct CopyOut {
    torch::Tensor out;
    std::shared_ptr<std::atomic<int64_t>> written;
  };
  std::unordered_map<const void*, CopyOut> copy_out_;
  /// The state's files (Note [NVMe optimizer state]); null: state in memory.
  std::unique_ptr<detail::NvmeAdamState> nvme_;
};

}  // namespace fsdp
