// choose_device and backend_for (process_group.h): which device a process of the job
// computes on, from a user's --device value and LOCAL_RANK.
#include <fsdp/process_group.h>

#include "comm/backend.h"

#include <cctype>
#include <cstdlib>
#include <string>

namespace fsdp {
namespace {

// "N" of "cuda:N" as a device index, or -1 when it is not a plain non-negative number.
int64_t parse_device_index(const std::string& digits) {
  if (digits.empty() || digits.size() > 4) return -1;
  for (char c : digits)
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  return std::stoll(digits);
}

// The error for a CUDA choice that this build or this machine cannot honour.
void check_cuda_usable(const std::string& spec, const std::string& what) {
  TORCH_CHECK(detail::nccl_available(), what, " ", spec,
              ": this fsdp-libtorch is built against a LibTorch without CUDA (a CPU-only build, "
              "e.g. Debian's libtorch); rebuild it against a CUDA LibTorch (PyPI's torch, or "
              "pytorch.org's CUDA LibTorch) or use ",
              what, " cpu");
  const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK(n > 0, what, " ", spec,
              ": no CUDA device is visible (torch::cuda::device_count() = 0); run on a GPU "
              "machine (check nvidia-smi and CUDA_VISIBLE_DEVICES) or use ",
              what, " cpu");
}

// The ranks the launcher started on this machine (LOCAL_WORLD_SIZE: fsdp-run, torchrun),
// 1 when it does not say.
int64_t ranks_on_this_machine() {
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  const int64_t n = local_world ? std::atoll(local_world) : 1;
  return n > 0 ? n : 1;
}

}  // namespace

void detail::check_backend_name(const std::string& name, const std::string& option,
                                core::Surface s) {
  try {  // the options core's rule (Note [Options core])
    core::check_backend(name, option, s);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

torch::Device choose_device(const std::string& spec, const std::string& what,
                            const std::string& backend) {
  detail::check_backend_name(backend, "backend", core::Surface::kFlags);
  if (spec == "cpu") return torch::kCPU;
  if (spec == "auto" || spec.empty()) {
    // The GPUs, when there is one for each of this node's ranks: NCCL refuses two ranks
    // of a group on one GPU, so more ranks than GPUs train on the CPU (over Gloo).
    if (!detail::nccl_available() || !torch::cuda::is_available()) return torch::kCPU;
    if (ranks_on_this_machine() > static_cast<int64_t>(torch::cuda::device_count()))
      return torch::kCPU;
    return choose_device("cuda", what, backend);
  }
  if (spec == "cuda") {
    check_cuda_usable(spec, what);
    const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
    const int64_t ranks = ranks_on_this_machine();
    // Gloo's ranks may share a GPU (Note [Gloo with CUDA tensors]); NCCL's may not.
    TORCH_CHECK(ranks <= n || backend == "gloo", what, " ", spec, ": ", ranks,
                " ranks run on this machine (LOCAL_WORLD_SIZE) but ", n,
                n == 1 ? " GPU is" : " GPUs are",
                " visible, and NCCL needs a GPU of its own for each rank; start at most ", n,
                " ranks per machine (e.g. fsdp-run --nproc ", n, "), use ", what,
                " cpu, or let ranks share a GPU over Gloo (backend gloo: slower, for tests)");
    const LaunchEnv env = read_launch_env();
    return {torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % n)};
  }
  if (spec.rfind("cuda:", 0) == 0) {
    const int64_t index = parse_device_index(spec.substr(5));
    TORCH_CHECK(index >= 0, what, " ", spec,
                " is not a device; use cpu, cuda, cuda:N (N = a GPU's index, 0-based) or auto");
    check_cuda_usable(spec, what);
    const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK(index < n, what, " ", spec, ": there is no GPU ", index, "; ", n,
                n == 1 ? " CUDA device is" : " CUDA devices are",
                " visible (torch::cuda::device_count() = ", n, "); use cuda:0",
                n > 1 ? " to cuda:" + std::to_string(n - 1) : std::string(),
                ", or cuda to take the GPU of LOCAL_RANK");
    return {torch::kCUDA, static_cast<c10::DeviceIndex>(index)};
  }
  TORCH_CHECK(false, what, " ", spec,
              " is not a device; use cpu, cuda, cuda:N (N = a GPU's index, 0-based) or auto");
}

std::string backend_for(const torch::Device& device) { return device.is_cuda() ? "nccl" : "gloo"; }

std::string backend_for(const torch::Device& device, const std::string& choice,
                        const std::string& what) {
  if (choice == "auto") return backend_for(device);
  detail::check_backend_name(choice, what, core::Surface::kFlags);
  TORCH_CHECK(choice == "gloo" || device.is_cuda(), what, " nccl needs a GPU, but the device is ",
              device.str(), "; use ", what, " gloo (or auto) on the CPU");
  return choice;
}

}  // namespace fsdp
