// FusedAdamW (see fused_adamw.h): the optimizer around the kernels in adamw_kernels.cpp.
#include <fsdp/fused_adamw.h>
#include "trace/trace.h"

#include "adamw_kernels.h"
#include "internal/optim_key.h"
#include "internal/optim_view.h"
#include "nvme_adamw.h"
#include "parallel_range.h"

#include <ATen/ops/_fused_adamw.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

namespace fsdp {
namespace {

detail::KernelIsa to_kernel(FusedAdamW::Isa isa) {
  switch (isa) {
    case FusedAdamW::Isa::kAvx512:
      return detail::KernelIsa::kAvx512;
    case FusedAdamW::Isa::kAvx2:
      return detail::KernelIsa::kAvx2;
    default:
      return detail::KernelIsa::kScalar;
  }
}

FusedAdamW::Isa best_isa() {
  for (auto isa : {FusedAdamW::Isa::kAvx512, FusedAdamW::Isa::kAvx2}) {
    if (detail::isa_available(to_kernel(isa))) return isa;
  }
  return FusedAdamW::Isa::kScalar;
}

FusedAdamW::Isa parse_isa(const char* s) {
  const std::string v = s;
  if (v == "avx512") return FusedAdamW::Isa::kAvx512;
  if (v == "avx2") return FusedAdamW::Isa::kAvx2;
  if (v == "scalar") return FusedAdamW::Isa::kScalar;
  if (v == "auto" || v.empty()) return FusedAdamW::Isa::kAuto;
  TORCH_CHECK(false, "FSDP_ADAMW_ISA=", v, " is unknown; use avx512, avx2, scalar or auto");
}

std::atomic<int>& forced() {
  static std::atomic<int> f{[] {
    const char* env = std::getenv("FSDP_ADAMW_ISA");
    auto isa = env ? parse_isa(env) : FusedAdamW::Isa::kAuto;
    TORCH_CHECK(isa == FusedAdamW::Isa::kAuto || FusedAdamW::isa_supported(isa),
                "FSDP_ADAMW_ISA=", env, ": this CPU does not support it");
    return static_cast<int>(isa);
  }()};
  return f;
}

// With offload_param = nvme the optimizer streams the parameters too (Note [NVMe
// parameters]), through their section's buffer beside its own.
int64_t param_buffer_bytes(const OffloadConfig& offload_param) {
  return offload_param.device == OffloadDevice::kNvme ? offload_param.buffer_bytes : 0;
}

}  // namespace

FusedAdamW::FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                       torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(std::move(groups), std::move(defaults)) {}

FusedAdamW::FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(std::move(params), std::move(defaults)) {}

FusedAdamW::FusedAdamW(const ShardedModel& model, torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(model.sharded_parameters(), std::move(defaults)),
      shard_change_barrier_(detail::shard_change_barrier_of(model)) {
  for (const auto& t : detail::copy_out_targets(model)) set_copy_out(t.shard, t.copy, t.version);
  const OffloadConfig& nvme = model.sharding_options().offload_optimizer;
  if (nvme.device == OffloadDevice::kNvme) {
    std::vector<torch::Tensor> trainable;  // frozen shards never get a gradient
    for (const auto& p : model.sharded_parameters())
      if (p.requires_grad()) trainable.push_back(p);
    nvme_ = std::make_unique<detail::NvmeAdamState>(
        nvme, trainable, "ShardingOptions::offload_optimizer.nvme_path",
        &model.sharding_options().process_group,
        param_buffer_bytes(model.sharding_options().offload_param));
  }
}

FusedAdamW::~FusedAdamW() = default;

std::string FusedAdamW::state_offload_info() const {
  if (!nvme_) return "";
  return std::string(nvme_->io_engine_name()) + (nvme_->direct_io() ? ", O_DIRECT" : ", buffered") +
         ", chunks of " + std::to_string(nvme_->chunk_elements()) + " elements" +
         (nvme_->streams_params() ? ", with the parameters" : "");
}

void FusedAdamW::offload_state(const OffloadConfig& config) {
  TORCH_CHECK(config.device == OffloadDevice::kNvme,
              "FusedAdamW::offload_state: OffloadConfig::device must be OffloadDevice::kNvme");
  TORCH_CHECK(state().empty(),
              "FusedAdamW::offload_state: call it before the first step (the state exists)");
  std::vector<torch::Tensor> params;
  for (const auto& g : param_groups())
    params.insert(params.end(), g.params().begin(), g.params().end());
  nvme_ = std::make_unique<detail::NvmeAdamState>(config, params, "OffloadConfig::nvme_path");
}

FusedAdamW::FusedAdamW(const ShardParamGroups& groups, torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(groups.param_groups(defaults), defaults),
      shard_change_barrier_(detail::shard_change_barrier_of(groups)) {
  const OffloadConfig& nvme = groups.offload_optimizer();
  if (nvme.device == OffloadDevice::kNvme) {
    std::vector<torch::Tensor> views;  // the segments: contiguous fp32 ranges of the shards
    for (const auto& s : groups.segments()) views.push_back(s.view);
    nvme_ = std::make_unique<detail::NvmeAdamState>(
        nvme, views, "ShardingOptions::offload_optimizer.nvme_path", &groups.process_group(),
        param_buffer_bytes(groups.offload_param()));
  }
}

bool FusedAdamW::isa_supported(Isa isa) {
  return isa == Isa::kAuto || detail::isa_available(to_kernel(isa));
}

const char* FusedAdamW::isa_name(Isa isa) {
  return isa == Isa::kAuto ? "auto" : detail::isa_name(to_kernel(isa));
}

void FusedAdamW::force_isa(Isa isa) {
  TORCH_CHECK(isa_supported(isa), "FusedAdamW::force_isa: this CPU does not support ",
              isa_name(isa));
  forced().store(static_cast<int>(isa));
}

FusedAdamW::Isa FusedAdamW::active_isa() {
  auto isa = static_cast<Isa>(forced().load());
  return isa == Isa::kAuto ? best_isa() : isa;
}

void FusedAdamW::set_copy_out(const torch::Tensor& param, torch::Tensor out,
                              std::shared_ptr<std::atomic<int64_t>> written) {
  if (!out.defined()) {
    copy_out_.erase(param.unsafeGetTensorImpl());
    return;
  }
  TORCH_CHECK(
      out.is_cpu() && out.is_contiguous() &&
          (out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat16),
      "FusedAdamW::set_copy_out: the copy must be a contiguous CPU bf16 or fp16 tensor, got ",
      out.toString());
  TORCH_CHECK(out.numel() == param.numel(), "FusedAdamW::set_copy_out: the copy has ", out.numel(),
              " elements but the parameter has ", param.numel());
  copy_out_[param.unsafeGetTensorImpl()] = CopyOut{std::move(out), std::move(written)};
}

namespace {

// The gradient of `p` as the kernels read it: contiguous fp32 on the CPU.
torch::Tensor fp32_grad(const torch::Tensor& p) {
  TORCH_CHECK(p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous(),
              "FusedAdamW steps contiguous fp32 CPU parameters (e.g. fsdp's shards with "
              "cpu_offload); got ",
              p.toString(), p.is_contiguous() ? "" : " (not contiguous)",
              ". Use torch::optim::AdamW for others.");
  torch::Tensor g = p.grad();
  TORCH_CHECK(!g.is_sparse(), "FusedAdamW does not support sparse gradients");
  if (g.scalar_type() != torch::kFloat || !g.is_contiguous() || !g.is_cpu()) {
    g = g.to(torch::kCPU, torch::kFloat).contiguous();
  }
  return g;
}

// The AdamW state of `p` (zero moments at the first step), checked for the kernels.
// (The map's key type differs among LibTorch 2.x versions: internal/optim_key.h.)
// With NVMe state (`nvme`), the moments are views of its file (Note [NVMe optimizer state]).
template <class States>
torch::optim::AdamWParamState& adamw_state(States& states, const torch::Tensor& p,
                                           detail::NvmeAdamState* nvme) {
  const auto key = detail::optim_state_key(states, p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto st = nvme ? nvme->fresh_state(p) : std::make_unique<torch::optim::AdamWParamState>();
    if (!nvme) {
      st->step(0);
      st->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
      st->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    }
    it = states.emplace(key, std::move(st)).first;
  }
  auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
  if (nvme) nvme->adopt(p, st);
  TORCH_CHECK(
      st.exp_avg().is_contiguous() && st.exp_avg_sq().is_contiguous() &&
          st.exp_avg().scalar_type() == torch::kFloat,
      "FusedAdamW: the state of a parameter is not contiguous fp32 (loaded from elsewhere?)");
  return st;
}

// Sebastiano Vigna's splitmix64 finalizer: a 64-bit mix, for step_bf16's keys.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The step's scalars for the kernels, at step number `step` (1 for the first).
detail::AdamWConstants adamw_constants(const torch::optim::AdamWOptions& o, int64_t step) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  detail::AdamWConstants c;
  c.decay = static_cast<float>(o.weight_decay() != 0 ? 1 - o.lr() * o.weight_decay() : 1.0);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(o.eps());
  c.step_size = static_cast<float>(o.lr() / bc1);
  return c;
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  detail::trace::Scope span("optimizer", []() { return std::string("optimizer step"); });
  // Note [Background staging]: a save still copying the shards.
  if (shard_change_barrier_) shard_change_barrier_();
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const Isa isa = active_isa();
  TORCH_CHECK(!nvme_ || kernel_ == Kernel::kAuto,
              "FusedAdamW: NVMe state streams through the SIMD kernels; set_kernel(kAten) "
              "cannot step it. Use Kernel::kAuto");
  int64_t position = 0;  // of a parameter in the groups, for step_bf16's random bits
  for (auto& group : param_groups()) {
    auto& o = static_cast<torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!o.amsgrad(),
                "FusedAdamW does not implement amsgrad; use torch::optim::AdamW for it");
    std::vector<torch::Tensor> on_aten;  // device parameters (all of them under kAten)
    for (auto& p : group.params()) {
      ++position;
      if (!p.grad().defined()) continue;
      if (kernel_ == Kernel::kAuto && p.is_cpu() && p.scalar_type() == torch::kBFloat16) {
        step_bf16(p, o, position - 1);
      } else if (kernel_ == Kernel::kAuto && p.is_cpu()) {
        step_param(p, o, isa);
      } else {
        // ATen's kernel writes a bf16 parameter rounded to nearest: a rounding asked for
        // must not be dropped without a word.
        TORCH_CHECK(bf16_rounding_ == Bf16Rounding::kNearest || p.scalar_type() != torch::kBFloat16,
                    "FusedAdamW: set_bf16_rounding(",
                    bf16_rounding_ == Bf16Rounding::kStochastic ? "kStochastic" : "kCompensated",
                    ") rounds in the host kernel, but a bf16 parameter on ", p.device(),
                    kernel_ == Kernel::kAten ? " under set_kernel(kAten)" : "",
                    " steps with ATen's fused kernel, which rounds to nearest; use "
                    "Bf16Rounding::kNearest there, or step the shards on the host "
                    "(offload_optimizer)");
        on_aten.push_back(p);
      }
    }
    if (!on_aten.empty()) step_aten(on_aten, o);
  }
  if (nvme_) nvme_->run(to_kernel(isa));  // the updates step_param queued
  return loss;
}

// Device parameters: ATen's fused kernel over lists of tensors that share a device and a
// dtype, as torch.optim.AdamW(fused=True) groups them. The state stays AdamW's (an int64
// step, exp_avg and exp_avg_sq shaped like the parameter), so a checkpoint of it loads
// into either kernel; the kernel reads each step from a float32 tensor on the device,
// made from the state's steps in one copy per launch.
void FusedAdamW::step_aten(const std::vector<torch::Tensor>& params,
                           const torch::optim::AdamWOptions& o) {
  using Key = std::tuple<int, int, int>;  // device type, device index, dtype
  std::map<Key, std::vector<torch::Tensor>> buckets;
  for (const auto& p : params) {
    TORCH_CHECK(p.is_floating_point(), "FusedAdamW steps floating-point parameters; got ",
                p.toString());
    TORCH_CHECK(!p.grad().is_sparse(), "FusedAdamW does not support sparse gradients");
    buckets[Key{static_cast<int>(p.device().type()), p.device().index(),
                static_cast<int>(p.scalar_type())}]
        .push_back(p);
  }
  for (auto& [key, ps] : buckets) {
    std::vector<torch::Tensor> grads, exp_avgs, exp_avg_sqs;
    std::vector<float> steps;
    for (auto& p : ps) {
      TORCH_CHECK(p.is_contiguous(), "FusedAdamW steps contiguous parameters; got ", p.toString(),
                  " (not contiguous)");
      torch::Tensor g = p.grad();
      if (g.scalar_type() != p.scalar_type() || g.device() != p.device() || !g.is_contiguous())
        g = g.to(p.options()).contiguous();
      const auto state_key = detail::optim_state_key(state(), p);
      auto it = state().find(state_key);
      if (it == state().end()) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
        st->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
        it = state().emplace(state_key, std::move(st)).first;
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
      // State from elsewhere (a checkpoint read to the host, another dtype): moved once.
      for (auto* t : {&st.exp_avg(), &st.exp_avg_sq()}) {
        if (t->device() != p.device() || t->scalar_type() != p.scalar_type() || !t->is_contiguous())
          *t = t->to(p.options()).contiguous();
      }
      st.step(st.step() + 1);
      grads.push_back(g);
      exp_avgs.push_back(st.exp_avg());
      exp_avg_sqs.push_back(st.exp_avg_sq());
      steps.push_back(static_cast<float>(st.step()));
    }
    const torch::Tensor step_values =
        torch::tensor(steps, torch::kFloat).to(ps.front().device(), /*non_blocking=*/false);
    std::vector<torch::Tensor> state_steps;
    state_steps.reserve(ps.size());
    for (int64_t i = 0; i < static_cast<int64_t>(ps.size()); ++i)
      state_steps.push_back(step_values.select(0, i));
    at::_fused_adamw_(ps, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, state_steps, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
    // at::_fused_adamw_ writes in place without bumping the version counters (as called
    // here, under no_grad, it never passes through autograd's in-place bookkeeping). The
    // engine tells a changed shard by its version (Note [Persistent parameters]: zero1
    // and zero2 regather after a step), so bump them as the host kernels do; without it
    // zero1 and zero2 trained on stale parameters on a GPU.
    for (size_t i = 0; i < ps.size(); ++i) {
      ps[i].unsafeGetTensorImpl()->bump_version();
      exp_avgs[i].unsafeGetTensorImpl()->bump_version();
      exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
    }
  }
}

void FusedAdamW::set_bf16_rounding(Bf16Rounding rounding, uint64_t seed) {
  bf16_rounding_ = rounding;
  rounding_seed_ = seed;
  if (rounding != Bf16Rounding::kCompensated) compensation_.clear();
}

int64_t FusedAdamW::compensation_bytes() const {
  int64_t n = 0;
  for (const auto& [_, c] : compensation_) n += static_cast<int64_t>(c.nbytes());
  return n;
}

// Note [Pure bf16 rounding]
// A bf16 parameter's update is computed in fp32 (AdamW's formula, as torch's AdamW) and
// written back in bf16. Round-to-nearest loses every update below half an ulp (2^-8 of
// the value): a parameter near 1 stops moving once lr * |m/sqrt(v)| < 2^-9. Stochastic
// rounding adds 16 uniform random bits below a float's top 16 (the bf16 part) before
// truncating, so it rounds up with probability equal to the dropped fraction of an ulp
// and the expected value is the fp32 result. The compensated form keeps the dropped part
// in a second bf16 tensor (Kahan summation) and adds it to the next update.
//
// One fused pass per parameter (detail::adamw_update_bf16, src/optim/bf16_adamw_body.inc)
// over chunks of the intra-op pool: it reads the bf16 parameter, gradient (bf16 or fp32),
// moments (and compensation), does the arithmetic of the ATen op chain it replaced op for
// op, and writes the moments rounded to nearest even, so kNearest and kCompensated give
// that chain's bits (tests/test_pure_bf16.cpp checks it against the chain). kStochastic's
// random bits are counter-based: a hash of the element's index under a key made of the
// seed of set_bf16_rounding, the parameter's position in the optimizer's groups and its
// step count, so they do not depend on the number of threads or on the chunking, and a
// resumed run (same seed, same steps) draws the same bits.
void FusedAdamW::step_bf16(torch::Tensor& p, const torch::optim::AdamWOptions& o,
                           int64_t position) {
  TORCH_CHECK(p.is_contiguous(), "FusedAdamW steps contiguous parameters; got ", p.toString(),
              " (not contiguous)");
  const auto key = detail::optim_state_key(state(), p);
  auto it = state().find(key);
  if (it == state().end()) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(0);
    st->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    st->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    it = state().emplace(key, std::move(st)).first;
  }
  auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
  for (auto* t : {&st.exp_avg(), &st.exp_avg_sq()}) {
    if (t->scalar_type() != torch::kBFloat16 || !t->is_contiguous() || !t->is_cpu())
      *t = t->to(torch::kCPU, torch::kBFloat16).contiguous();
    TORCH_CHECK(t->numel() == p.numel(), "FusedAdamW: the state of a bf16 parameter of ", p.numel(),
                " elements has ", t->numel(),
                " (loaded for another parameter?); load a state that matches the parameters");
  }
  st.step(st.step() + 1);
  const detail::AdamWConstants c = adamw_constants(o, st.step());
  torch::Tensor g = p.grad();
  TORCH_CHECK(!g.is_sparse(), "FusedAdamW does not support sparse gradients");
  TORCH_CHECK(g.numel() == p.numel(), "FusedAdamW: the gradient has ", g.numel(),
              " elements but its parameter ", p.numel());
  if (!g.is_cpu() || !g.is_contiguous() ||
      (g.scalar_type() != torch::kBFloat16 && g.scalar_type() != torch::kFloat))
    g = g.to(torch::kCPU, torch::kFloat).contiguous();
  detail::Bf16Arrays a;
  a.p = reinterpret_cast<uint16_t*>(p.data_ptr());
  if (g.scalar_type() == torch::kFloat) {
    a.grad_f32 = g.data_ptr<float>();
  } else {
    a.grad_bf16 = reinterpret_cast<const uint16_t*>(g.data_ptr());
  }
  a.exp_avg = reinterpret_cast<uint16_t*>(st.exp_avg().data_ptr());
  a.exp_avg_sq = reinterpret_cast<uint16_t*>(st.exp_avg_sq().data_ptr());
  torch::Tensor* comp = nullptr;
  switch (bf16_rounding_) {
    case Bf16Rounding::kNearest:
      a.write = detail::Bf16Write::kNearest;
      break;
    case Bf16Rounding::kStochastic:
      a.write = detail::Bf16Write::kStochastic;
      a.key = splitmix64(splitmix64(splitmix64(rounding_seed_) ^ static_cast<uint64_t>(position)) ^
                         static_cast<uint64_t>(st.step()));
      break;
    case Bf16Rounding::kCompensated: {
      a.write = detail::Bf16Write::kCompensated;
      auto [cb, fresh] = compensation_.try_emplace(p.unsafeGetTensorImpl());
      if (fresh || !cb->second.defined() || cb->second.numel() != p.numel())
        cb->second = torch::zeros_like(p, at::MemoryFormat::Contiguous);
      comp = &cb->second;
      a.comp = reinterpret_cast<uint16_t*>(comp->data_ptr());
      break;
    }
  }
  const detail::KernelIsa kernel = to_kernel(active_isa());
  detail::for_each_range(
      p, [&](int64_t b, int64_t e) { detail::adamw_update_bf16(kernel, c, a, b, e); });
  // Written through raw pointers: tell the version counters, as in-place ops do.
  p.unsafeGetTensorImpl()->bump_version();
  st.exp_avg().unsafeGetTensorImpl()->bump_version();
  st.exp_avg_sq().unsafeGetTensorImpl()->bump_version();
  if (comp != nullptr) comp->unsafeGetTensorImpl()->bump_version();
}

bool FusedAdamW::aten_kernel_available(const torch::Device& device) {
  try {
    const auto opts = torch::TensorOptions(torch::kFloat).device(device);
    auto p = torch::ones({1}, opts), g = torch::ones({1}, opts);
    auto m = torch::zeros({1}, opts), v = torch::zeros({1}, opts), s = torch::ones({}, opts);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {s}, 1e-3, 0.9, 0.999, 0.0, 1e-8, false, false);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

void FusedAdamW::step_param(torch::Tensor& p, const torch::optim::AdamWOptions& o, Isa isa) {
  const torch::Tensor g = fp32_grad(p);
  auto& st = adamw_state(state(), p, nvme_.get());
  st.step(st.step() + 1);
  const detail::AdamWConstants c = adamw_constants(o, st.step());
  uint16_t* out = nullptr;
  detail::CopyOutDtype kind = detail::CopyOutDtype::kNone;
  auto co = copy_out_.find(p.unsafeGetTensorImpl());
  if (co != copy_out_.end()) {
    out = reinterpret_cast<uint16_t*>(co->second.out.data_ptr());
    kind = co->second.out.scalar_type() == torch::kBFloat16 ? detail::CopyOutDtype::kBF16
                                                            : detail::CopyOutDtype::kF16;
  }
  if (nvme_) {
    nvme_->queue(p, g, c, out, kind, co != copy_out_.end() ? co->second.written : nullptr);
    return;
  }
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = st.exp_avg().data_ptr<float>();
  float* vp = st.exp_avg_sq().data_ptr<float>();
  const detail::KernelIsa kernel = to_kernel(isa);
  // Ranges of 64K elements or more over the intra-op pool (for_each_range).
  detail::for_each_range(p, [&](int64_t b, int64_t e) {
    detail::adamw_update(kernel, c, pp + b, gp + b, mp + b, vp + b, e - b, out ? out + b : nullptr,
                         kind);
  });
  // Written through raw pointers: tell the version counter, as in-place ops do.
  p.unsafeGetTensorImpl()->bump_version();
  st.exp_avg().unsafeGetTensorImpl()->bump_version();
  st.exp_avg_sq().unsafeGetTensorImpl()->bump_version();
  if (co != copy_out_.end() && co->second.written) co->second.written->store(p._version());
}

}  // namespace fsdp
