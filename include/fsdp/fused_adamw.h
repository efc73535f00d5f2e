#pragma once
// Fused CPU AdamW: torch::optim::AdamW's arithmetic in one SIMD pass per parameter
// (AVX-512, AVX2 or scalar, chosen at run time), threaded over LibTorch's intra-op pool.
//
// It is a torch::optim::AdamW: same options (per-group lr, betas, eps, weight_decay),
// same AdamWParamState, so checkpoints save, load and reshard its state like AdamW's.
// Optionally it writes a bf16 or fp16 copy of each updated parameter in the same pass
// (set_copy_out), e.g. the input of the next all-gather. Parameters it updates get their
// version counter bumped, as in-place torch ops do.

#include <fsdp/fully_sharded_module.h>

#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <unordered_map>
#include <vector>

namespace fsdp {

class FusedAdamW : public torch::optim::AdamW {
 public:
  enum class Isa { kAuto, kAvx512, kAvx2, kScalar };

  FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
             torch::optim::AdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {});
  /// Over `model`'s sharded parameters. Where the model gathers 16-bit parameters from
  /// CPU shards (bf16/fp16 param_dtype, CPU training or cpu_offload), each step also
  /// writes the 16-bit copy that the next all-gather sends, so gathers skip their cast.
  explicit FusedAdamW(const ShardedModel& model, torch::optim::AdamWOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;

  /// After each step, `out` (a contiguous CPU bf16 or fp16 tensor with param's numel)
  /// holds the updated `param`, written in the same pass. An undefined `out` removes it.
  /// `written` (optional) receives param._version() right after each such write, so a
  /// reader can tell whether `out` still matches `param` (the sharded engine does this
  /// for its gathers: see the constructor over a ShardedModel).
  void set_copy_out(const torch::Tensor& param, torch::Tensor out,
                    std::shared_ptr<std::atomic<int64_t>> written = nullptr);

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

  struct CopyOut {
    torch::Tensor out;
    std::shared_ptr<std::atomic<int64_t>> written;
  };
  std::unordered_map<const void*, CopyOut> copy_out_;
};

}  // namespace fsdp
